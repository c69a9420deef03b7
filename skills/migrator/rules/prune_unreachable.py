"""Only what the entry class needs stays: other heads (sequence classification, ...), the
PreTrainedModel subclass, eager attention helpers, vision towers, `__all__` and loggers are dropped."""
import libcst as cst

from skills.migrator.context import RewriteContext
from skills.migrator.reachability import reachable, top_level_names


def apply(module: cst.Module, ctx: RewriteContext) -> cst.Module:
    keep = reachable(module, {ctx.entry_class, "EntryClass"})
    if not keep:
        return module
    body = [s for i, s in enumerate(module.body) if not top_level_names(s) or i in keep]
    return module.with_changes(body=body) if len(body) != len(module.body) else module
