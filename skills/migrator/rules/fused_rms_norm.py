"""A module whose forward is Llama's RMS norm, written out in five statements (the form transformers copies into
most of its models), returns the runtime's `rms_norm` of its input instead: one pass over each row on the host with
the same roundings, the same expression elsewhere. The weight may multiply the rounded rows (Llama) or the float
rows before one rounding (`(self.weight * x).to(input_dtype)`). Any other statement, name or order is left as is.

The forward is compared with the form as Python's parser reads both (layout and comments do not matter); the local
names and the weight's and epsilon's attributes are read from the code."""

import ast

import libcst as cst

from skills.migrator.cst_utils import classes, method
from skills.migrator.rule import Rule
from skills.migrator.rules._forms import (
    ReturnInstead,
    assigned_targets,
    plain_parameters,
    statements,
    unparsed,
)

FORM = """\
{dtype} = {x}.dtype
{x} = {x}.to(torch.float32)
{var} = {x}.pow(2).mean(-1, keepdim=True)
{x} = {x} * torch.rsqrt({var} + self.{eps})
"""
LAST = {
    "return self.{weight} * {x}.to({dtype})": "",
    "return (self.{weight} * {x}).to({dtype})": ", weight_in_float=True",
}


def _names(body: list[ast.stmt], x: str) -> dict[str, str] | None:
    """The names the form binds, read from where it has them, or None when the body has no such places."""
    if len(body) != 5 or (targets := assigned_targets(body, 4)) is None:
        return None
    dtype, var, scaled = targets[0], targets[2], body[3].value
    rsqrt = scaled.right if isinstance(scaled, ast.BinOp) else None
    if not (isinstance(rsqrt, ast.Call) and len(rsqrt.args) == 1 and isinstance(rsqrt.args[0], ast.BinOp)):
        return None
    eps = rsqrt.args[0].right
    weight = next((n for n in ast.walk(body[4]) if isinstance(n, ast.Attribute) and n.attr != "to"), None)
    if not (isinstance(eps, ast.Attribute) and weight is not None):
        return None
    if len({x, dtype, var}) != 3:  # one name for two values reads differently
        return None
    return {"x": x, "dtype": dtype, "var": var, "eps": eps.attr, "weight": weight.attr}


def rms_norm_call(forward: cst.FunctionDef) -> str | None:
    """The `rms_norm(...)` expression forward computes, or None when it is not Llama's RMS norm."""
    params = plain_parameters(forward)
    if params is None or len(params) != 2 or forward.params.params[1].default is not None:
        return None
    body = statements(forward)
    if (names := _names(body, params[1])) is None:
        return None
    code = unparsed(body)
    if code[:4] != unparsed(FORM.format(**names)):
        return None
    for last, flag in LAST.items():
        if code[4:] == unparsed(last.format(**names)):
            return f"rms_norm({names['x']}, self.{names['weight']}, self.{names['eps']}{flag})"
    return None


class FusedRMSNorm(Rule):
    ID = "MG029"
    DESCRIPTION = (
        "A forward that is Llama's RMS norm written out returns the runtime's rms_norm of its input."
    )

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        calls = {}
        for cls in classes(module).values():
            forward = method(cls, "forward")
            if forward is not None and (call := rms_norm_call(forward)) is not None:
                calls[forward] = call
        if not calls:
            return module
        self.add_needed_import("runtime.layers.norm", "rms_norm")
        return module.visit(ReturnInstead(calls))
