"""A cache parameter named otherwise than transformers' (ChatGLM's `kv_cache` / `kv_caches`) is known by what is
done with it: keys and values go into it (`kv_cache.update(k, v, ...)`), its length is read
(`.get_seq_length()`), or it is handed on to such a parameter by keyword. It is renamed `past_key_values` (in the
function's signature and body, and as the keyword its callers pass it by), so that the rules that fold
transformers' caches away fold it too. A function already holding a `past_key_values` is left alone."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.call_sites import named_params
from skills.migrator.cst_utils import Transformer, findall
from skills.migrator.rule import Rule
from skills.migrator.rules.fold_hf_only_params import CACHES

CANONICAL = "past_key_values"
LENGTHS = m.Name("get_seq_length") | m.Name("get_mask_sizes")


def _used_as_cache(fn: cst.FunctionDef, name: str) -> bool:
    """Keys and values go into it (two arguments at least: a dict's `update` takes one) or its length is read."""
    key_value = [m.Arg(keyword=None), m.Arg(keyword=None), m.ZeroOrMore()]
    update = m.Call(m.Attribute(m.Name(name), m.Name("update")), key_value)
    return bool(findall(fn.body, update | m.Call(m.Attribute(m.Name(name), LENGTHS))))


def _handed_on(fn: cst.FunctionDef, name: str, caches: set[str]) -> bool:
    """fn passes its parameter `name` as the keyword argument of a cache parameter (`kv_cache=kv_caches`)."""
    return bool(findall(fn.body, m.Arg(m.Name(name), keyword=m.OneOf(*map(m.Name, caches or {CANONICAL})))))


def cache_params(module: cst.Module) -> set[str]:
    """The parameter names, other than transformers', that hold a cache wherever module takes them."""
    every = findall(module, m.FunctionDef())
    holding = [CANONICAL in _names(fn) for fn in every]
    # a name some function holding `past_key_values` already takes too stays: its callers' keywords must match
    kept = {p.name.value for fn, h in zip(every, holding) if h for p in named_params(fn)} | CACHES
    fns = [fn for fn, h in zip(every, holding) if not h]
    params = [(fn, p.name.value) for fn in fns for p in named_params(fn)]
    while True:
        found = {name for fn, name in params if name not in kept and _used_as_cache(fn, name)}
        while more := {n for fn, n in params if n not in found | kept and _handed_on(fn, n, found)}:
            found |= more
        # renamed everywhere or nowhere: a name some function takes for something else stays, and so do those
        # handed on to it
        other = {
            n for fn, n in params if n in found and not (_used_as_cache(fn, n) or _handed_on(fn, n, found))
        }
        if not other:
            return found
        kept |= other


def _names(fn: cst.FunctionDef) -> set[str]:
    return {n.value for n in findall(fn, m.Name())}


class _Renamed(Transformer):
    def __init__(self, caches: set[str]):
        self.caches = caches
        self.inside: list[bool] = []  # per enclosing function: whether it renames

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        own = {p.name.value for p in named_params(node)} & self.caches
        enclosing = bool(self.inside) and self.inside[-1]  # a closure reads the enclosing function's names
        self.inside.append((bool(own) or enclosing) and CANONICAL not in _names(node))

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
