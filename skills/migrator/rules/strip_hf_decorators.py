"""Drop decorators that come from transformers (docstrings, kernels hub, output capture, kwarg
deprecation...). Rotary helpers that change numerics (`dynamic_rope_update`) are kept."""
import libcst as cst

from skills.migrator.context import RewriteContext
from skills.migrator.cst_utils import dotted

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


class _Strip(cst.CSTTransformer):
    def __init__(self, hf_names: set[str]):
        self.hf_names = hf_names

    def _keep(self, d: cst.Decorator) -> bool:
        target = d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator
        name = dotted(target).split(".")[0]
        return name not in self.hf_names or name in KEEP

    def leave_FunctionDef(self, original, updated):
        return updated.with_changes(decorators=[d for d in updated.decorators if self._keep(d)])

    def leave_ClassDef(self, original, updated):
        return updated.with_changes(decorators=[d for d in updated.decorators if self._keep(d)])


def apply(module: cst.Module, ctx: RewriteContext) -> cst.Module:
    return module.visit(_Strip(transformers_names(module)))
