"""An attention class picked from a table by implementation (`FALCON_ATTENTION_CLASSES[attn_implementation](...)`,
as models older than transformers' attention interface build theirs) becomes the table's "eager" class: the
runtime attention replaces every implementation, and the rules after this one see a direct constructor call.
A table nothing reads any more is removed; the classes only it named are left to prune_unreachable."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import Transformer, findall
from skills.migrator.rule import Rule

EAGER = "eager"


def _tables(module: cst.Module) -> dict[str, str]:
    """Module-level `NAME = {"eager": Class, ...}` -> the eager class's name."""
    found = {}
    for s in module.body:
        if (name := _table_name(s)) is None:
            continue
        for e in s.body[0].value.elements:
            if m.matches(e, m.DictElement(m.SimpleString(), m.Name())) and e.key.evaluated_value == EAGER:
                found[name] = e.value.value
    return found


def _table_name(s: cst.BaseStatement) -> str | None:
    """NAME of a module-level `NAME = {...}`."""
    if m.matches(s, m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name())], m.Dict())])):
        return s.body[0].targets[0].target.value
    return None


def _reads(module: cst.Module, name: str) -> bool:
    """Whether name is read anywhere but in its own table assignment."""
    return any(n.value == name for s in module.body if _table_name(s) != name for n in findall(s, m.Name()))


class _Resolve(Transformer):
    def __init__(self, tables: dict[str, str]):
        self.tables = tables

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        func = updated.func
        if m.matches(func, m.Subscript(m.Name())) and func.value.value in self.tables:
            return updated.with_changes(func=cst.Name(self.tables[func.value.value]))
        return updated


class AttentionClassTable(Rule):
    ID = "MG022"
    DESCRIPTION = "An attention class picked from a table by implementation becomes the table's eager class."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        tables = _tables(module)
        if not tables:
            return module
        module = module.visit(_Resolve(tables))
        unread = {t for t in tables if not _reads(module, t)}
        return module.with_changes(body=[s for s in module.body if _table_name(s) not in unread])
