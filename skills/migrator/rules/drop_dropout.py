"""Dropout is training-only: `torch.nn.Dropout` modules, their calls and functional dropout disappear.
Calls are recognised by qualified name, whatever the import alias (`nn.Dropout`, `F.dropout`, ...)."""

import re

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import SELF_ATTR, findall
from skills.migrator.imports import import_bindings, qualified_names
from skills.migrator.rule import VisitorRule

MODULES = {"torch.nn.Dropout", "torch.nn.Dropout1d", "torch.nn.Dropout2d", "torch.nn.Dropout3d"}
FUNCTIONAL = {"torch.nn.functional.dropout", "torch.dropout"}


class DropDropout(VisitorRule):
    ID = "MG011"
    DESCRIPTION = "Dropout is training-only: nn.Dropout modules, their calls and functional dropout go."

    def transform_module(self, tree: cst.Module) -> cst.Module:
        # most files have no dropout left by now: not worth a walk that rebuilds every node
        return super().transform_module(tree) if re.search("dropout", tree.code, re.IGNORECASE) else tree

    def _calls(self, call: cst.Call, names: set[str]) -> bool:
        return not names.isdisjoint(qualified_names(call.func, self.bindings))

    def visit_Module(self, node: cst.Module) -> None:
        self.bindings = import_bindings(node)
        assigns = findall(node, m.Assign(targets=[m.AssignTarget(SELF_ATTR)], value=m.Call()))
        self.modules = {a.targets[0].target.attr.value for a in assigns if self._calls(a.value, MODULES)}

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        module_call = m.matches(updated.func, SELF_ATTR) and updated.func.attr.value in self.modules
        return updated.args[0].value if module_call or self._calls(original, FUNCTIONAL) else updated

    def leave_SimpleStatementLine(self, original, updated):
        small = updated.body[0]
        if isinstance(small, cst.Assign) and len(updated.body) == 1:
            target = small.targets[0].target
            if m.matches(target, SELF_ATTR) and target.attr.value in self.modules:
                return cst.RemoveFromParent()
            if isinstance(target, cst.Name) and m.matches(small.value, m.Name(target.value)):
                return cst.RemoveFromParent()  # `x = x` left by removing `x = self.dropout(x)`
        return updated
