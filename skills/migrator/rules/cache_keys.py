"""A layer that offsets the cache index it updates (`cache.update(k, v, self.layer_idx + offset)`, as
recurrent-depth models give each pass over a layer its own cache layer) keeps that offset as the runtime's
`cache_key`: it moves onto the function's attention call (`attention_interface(..., cache_key=offset)`), which
MG005 hands to the runtime `Attention`, keeping a cache per key. Runs before MG004 folds the cache branch away.

An offset in a function without such a call (attention written out by hand), or two different offsets in one
function, are refused by name."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import Transformer, appended, called_name, classes, code, findall, kwarg
from skills.migrator.rule import Rule
from skills.migrator.rules.fold_hf_only_params import CACHES
from skills.migrator.rules.runtime_attention import INTERFACE

LAYER_IDX = m.Attribute(m.Name("self"), m.Name("layer_idx"))
UPDATE = m.Call(func=m.Attribute(value=m.OneOf(*map(m.Name, CACHES)), attr=m.Name("update")))


def _offset(update: cst.Call, fn: cst.FunctionDef) -> cst.BaseExpression | None:
    """`offset` of `cache.update(k, v, self.layer_idx + offset)` (either order, or as `layer_idx=`, or through a
    name fn binds once to it: Inkling2-Loop's `cache_layer_idx = self.layer_idx + cache_offset`)."""
    index = kwarg(update, "layer_idx") or (update.args[2] if len(update.args) > 2 else None)
    value = None if index is None else index.value
    if isinstance(value, cst.Name):
        bound = [a.value for a in findall(fn, m.Assign([m.AssignTarget(m.Name(value.value))]))]
        value = bound[0] if len(bound) == 1 else value
    if not m.matches(value, m.BinaryOperation(operator=m.Add())):
        return None
    left, right = value.left, value.right
    return right if m.matches(left, LAYER_IDX) else left if m.matches(right, LAYER_IDX) else None


class CacheKeys(Rule):
    ID = "MG023"
    DESCRIPTION = (
        "An offset added to the layer index a cache update uses becomes the attention call's cache_key."
    )

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        replacements: dict[cst.Call, cst.Call] = {}
        for name, cls in classes(module).items():
            for fn in findall(cls.body, m.FunctionDef()):
                offsets = {code(o): o for u in findall(fn, UPDATE) if (o := _offset(u, fn)) is not None}
                if not offsets:
                    continue
                calls = [c for c in findall(fn, m.Call(func=m.Name())) if called_name(c) in INTERFACE]
                if len(offsets) > 1 or len(calls) != 1:
                    why = (
                        "by more than one offset"
                        if len(offsets) > 1
                        else "which has no single attention_interface call to carry it as `cache_key`"
                    )
                    self.rewrite.unsupported(
                        name,
                        0,
                        f"the cache layer index is offset by `{'`, `'.join(offsets)}` (a layer applied several "
                        f"times, each with a cache of its own) in `{fn.name.value}`, {why}",
                    )
                    continue
                (call,) = calls
                if kwarg(call, "cache_key") is None:
                    replacements[call] = appended(call, "cache_key", next(iter(offsets)))
        return module.visit(_Replace(replacements)) if replacements else module


class _Replace(Transformer):
    def __init__(self, replacements: dict[cst.Call, cst.Call]):
        self.replacements = replacements

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        return self.replacements.get(original, updated)
