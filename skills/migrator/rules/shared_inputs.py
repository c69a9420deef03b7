"""Forward parameters that every call binds to the same name are one input: CTRL's attention is
`forward(self, v, k, q, ...)`, and its one caller passes `normed, normed, normed`. They become one parameter,
`hidden_states` (the first of them keeps its name when forward already uses that one), read wherever any of them
was, and the calls pass it once; the parallel rules then see q / k / v projected from one input. Only modules whose
every call this file shows (the class name and its instances used nowhere else), and only parameters forward never
rebinds."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.call_sites import binding, call_sites, named_params
from skills.migrator.cst_utils import (
    Transformer,
    assigned_names,
    classes,
    findall,
    free_names,
    method,
    without_dangling_comma,
)
from skills.migrator.rule import Rule

MERGED = "hidden_states"


class _Rename(Transformer):
    """Reads of any name in old become new (attribute and keyword names are not reads)."""

    def __init__(self, old: set[str], new: str):
        self.old, self.new = old, new

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.Name:
        return updated.with_changes(value=self.new) if updated.value in self.old else updated

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.Attribute:
        return updated.with_changes(attr=original.attr)

    def leave_Arg(self, original: cst.Arg, updated: cst.Arg) -> cst.Arg:
        return updated.with_changes(keyword=original.keyword)


def _shared(fwd: cst.FunctionDef, calls: list[cst.Call]) -> list[cst.Param]:
    """The first group of forward's parameters (in order) that every call binds to one and the same name."""
    rebound = assigned_names(fwd.body) | {p.name.value for p in findall(fwd.body, m.Param())}
    groups: dict[tuple[str, ...], list[cst.Param]] = {}
    for p in named_params(fwd):
        if p.name.value == "self" or p.name.value in rebound:
            continue
        bound = [binding(c, fwd, p) for c in calls]
        if all(a is not None and isinstance(a.value, cst.Name) for a in bound):
            groups.setdefault(tuple(a.value.value for a in bound), []).append(p)
    return next((g for g in groups.values() if len(g) > 1), [])


class _Merge(Transformer):
    """One class's forward takes its shared parameters as one, and its calls pass that once."""

    def __init__(self, fwd: cst.FunctionDef, group: list[cst.Param], calls: list[cst.Call]):
        self.fwd = fwd
        taken = {p.name.value for p in named_params(fwd)} - {p.name.value for p in group}
        self.name = MERGED if MERGED not in taken | free_names(fwd.body) else group[0].name.value
        self.kept, self.dropped = group[0], {p.name.value for p in group[1:]}
        # each call -> the arguments it binds to the dropped parameters
        self.args = {id(call): {id(binding(call, fwd, p)) for p in group[1:]} for call in calls}
        self.kept_args = {id(binding(call, fwd, group[0])) for call in calls}

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        if original is not self.fwd:
            return updated

        def keep(params):
            return [
                p.with_changes(name=cst.Name(self.name)) if p.name.value == self.kept.name.value else p
                for p in params
                if p.name.value not in self.dropped
            ]

        ps = updated.params
        params = ps.with_changes(
            posonly_params=keep(ps.posonly_params),
            params=keep(ps.params),
            kwonly_params=keep(ps.kwonly_params),
        )
        body = updated.body.visit(_Rename({self.kept.name.value, *self.dropped}, self.name))
        return updated.with_changes(params=params, body=body)

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        dropped = self.args.get(id(original))
        if dropped is None:
            return updated
        args = []
        for before, after in zip(original.args, updated.args, strict=True):
            if id(before) in dropped:
                continue
            if id(before) in self.kept_args and after.keyword is not None:
                after = after.with_changes(keyword=cst.Name(self.name))
            args.append(after)
        return updated.with_changes(args=without_dangling_comma(args, original.args))


class SharedInputs(Rule):
    ID = "MG027"
    DESCRIPTION = "Forward parameters every call binds to one name are one parameter (CTRL's v, k, q)."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        while True:  # one class at a time: each merge changes the calls the next one reads
            local, sites = classes(module), call_sites(module)
            for name, where in sites.items():
                fwd = method(local[name], "forward")
                if fwd is None or where.name_escapes or where.instances_escape or not where.called:
                    continue
                if group := _shared(fwd, where.called):
                    module = module.visit(_Merge(fwd, group, where.called))
                    break
            else:
                return module
