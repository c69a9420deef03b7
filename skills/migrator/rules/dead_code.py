"""Leftovers of the other rules go: locals nobody reads, `self.x = ...` attributes nobody reads
(dropout rates, layer indices for HF's cache, ...), and `pass` next to real statements."""

from functools import partial

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import pure
from skills.migrator.rule import Rule

KEEP_ATTRS = {"config"}


def _single_assign(s: cst.BaseStatement) -> cst.Assign | cst.AnnAssign | None:
    if (
        isinstance(s, cst.SimpleStatementLine)
        and len(s.body) == 1
        and isinstance(s.body[0], (cst.Assign, cst.AnnAssign))
    ):
        small = s.body[0]
        targets = [t.target for t in small.targets] if isinstance(small, cst.Assign) else [small.target]
        if len(targets) == 1 and small.value is not None and pure(small.value):
            return small
    return None


def _target(small) -> cst.BaseExpression:
    return small.targets[0].target if isinstance(small, cst.Assign) else small.target


def _is_dead_local(s: cst.BaseStatement, used: dict[str, int]) -> bool:
    a = _single_assign(s)
    return a is not None and isinstance(_target(a), cst.Name) and used.get(_target(a).value, 0) == 1


class _DeadLocals(cst.CSTTransformer):
    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        while True:
            used: dict[str, int] = {}
            for n in m.findall(updated.body, m.Name()):
                used[n.value] = used.get(n.value, 0) + 1
            new = updated.visit(_DropIf(partial(_is_dead_local, used=used)))
            if new.deep_equals(updated):
                return updated
            updated = new


class _DropIf(cst.CSTTransformer):
    def __init__(self, predicate):
        self.predicate = predicate

    def leave_SimpleStatementLine(self, original, updated):
        return cst.RemoveFromParent() if self.predicate(updated) else updated

    def leave_IndentedBlock(self, original, updated):
        body = [s for s in updated.body if not m.matches(s, m.SimpleStatementLine([m.Pass()]))]
        return updated.with_changes(body=body or [cst.SimpleStatementLine([cst.Pass()])])


CONFIG = m.Name("config") | m.Attribute(value=m.Name("self"), attr=m.Name("config"))


def _unused_attrs(module: cst.Module) -> set[str]:
    """`self.x` attributes that are assigned but never read (reads of the HF config aside)."""
    targets = m.findall(module, m.AssignTarget(m.Attribute()))
    written = {t.target.attr.value for t in targets}
    stored = {id(t.target) for t in targets}
    read = {
        a.attr.value
        for a in m.findall(module, m.Attribute())
        if id(a) not in stored and not m.matches(a.value, CONFIG)
    }
    return written - read - KEEP_ATTRS


def _is_dead_attr(s: cst.BaseStatement, unused: set[str]) -> bool:
    a = _single_assign(s)
    target = _target(a) if a is not None else None
    return m.matches(target, m.Attribute(value=m.Name("self"))) and target.attr.value in unused


class DeadCode(Rule):
    ID = "MG012"
    DESCRIPTION = "Locals and self attributes nobody reads, and pass next to real statements, go."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        module = module.visit(_DeadLocals())
        while True:
            unused = _unused_attrs(module)
            new = module.visit(_DropIf(partial(_is_dead_attr, unused=unused)))
            if new.deep_equals(module):
                return module
            module = new
