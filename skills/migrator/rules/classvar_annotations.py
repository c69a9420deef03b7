"""Mutable class-level metadata of config classes (`attribute_map = {...}`, `base_model_tp_plan = {...}`)
is annotated `ClassVar`, which it is: it stays shared class data, never a dataclass field."""
import libcst as cst

from skills.migrator.context import RewriteContext
from skills.migrator.cst_utils import add_imports

MUTABLE = {cst.Dict: "dict", cst.List: "list", cst.Set: "set"}


class _Annotate(cst.CSTTransformer):
    def __init__(self):
        self.depth = 0
        self.changed = False

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.depth += 1

    def leave_ClassDef(self, original, updated):
        self.depth -= 1
        return updated

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False  # only class bodies

    def leave_Assign(self, original: cst.Assign, updated: cst.Assign):
        kind = MUTABLE.get(type(updated.value))
        if not self.depth or kind is None or len(updated.targets) != 1 or not isinstance(updated.targets[0].target,
                                                                                         cst.Name):
            return updated
        self.changed = True
        return cst.AnnAssign(updated.targets[0].target, cst.Annotation(cst.parse_expression(f"ClassVar[{kind}]")),
                             updated.value)


def apply(module: cst.Module, ctx: RewriteContext) -> cst.Module:
    annotate = _Annotate()
    new = module.visit(annotate)
    return add_imports(new, [("typing", "ClassVar")]) if annotate.changed else module
