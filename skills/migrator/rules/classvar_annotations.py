"""Mutable class-level metadata of config classes (`attribute_map = {...}`, `base_model_tp_plan = {...}`)
is annotated `ClassVar`, which it is: it stays shared class data, never a dataclass field."""

import libcst as cst

from skills.migrator.rule import VisitorRule

MUTABLE = {cst.Dict: "dict", cst.List: "list", cst.Set: "set"}


class ClassVarAnnotations(VisitorRule):
    ID = "MG017"
    DESCRIPTION = "Mutable class-level metadata of configuration classes is annotated ClassVar."

    depth = 0  # class bodies entered

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.depth += 1

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        self.depth -= 1
        return updated

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False  # only class bodies

    def leave_Assign(self, original: cst.Assign, updated: cst.Assign) -> cst.BaseSmallStatement:
        kind = MUTABLE.get(type(updated.value))
        if (
            not self.depth
            or kind is None
            or len(updated.targets) != 1
            or not isinstance(updated.targets[0].target, cst.Name)
        ):
            return updated
        self.add_needed_import("typing", "ClassVar")
        return cst.AnnAssign(
            updated.targets[0].target,
            cst.Annotation(cst.parse_expression(f"ClassVar[{kind}]")),
            updated.value,
        )
