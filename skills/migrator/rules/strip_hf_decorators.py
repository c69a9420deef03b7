"""Drop decorators that come from transformers (docstrings, kernels hub, output capture, kwarg
deprecation...), recognised by qualified name. Rotary helpers that change numerics (`dynamic_rope_update`)
are kept."""

import libcst as cst
from libcst.metadata import QualifiedNameProvider

from skills.migrator.cst_utils import dotted
from skills.migrator.rule import VisitorRule

KEEP = {"dynamic_rope_update"}


def transformers_names(module: cst.Module) -> set[str]:
    """Names this module imports from transformers (absolute or relative)."""
    names: set[str] = set()
    for s in module.body:
        for small in getattr(s, "body", []) if isinstance(s, cst.SimpleStatementLine) else []:
            if isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar):
                mod = cst.Module([]).code_for_node(small.module) if small.module else ""
                if small.relative or mod.split(".")[0] == "transformers":
                    names.update((a.asname.name.value if a.asname else dotted(a.name)) for a in small.names)
    return names


class StripHFDecorators(VisitorRule):
    ID = "MG002"
    DESCRIPTION = "Decorators from transformers (docstrings, kernels hub, output capture) are dropped."
    METADATA_DEPENDENCIES = (QualifiedNameProvider,)

    def _from_transformers(self, d: cst.Decorator) -> bool:
        target = d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator
        names = {q.name for q in self.get_metadata(QualifiedNameProvider, target, set())}
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
