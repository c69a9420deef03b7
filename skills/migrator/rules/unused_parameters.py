"""Parameters nothing reads go, with the arguments that fed them: constructor parameters of in-file classes
(`layer_idx` once HF's cache index is gone), keywords a `forward` would swallow into a `**kwargs` it never
reads (`position_ids=` passed to an attention that takes its positions from ForwardMetaData), and then the
`forward` parameters no caller needs any more.

Decided by analysis of this file alone, so it is conservative: a class whose name is used other than in a
constructor call (`EntryClass = ...`, `isinstance`, a base class), an instance used other than by calling it,
a call with `*args` splats, or an argument with side effects leaves its parameter alone, and the runtime
contract's parameters (config, infer_config, comm_manager, prefix, forward_metadata) always stay."""

import libcst as cst

from skills.migrator.call_sites import binding, call_sites, named_params
from skills.migrator.cst_utils import Transformer, classes, free_names, method, pure
from skills.migrator.rule import Rule
from skills.migrator.rules.dead_code import drop_dead_locals_in

CONTRACT = {"self", "config", "infer_config", "comm_manager", "prefix", "forward_metadata"}


def _removable(fn: cst.FunctionDef, calls: list[cst.Call]) -> list[tuple[cst.Param, list[cst.Arg]]]:
    """fn's unread non-contract parameters whose arguments at every call can go, with those arguments."""
    stars = {a.star for c in calls for a in c.args}
    if "*" in stars:
        return []  # a splat could bind the parameter
    # a `**` splat could bind a parameter a call does not bind itself (which it cannot where it does)
    splat = "**" in stars and fn.params.star_kwarg is None
    read = free_names(fn.body)
    out = []
    for param in named_params(fn):
        if param.name.value in CONTRACT or param.name.value in read:
            continue
        args = [binding(c, fn, param) for c in calls]
        if splat and None in args:
            continue
        if all(pure(a.value) for a in args if a is not None):
            out.append((param, [a for a in args if a is not None]))
    return out


def _swallowed(fn: cst.FunctionDef, calls: list[cst.Call]) -> list[cst.Arg]:
    """Keyword arguments that only land in a `**kwargs` fn never reads."""
    star = fn.params.star_kwarg
    if star is None or star.name.value in free_names(fn.body):
        return []
    named = {p.name.value for p in named_params(fn)}
    return [
        a
        for c in calls
        for a in c.args
        if a.keyword is not None and a.keyword.value not in named and pure(a.value)
    ]


class _Remove(Transformer):
    def __init__(self, nodes: set[int]):
        self.nodes = nodes

    def leave_Param(self, original: cst.Param, updated: cst.Param):
        return cst.RemoveFromParent() if id(original) in self.nodes else updated

    def leave_Arg(self, original: cst.Arg, updated: cst.Arg):
        return cst.RemoveFromParent() if id(original) in self.nodes else updated

    def leave_Parameters(self, original: cst.Parameters, updated: cst.Parameters) -> cst.Parameters:
        if isinstance(updated.star_arg, cst.ParamStar) and not updated.kwonly_params:
            return updated.with_changes(
                star_arg=cst.MaybeSentinel.DEFAULT
            )  # a bare `*` needs a kw-only param
        return updated


class UnusedParameters(Rule):
    ID = "MG013"
    DESCRIPTION = (
        "Parameters nothing reads go with their arguments; keywords a forward would swallow are dropped."
    )

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        while True:
            doomed: set[int] = set()
            local = classes(module)
            for name, where in call_sites(module).items():
                init, forward = method(local[name], "__init__"), method(local[name], "forward")
                if method(local[name], "__call__") is not None:
                    forward = None  # calling an instance does not run forward
                if init is not None and not where.name_escapes:
                    for param, args in _removable(init, where.constructed):
                        doomed |= {id(param), *map(id, args)}
                if forward is not None:
                    doomed |= set(map(id, _swallowed(forward, where.called)))
                    if not (where.name_escapes or where.instances_escape):
                        for param, args in _removable(forward, where.called):
                            doomed |= {id(param), *map(id, args)}
            if not doomed:
                return module
            # and the locals only a removed argument read
            module = drop_dead_locals_in(module.visit(_Remove(doomed)), self.rewrite.entry_class)
