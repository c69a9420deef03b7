"""A cache parameter named otherwise than transformers' (ChatGLM's `kv_cache` / `kv_caches`) is known by what is
done with it: keys and values go into it (`kv_cache.update(k, v, ...)`), its length is read
(`.get_seq_length()`), or it is handed on to such a parameter by keyword. It is renamed `past_key_values` (in the
function's signature and body, and as the keyword its callers pass it by), so that the rules that fold
transformers' caches away fold it too. A function already holding a `past_key_values` is left alone."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.call_sites import named_params
from skills.migrator.rule import Rule
from skills.migrator.rules.fold_hf_only_params import CACHES

CANONICAL = "past_key_values"
LENGTHS = m.Name("get_seq_length") | m.Name("get_mask_sizes")


def _used_as_cache(fn: cst.FunctionDef, name: str) -> bool:
    """Keys and values go into it (two arguments at least: a dict's `update` takes one) or its length is read."""
    update = m.Call(m.Attribute(m.Name(name), m.Name("update")), [m.Arg(), m.Arg(), m.ZeroOrMore()])
    return bool(m.findall(fn.body, update | m.Call(m.Attribute(m.Name(name), LENGTHS))))


def _handed_on(fn: cst.FunctionDef, name: str, caches: set[str]) -> bool:
    """fn passes its parameter `name` as the keyword argument of a cache parameter (`kv_cache=kv_caches`)."""
    return bool(m.findall(fn.body, m.Arg(m.Name(name), keyword=m.OneOf(*map(m.Name, caches or {CANONICAL})))))


def cache_params(module: cst.Module) -> set[str]:
    """The parameter names, other than transformers', that hold a cache somewhere in module."""
    every = m.findall(module, m.FunctionDef())
    fns = [fn for fn in every if CANONICAL not in _names(fn)]
    # a name some function holding `past_key_values` already takes too stays: its callers' keywords must match
    taken = {p.name.value for fn in every if CANONICAL in _names(fn) for p in named_params(fn)}
    params = {
        (id(fn), p.name.value) for fn in fns for p in named_params(fn) if p.name.value not in CACHES | taken
    }
    by_id = {id(fn): fn for fn in fns}
    found = {name for key, name in params if _used_as_cache(by_id[key], name)}
    while True:
        more = {name for key, name in params if name not in found and _handed_on(by_id[key], name, found)}
        if not more:
            return found
        found |= more


def _names(fn: cst.FunctionDef) -> set[str]:
    return {n.value for n in m.findall(fn, m.Name())}


class _Renamed(cst.CSTTransformer):
    def __init__(self, caches: set[str]):
        self.caches = caches
        self.inside: list[bool] = []  # per enclosing function: whether it renames

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        own = {p.name.value for p in named_params(node)} & self.caches
        self.inside.append(bool(own) and CANONICAL not in _names(node))

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        self.inside.pop()
        return updated

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.Name:
        renames = bool(self.inside) and self.inside[-1] and updated.value in self.caches
        return updated.with_changes(value=CANONICAL) if renames else updated

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.Attribute:
        return updated.with_changes(attr=original.attr)  # `self.kv_cache` is another name

    def leave_Arg(self, original: cst.Arg, updated: cst.Arg) -> cst.Arg:
        if updated.keyword is not None and updated.keyword.value in self.caches:
            return updated.with_changes(keyword=cst.Name(CANONICAL))
        return updated


class CacheParams(Rule):
    ID = "MG036"
    DESCRIPTION = "A cache parameter named otherwise than transformers' is renamed past_key_values."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        caches = cache_params(module)
        return module.visit(_Renamed(caches)) if caches else module
