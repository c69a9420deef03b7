"""Dropout is training-only: `nn.Dropout` modules, their calls and functional dropout disappear."""
import libcst as cst
import libcst.matchers as m

from skills.migrator.context import RewriteContext
from skills.migrator.cst_utils import called_name

FUNCTIONAL = {"nn.functional.dropout", "F.dropout", "torch.nn.functional.dropout", "torch.dropout"}


def _dropout_attrs(module: cst.Module) -> set[str]:
    found = set()
    for a in m.findall(module, m.Assign(targets=[m.AssignTarget(m.Attribute(value=m.Name("self")))], value=m.Call())):
        if called_name(a.value).split(".")[-1] == "Dropout":
            found.add(a.targets[0].target.attr.value)
    return found


class _Drop(cst.CSTTransformer):
    def __init__(self, attrs: set[str]):
        self.attrs = attrs

    def _is_module_call(self, call: cst.Call) -> bool:
        return m.matches(call.func, m.Attribute(value=m.Name("self"))) and call.func.attr.value in self.attrs

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        if self._is_module_call(updated) or called_name(updated) in FUNCTIONAL:
            return updated.args[0].value
        return updated

    def leave_SimpleStatementLine(self, original, updated):
        small = updated.body[0]
        if isinstance(small, cst.Assign) and len(updated.body) == 1:
            target = small.targets[0].target
            if m.matches(target, m.Attribute(value=m.Name("self"))) and target.attr.value in self.attrs:
                return cst.RemoveFromParent()
            if isinstance(target, cst.Name) and m.matches(small.value, m.Name(target.value)):
                return cst.RemoveFromParent()  # `x = x` left by removing `x = self.dropout(x)`
        return updated


def apply(module: cst.Module, ctx: RewriteContext) -> cst.Module:
    return module.visit(_Drop(_dropout_attrs(module)))
