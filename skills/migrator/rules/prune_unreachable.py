"""Only what the entry class needs stays: other heads (sequence classification, ...), the
PreTrainedModel subclass, eager attention helpers, vision towers, `__all__` and loggers are dropped."""

import libcst as cst

from skills.migrator.reachability import reachable, top_level_names
from skills.migrator.rule import Rule


def prune_unreachable(module: cst.Module, entry_class: str) -> cst.Module:
    """module without the top-level definitions the entry class does not reach."""
    keep = reachable(module, {entry_class, "EntryClass"})
    if not keep:
        return module
    body = [s for i, s in enumerate(module.body) if not top_level_names(s) or i in keep]
    return module.with_changes(body=body) if len(body) != len(module.body) else module


class PruneUnreachable(Rule):
    ID = "MG010"
    DESCRIPTION = "Only what the entry class reaches stays: other heads, PreTrainedModel, loggers go."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        return prune_unreachable(module, self.rewrite.entry_class)
