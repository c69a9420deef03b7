"""A module whose forward is Llama's RMS norm, written out in five statements (the form transformers copies into
most of its models), returns the runtime's `rms_norm` of its input instead: one pass over each row on the host with
the same roundings, the same expression elsewhere. The weight may multiply the rounded rows (Llama) or the float
rows before one rounding (`(self.weight * x).to(input_dtype)`). Any other statement, name or order is left as is.

The forward is compared with the form after Python's own parser has read both, so layout and comments do not
matter, and the local names, the input's and the weight's and epsilon's attributes are read from the code."""

import ast
import textwrap

import libcst as cst

from skills.migrator.cst_utils import classes, method
from skills.migrator.rule import Rule

FORM = """\
{dtype} = {x}.dtype
{x} = {x}.to(torch.float32)
{var} = {x}.pow(2).mean(-1, keepdim=True)
{x} = {x} * torch.rsqrt({var} + self.{eps})
"""
ROUNDED_FIRST = "return self.{weight} * {x}.to({dtype})"
WEIGHT_IN_FLOAT = "return (self.{weight} * {x}).to({dtype})"


def _unparsed(code: str) -> list[str]:
    return [ast.unparse(s) for s in ast.parse(code).body]


def _names(body: list[ast.stmt], x: str) -> dict[str, str] | None:
    """The names the form needs, read from where it has them: None unless the body has five statements in
    the places the form binds names."""
    if len(body) != 5 or not all(isinstance(s, ast.Assign) and len(s.targets) == 1 for s in body[:4]):
        return None
    dtype, var = body[0].targets[0], body[2].targets[0]
    scaled, product = body[3].value, body[4]
    if not (isinstance(dtype, ast.Name) and isinstance(var, ast.Name) and isinstance(scaled, ast.BinOp)):
        return None
    rsqrt = scaled.right
    if not (isinstance(rsqrt, ast.Call) and len(rsqrt.args) == 1 and isinstance(rsqrt.args[0], ast.BinOp)):
        return None
    eps = rsqrt.args[0].right
    weight = next(
        (n for n in ast.walk(product) if isinstance(n, ast.Attribute) and n.attr != "to"),
        None,
    )
    if not (isinstance(eps, ast.Attribute) and weight is not None):
        return None
    return {"x": x, "dtype": dtype.id, "var": var.id, "eps": eps.attr, "weight": weight.attr}


def rms_norm_call(forward: cst.FunctionDef) -> str | None:
    """The `rms_norm(...)` expression forward computes, or None when it is not Llama's RMS norm."""
    params = forward.params
    if (
        forward.decorators
        or len(params.params) != 2
        or params.params[1].default is not None
        or isinstance(params.star_arg, cst.Param)
        or params.kwonly_params
        or params.star_kwarg
    ):
        return None
    x = params.params[1].name.value
    tree = ast.parse(textwrap.dedent(cst.Module([]).code_for_node(forward)))
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    names = _names(body, x)
    if names is None:
        return None
    code = [ast.unparse(s) for s in body]
    if code[:4] != _unparsed(FORM.format(**names)):
        return None
    for last, in_float in ((ROUNDED_FIRST, False), (WEIGHT_IN_FLOAT, True)):
        if code[4] == ast.unparse(ast.parse(last.format(**names)).body[0]):
            flag = ", weight_in_float=True" if in_float else ""
            return f"rms_norm({x}, self.{names['weight']}, self.{names['eps']}{flag})"
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
        return module.visit(_ReplaceBodies(calls))


class _ReplaceBodies(cst.CSTTransformer):
    def __init__(self, calls: dict[cst.FunctionDef, str]):
        self.calls = calls

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        call = self.calls.get(original)
        if call is None:
            return updated
        statements = list(updated.body.body)
        docstring = statements[:1] if _is_docstring(statements[0]) else []
        body = [*docstring, cst.parse_statement(f"return {call}")]
        return updated.with_changes(body=updated.body.with_changes(body=body))


def _is_docstring(statement: cst.BaseStatement) -> bool:
    return (
        isinstance(statement, cst.SimpleStatementLine)
        and isinstance(statement.body[0], cst.Expr)
        and isinstance(statement.body[0].value, cst.SimpleString | cst.ConcatenatedString)
    )
