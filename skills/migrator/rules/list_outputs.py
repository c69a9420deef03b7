"""Outputs wrapped in a one-element list are the tensor itself: GPT-1's attention returns `[a] + attn_outputs[1:]`
(the attention weights were appended only when asked for, which MG004 folded away) and its block `[h] +
attn_outputs[1:]`, each caller reading `outputs[0]`. A local `x = [e]` read only as `x[0]` and `x[1:]` becomes `x =
e` (`x[0]` -> `x`, `x[1:]` -> `[]`, `l + []` -> `l`); a forward that returns such a list to callers that only read
it so returns the element, and its callers read it as it is. Only modules whose every call this file shows (the
class name and its instances used nowhere else)."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.call_sites import call_sites
from skills.migrator.cst_utils import Transformer, assigned_names, classes, findall, method
from skills.migrator.rule import Rule

ONE = m.List([m.Element(~m.StarredElement())])  # `[e]`
BOUND_TO_ONE = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name())], ONE)])  # `x = [e]`
EMPTY = m.List([])


def _head(x: str) -> m.Subscript:
    return m.Subscript(m.Name(x), [m.SubscriptElement(m.Index(m.Integer("0")))])


def _tail(x: str) -> m.Subscript:
    one = m.Slice(lower=m.Integer("1"), upper=None, step=None)
    return m.Subscript(m.Name(x), [m.SubscriptElement(one)])


def _only_indexed(nodes: list[cst.CSTNode], x: str) -> bool:
    """Every read of x under nodes is `x[0]` or `x[1:]` (its assignments aside)."""
    reads = sum(len(findall(n, m.Name(x))) - len(findall(n, m.AssignTarget(m.Name(x)))) for n in nodes)
    return reads == sum(len(findall(n, _head(x) | _tail(x))) for n in nodes)


class _Unwrap(Transformer):
    """`x[0]` -> `x`, `x[1:]` -> `[]`; `l + []` -> `l`."""

    def __init__(self, x: str):
        self.x = x

    def leave_Subscript(self, original: cst.Subscript, updated: cst.Subscript) -> cst.BaseExpression:
        if m.matches(updated, _head(self.x)):
            return updated.value
        if m.matches(updated, _tail(self.x)):
            return cst.List([])
        return updated

    def leave_BinaryOperation(self, original, updated) -> cst.BaseExpression:
        if isinstance(updated.operator, cst.Add) and m.matches(updated.right, EMPTY):
            return updated.left
        return updated


def _wrapped_locals(fn: cst.FunctionDef) -> cst.FunctionDef:
    """fn with each top-level `x = [e]` that later statements read only as `x[0]` / `x[1:]` made `x = e` (gone
    when e is x itself), and those reads unwrapped."""
    body = list(fn.body.body)
    for i, s in enumerate(body):
        if not m.matches(s, BOUND_TO_ONE):
            continue
        x, e = s.body[0].targets[0].target.value, s.body[0].value.elements[0].value
        later = body[i + 1 :]
        if any(x in assigned_names(t) for t in later) or not _only_indexed(later, x):
            continue
        kept = [] if m.matches(e, m.Name(x)) else [s.with_changes(body=[s.body[0].with_changes(value=e)])]
        new = [*body[:i], *kept, *(t.visit(_Unwrap(x)) for t in later)]
        return _wrapped_locals(fn.with_changes(body=fn.body.with_changes(body=new)))
    return fn


def _returned_list(fwd: cst.FunctionDef) -> list[cst.SimpleStatementLine] | None:
    """The top-level `outputs = [e]` statements forward's returns give (a return of `[e]` itself: its own
    statement), or None when a return gives anything else."""
    returns = findall(fwd, m.Return())
    bound = {}
    for s in fwd.body.body:
        if m.matches(s, BOUND_TO_ONE):
            bound[s.body[0].targets[0].target.value] = s
    found = []
    for r in returns:
        if m.matches(r.value, ONE):
            found.append(r)
        elif isinstance(r.value, cst.Name) and r.value.value in bound:
            name = r.value.value
            if sum(name in assigned_names(s) for s in fwd.body.body) != 1:
                return None
            found.append(bound[name])
        else:
            return None
    return found or None


def _callers_read_the_head(module: cst.Module, calls: list[cst.Call]) -> dict[int, str] | None:
    """id of each function holding one of calls -> the name it binds the result to, when every call is the value
    of a `r = <call>` statement, r bound nowhere else in its function and read only as `r[0]` / `r[1:]`."""
    found = {}
    for fn in findall(module, m.FunctionDef()):
        mine = [c for c in calls if any(c is x for x in findall(fn, m.Call()))]
        if not mine:
            continue
        binds = findall(fn, m.Assign([m.AssignTarget(m.Name())], m.Call()))
        names = {b.targets[0].target.value for b in binds if any(b.value is c for c in mine)}
        if len(names) != 1 or len(mine) != 1:
            return None
        r = names.pop()
        if sum(1 for t in findall(fn, m.AssignTarget(m.Name(r)))) != 1 or not _only_indexed([fn.body], r):
            return None
        found[id(fn)] = r
    return found


class _Apply(Transformer):
    def __init__(self, wrapped: dict[int, cst.CSTNode], callers: dict[int, str]):
        self.wrapped, self.callers = wrapped, callers

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        if id(original) in self.callers:
            return updated.with_changes(body=updated.body.visit(_Unwrap(self.callers[id(original)])))
        return updated

    def leave_Return(self, original: cst.Return, updated: cst.Return) -> cst.Return:
        if id(original) in self.wrapped:
            return updated.with_changes(value=updated.value.elements[0].value)
        return updated

    def leave_Assign(self, original: cst.Assign, updated: cst.Assign) -> cst.Assign:
        if id(original) in self.wrapped:
            return updated.with_changes(value=updated.value.elements[0].value)
        return updated


def _unwrapped_returns(module: cst.Module) -> cst.Module | None:
    """module with one class's forward returning the element of its one-element list, and its callers reading it
    as it is; None when no class qualifies."""
    local, sites = classes(module), call_sites(module)
    for name, where in sites.items():
        fwd = method(local[name], "forward")
        if fwd is None or where.name_escapes or where.instances_escape or not where.called:
            continue
        statements = _returned_list(fwd)
        callers = _callers_read_the_head(module, where.called) if statements else None
        if not callers:
            continue
        wrapped = {id(s if isinstance(s, cst.Return) else s.body[0]): s for s in statements}
        return module.visit(_Apply(wrapped, callers))
    return None


class ListOutputs(Rule):
    ID = "MG026"
    DESCRIPTION = "Outputs wrapped in a one-element list (`[a] + outputs[1:]`) are the tensor itself."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        while True:
            module = module.visit(_Locals())
            new = _unwrapped_returns(module)
            if new is None or new.deep_equals(module):
                return module
            module = new


class _Locals(Transformer):
    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        return _wrapped_locals(updated)
