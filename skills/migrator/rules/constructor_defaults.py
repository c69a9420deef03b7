"""Constructor parameters that no call in the file passes hold their literal defaults: GPT-2's
`is_cross_attention=False`, once the only call passing True went with the cross-attention block (MG024). Where a
branch tests it, the parameter goes; its reads, and the reads of an attribute `__init__` sets to it
(`self.is_cross_attention`), become the literal, and the branches they decide fold (`if self.is_cross_attention:
... else: ...`); a default only passed on (`device=None`) stays. Only
classes whose every construction this file shows (the name used nowhere else, no splatted arguments), without
in-file bases or subclasses, whose methods all see the same attribute."""

from collections.abc import Collection

import libcst as cst
import libcst.matchers as m

from skills.migrator.call_sites import binding, call_sites, named_params
from skills.migrator.cst_utils import (
    SELF_ATTR,
    Transformer,
    classes,
    findall,
    in_file_bases,
    method,
    without_dangling_comma,
)
from skills.migrator.rule import Rule
from skills.migrator.rules.fold_hf_only_params import NAMED, fold_known

CONTRACT = {"self", "config", "infer_config", "comm_manager", "prefix"}


def _default(param: cst.Param) -> object:
    """The parameter's literal default (True / False / None / an int), else Ellipsis."""
    d = param.default
    if isinstance(d, cst.Integer):
        return d.evaluated_value
    return NAMED.get(d.value, ...) if isinstance(d, cst.Name) else ...


def _never_passed(module: cst.Module) -> dict[str, dict[str, object]]:
    """class -> {parameter: literal default} of its __init__ parameters no constructor call binds."""
    local, sites = classes(module), call_sites(module)
    bases = in_file_bases(local)
    subclassed = set().union(*bases.values())
    found = {}
    for name, where in sites.items():
        init = method(local[name], "__init__")
        calls = where.constructed
        if init is None or where.name_escapes or not calls or bases[name] or name in subclassed:
            continue
        if any(a.star for c in calls for a in c.args):
            continue
        consts = {
            p.name.value: value
            for p in named_params(init)
            if p.name.value not in CONTRACT
            and p.default is not None
            and (value := _default(p)) is not ...
            and all(binding(c, init, p) is None for c in calls)
        }
        if consts := _deciding(local[name], consts):
            found[name] = consts
    return found


def _aliases(cls: cst.ClassDef, params: Collection[str]) -> dict[str, str]:
    """attr -> parameter for `self.attr = <parameter>` statements of __init__'s top level (params), the class's
    only assignment of that attribute."""
    writes = [t.target.attr.value for t in findall(cls, m.AssignTarget(SELF_ATTR))]
    writes += [t.target.attr.value for t in findall(cls, m.AugAssign(SELF_ATTR) | m.AnnAssign(SELF_ATTR))]
    found = {}
    for s in method(cls, "__init__").body.body:
        if m.matches(s, m.SimpleStatementLine([m.Assign([m.AssignTarget(SELF_ATTR)], m.Name())])):
            attr, value = s.body[0].targets[0].target.attr.value, s.body[0].value.value
            if value in params and writes.count(attr) == 1:
                found[attr] = value
    return found


class _ReadAttrs(Transformer):
    """`self.attr` reads -> the attribute's literal (not the assignment targets)."""

    def __init__(self, values: dict[str, object]):
        self.values, self.targets = values, 0

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self.targets += 1

    def leave_AssignTarget(self, original: cst.AssignTarget, updated: cst.AssignTarget) -> cst.AssignTarget:
        self.targets -= 1
        return updated

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.BaseExpression:
        if self.targets or not m.matches(updated, SELF_ATTR) or updated.attr.value not in self.values:
            return updated
        return cst.parse_expression(repr(self.values[updated.attr.value]))


def _deciding(cls: cst.ClassDef, consts: dict[str, object]) -> dict[str, object]:
    """The parameters of consts that a branch of the class tests, directly or through an attribute set to them:
    those whose folding removes code (a default only passed on, `device=None`, stays)."""
    tests = [node.test for node in findall(cls, m.If() | m.IfExp() | m.While())]
    read = {n.value for t in tests for n in findall(t, m.Name())}
    read |= {a.attr.value for t in tests for a in findall(t, SELF_ATTR)}
    read |= {p for a, p in _aliases(cls, consts).items() if a in read}
    return {p: v for p, v in consts.items() if p in read}


def _folded(cls: cst.ClassDef, consts: dict[str, object]) -> cst.ClassDef:
    init = method(cls, "__init__")
    attrs = {a: consts[p] for a, p in _aliases(cls, consts).items()}
    kept = [p for p in init.params.params if p.name.value not in consts]
    params = init.params.with_changes(
        params=without_dangling_comma(kept, init.params.params),
        kwonly_params=[p for p in init.params.kwonly_params if p.name.value not in consts],
    )
    reads = m.OneOf(*(m.Attribute(m.Name("self"), m.Name(a)) for a in attrs)) if attrs else None
    body = []
    for s in cls.body.body:
        if s is init:
            read = s.body.visit(_ReadAttrs(attrs))
            s = s.with_changes(params=params, body=read.with_changes(body=fold_known(read.body, consts)))
        elif isinstance(s, cst.FunctionDef) and reads is not None and findall(s, reads):
            read = s.body.visit(_ReadAttrs(attrs))
            s = s.with_changes(body=read.with_changes(body=fold_known(read.body, {})))
        body.append(s)
    return cls.with_changes(body=cls.body.with_changes(body=body))


def fold_defaults(module: cst.Module) -> cst.Module:
    """module with the constructor parameters no call passes folded to their defaults (the rule's work)."""
    found = _never_passed(module)
    if not found:
        return module
    return module.with_changes(
        body=[
            _folded(s, found[s.name.value]) if isinstance(s, cst.ClassDef) and s.name.value in found else s
            for s in module.body
        ]
    )


class ConstructorDefaults(Rule):
    ID = "MG025"
    DESCRIPTION = "Constructor parameters no call passes take their literal defaults; branches on them fold."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        return fold_defaults(module)
