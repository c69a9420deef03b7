"""HF builds 4-D attention masks (`create_causal_mask`, sliding-window variants, mask dicts); the
runtime's attention masks from ForwardMetaData instead. Statements that build masks, and everything
computed only from them, are removed; call arguments that pass them on are dropped."""

import re

import libcst as cst

from skills.migrator.cst_utils import assigned_names, free_names, names_in
from skills.migrator.rule import Rule

MASK_FACTORY = re.compile(r"(^|_)(create|make|prepare|preprocess)\w*mask", re.IGNORECASE)


def _builds_mask(node: cst.CSTNode) -> bool:
    """Calls or names a mask factory (`create_causal_mask`, `mask_function = create_... if ... else ...`)."""
    return any(MASK_FACTORY.search(n) for n in free_names(node))


class _DropTaintedArgs(cst.CSTTransformer):
    def __init__(self, tainted: set[str]):
        self.tainted = tainted

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        """Keyword arguments carrying a mask are dropped; positional ones become None (positions stay)."""
        args = []
        for a in updated.args:
            if not names_in(a.value) & self.tainted or a.star:
                args.append(a)
            elif not a.keyword and isinstance(a.value, cst.Name):
                args.append(a.with_changes(value=cst.Name("None")))
            elif not a.keyword:
                args.append(a)
        return updated.with_changes(args=args) if args != list(updated.args) else updated


class _Clean(cst.CSTTransformer):
    """One pass over a function body: removes mask statements, records what they bound."""

    def __init__(self, tainted: set[str]):
        self.tainted = tainted

    def _is_mask(self, stmt: cst.BaseStatement) -> bool:
        """Builds a mask, or uses one (compound statements count as a whole)."""
        return _builds_mask(stmt) or bool(names_in(stmt) & self.tainted)

    def on_leave(self, original, updated):
        if isinstance(updated, cst.IndentedBlock):
            kept = []
            for s in updated.body:
                s = s.visit(_DropTaintedArgs(self.tainted))
                if self._is_mask(s):
                    self.tainted |= assigned_names(s)
                else:
                    kept.append(s)
            return updated.with_changes(body=kept or [cst.SimpleStatementLine([cst.Pass()])])
        return updated


class _PerFunction(cst.CSTTransformer):
    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        if not _builds_mask(updated.body):
            return updated
        tainted: set[str] = set()
        while True:  # fixpoint: a removal can taint names used earlier in loops
            before = len(tainted)
            cleaner = _Clean(tainted)
            updated = updated.with_changes(body=updated.body.visit(cleaner))
            tainted = cleaner.tainted
            if len(tainted) == before:
                return updated


class RemoveMaskMachinery(Rule):
    ID = "MG003"
    DESCRIPTION = "HF's 4-D attention mask building goes; the runtime's attention masks from ForwardMetaData."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        return module.visit(_PerFunction())
