"""Required arguments are required: a `x: T | None = None` parameter of an in-file class's `__init__` or
`forward` that every known call passes, and that the body uses without ever testing it (no `is None`, no
`if x`, no `x or ...`), loses its `None` default and the `| None` of its annotation. Only when every call is
known (see call_sites.py); contract parameters keep their defaults."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.call_sites import binding, call_sites, positional_params
from skills.migrator.cst_utils import Transformer, classes, findall, method, names_in
from skills.migrator.rule import Rule
from skills.migrator.rules.unused_parameters import CONTRACT

_TESTS = m.Comparison() | m.BooleanOperation() | m.UnaryOperation(operator=m.Not())


def _tested(fn: cst.FunctionDef) -> set[str]:
    """Names the body tests: comparisons, boolean operators, `not`, and the conditions of if / while / ... ."""
    nodes = [
        *findall(fn.body, _TESTS),
        *(n.test for n in findall(fn.body, m.If() | m.While() | m.IfExp())),
    ]
    nodes += [a.test for a in findall(fn.body, m.Assert())]
    return {name for node in nodes for name in names_in(node)}


def _without_none(annotation: cst.Annotation | None) -> cst.Annotation | None:
    a = annotation.annotation if annotation else None
    if m.matches(a, m.BinaryOperation(operator=m.BitOr(), right=m.Name("None"))):
        return annotation.with_changes(annotation=a.left)
    if m.matches(a, m.BinaryOperation(operator=m.BitOr(), left=m.Name("None"))):
        return annotation.with_changes(annotation=a.right)
    if m.matches(a, m.Subscript(value=m.Name("Optional"), slice=[m.SubscriptElement()])):
        return annotation.with_changes(annotation=a.slice[0].slice.value)
    return annotation


def _required(fn: cst.FunctionDef, calls: list[cst.Call]) -> set[int]:
    """ids of fn's `= None` parameters to make required."""
    if not calls:
        return set()
    tested, out = _tested(fn), set()
    candidates = [*positional_params(fn), *fn.params.kwonly_params]
    still_required = True  # positional parameters after a defaulted one must keep a default
    for param in candidates:
        positional = param not in fn.params.kwonly_params
        if param.default is None:
            continue
        ok = (
            m.matches(param.default, m.Name("None"))
            and param.name.value not in CONTRACT | tested
            and all(binding(c, fn, param) is not None for c in calls)
            and (still_required or not positional)
        )
        if ok:
            out.add(id(param))
        elif positional:
            still_required = False
    return out


class _Require(Transformer):
    def __init__(self, params: set[int]):
        self.params = params

    def leave_Param(self, original: cst.Param, updated: cst.Param) -> cst.Param:
        if id(original) not in self.params:
            return updated
        return updated.with_changes(
            default=None, equal=cst.MaybeSentinel.DEFAULT, annotation=_without_none(updated.annotation)
        )


class HonestSignatures(Rule):
    ID = "MG014"
    DESCRIPTION = "A `= None` parameter every known call passes and the body never tests becomes required."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        local, params = classes(module), set()
        for name, where in call_sites(module).items():
            if where.name_escapes:
                continue
            init, forward = method(local[name], "__init__"), method(local[name], "forward")
            if init is not None:
                params |= _required(init, where.constructed)
            if forward is not None and not where.instances_escape and method(local[name], "__call__") is None:
                params |= _required(forward, where.called)
        return module.visit(_Require(params)) if params else module
