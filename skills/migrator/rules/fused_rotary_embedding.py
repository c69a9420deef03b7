"""A function that is transformers' `apply_rotary_pos_emb` written out (cos and sin unsqueezed, then
`q * cos + rotate_half(q) * sin` and the same for k, with `rotate_half` the half-split rotation of this file) returns
the runtime's `rotary_embedding` of its arguments instead: one pass per tensor on the host with the same roundings,
the same expression elsewhere. Partial rotary, interleaved halves, casts and anything else are left as they are.

Both functions are compared with their forms as Python's parser reads them (layout, parentheses and comments do not
matter); parameter and local names are read from the code."""

import ast

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import assigned_names, findall
from skills.migrator.rule import Rule
from skills.migrator.rules._forms import (
    ReturnInstead,
    assigned_targets,
    plain_parameters,
    statements,
    unparsed,
)

ROTATE_HALF = """\
{low} = {x}[..., :{x}.shape[-1] // 2]
{high} = {x}[..., {x}.shape[-1] // 2:]
return torch.cat((-{high}, {low}), dim=-1)
"""
APPLY = """\
{cos} = {cos}.unsqueeze({dim})
{sin} = {sin}.unsqueeze({dim})
{q_out} = {q} * {cos} + {rotate}({q}) * {sin}
{k_out} = {k} * {cos} + {rotate}({k}) * {sin}
return ({q_out}, {k_out})
"""


def _rotates_half(function: cst.FunctionDef) -> bool:
    params, body = plain_parameters(function), statements(function)
    if params is None or len(params) != 1 or (targets := assigned_targets(body, 2)) is None:
        return False
    if len({params[0], *targets}) != 3:  # one name for two values reads differently
        return False
    return unparsed(body) == unparsed(ROTATE_HALF.format(x=params[0], low=targets[0], high=targets[1]))


def _bound_once(module: cst.Module, name: str) -> bool:
    """name is bound by one top-level statement only (a later def, import or assignment would replace it)."""
    defined = [
        s for s in module.body if isinstance(s, cst.FunctionDef | cst.ClassDef) and s.name.value == name
    ]
    imported = findall(
        module, m.ImportAlias(asname=m.AsName(m.Name(name))) | m.ImportAlias(m.Name(name), asname=None)
    )
    assigned = [
        s
        for s in module.body
        if not isinstance(s, cst.FunctionDef | cst.ClassDef) and name in assigned_names(s)
    ]
    return len(defined) + len(imported) + len(assigned) == 1


def rotary_call(function: cst.FunctionDef, rotations: set[str]) -> str | None:
    """The `rotary_embedding(...)` expression the function computes, given the names of the file's half-split
    rotations, or None when it is not apply_rotary_pos_emb."""
    params, body = plain_parameters(function), statements(function)
    if params is None or len(params) != 5 or (targets := assigned_targets(body, 4)) is None:
        return None
    called = [
        n.func.id for n in ast.walk(body[2]) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    ]
    if len(called) != 1 or called[0] not in rotations:
        return None
    q, k, cos, sin, dim = params
    if len({*params, called[0], targets[2], targets[3]}) != 8:  # one name for two values reads differently
        return None
    names = {"q": q, "k": k, "cos": cos, "sin": sin, "dim": dim, "rotate": called[0]}
    if unparsed(body) != unparsed(APPLY.format(**names, q_out=targets[2], k_out=targets[3])):
        return None
    return f"rotary_embedding({q}, {k}, {cos}, {sin}, {dim})"


class FusedRotaryEmbedding(Rule):
    ID = "MG030"
    DESCRIPTION = "apply_rotary_pos_emb written out returns the runtime's rotary_embedding of its arguments."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        functions = [s for s in module.body if isinstance(s, cst.FunctionDef)]
        rotations = {
            f.name.value for f in functions if _rotates_half(f) and _bound_once(module, f.name.value)
        }
        calls = {f: call for f in functions if (call := rotary_call(f, rotations)) is not None}
        if not calls:
            return module
        self.add_needed_import("runtime.layers.rotary", "rotary_embedding")
        return module.visit(ReturnInstead(calls))
