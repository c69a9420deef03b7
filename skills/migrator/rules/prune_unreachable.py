"""Only what the entry class needs stays: other heads (sequence classification, ...), the
PreTrainedModel subclass, eager attention helpers, `__all__` and loggers are dropped."""
import libcst as cst

from skills.migrator.context import RewriteContext
from skills.migrator.cst_utils import assigned_names, names_in


def _defines(s: cst.BaseStatement) -> set[str]:
    if isinstance(s, (cst.ClassDef, cst.FunctionDef)):
        return {s.name.value}
    if isinstance(s, cst.SimpleStatementLine) and isinstance(s.body[0], (cst.Assign, cst.AnnAssign)):
        return assigned_names(s)
    return set()


def apply(module: cst.Module, ctx: RewriteContext) -> cst.Module:
    defs = {i: _defines(s) for i, s in enumerate(module.body)}
    owner = {name: i for i, names in defs.items() for name in names}
    roots = [i for i, names in defs.items() if names & {ctx.entry_class, "EntryClass"}]
    if not roots:
        return module
    keep, todo = set(roots), list(roots)
    while todo:
        for name in names_in(module.body[todo.pop()]):
            i = owner.get(name)
            if i is not None and i not in keep:
                keep.add(i)
                todo.append(i)
    body = [s for i, s in enumerate(module.body) if not defs[i] or i in keep]
    return module.with_changes(body=body) if len(body) != len(module.body) else module
