"""Drop decorators that come from transformers (docstrings, kernels hub, output capture, kwarg
deprecation...), recognised by qualified name. Rotary helpers that change numerics (`dynamic_rope_update`)
are kept."""

import libcst as cst

from skills.migrator.imports import import_bindings, qualified_names
from skills.migrator.rule import VisitorRule

KEEP = {"dynamic_rope_update"}


class StripHFDecorators(VisitorRule):
    ID = "MG002"
    DESCRIPTION = "Decorators from transformers (docstrings, kernels hub, output capture) are dropped."

    def visit_Module(self, node: cst.Module) -> None:
        self.bindings = import_bindings(node)

    def _from_transformers(self, d: cst.Decorator) -> bool:
        target = d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator
        names = qualified_names(target, self.bindings)
        return any((n.startswith(("transformers.", ".")) and n.split(".")[-1] not in KEEP) for n in names)

    def _strip(self, original, updated):
        kept = [
            new
            for old, new in zip(original.decorators, updated.decorators, strict=True)
            if not self._from_transformers(old)
        ]
        return updated.with_changes(decorators=kept)

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        return self._strip(original, updated)

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        return self._strip(original, updated)
