"""A gated MLP's product `self.<act>(gate) * up` (either order), where `self.<act>` is an activation the class's
`__init__` takes from `ACT2FN[...]`, becomes the runtime's `act_and_mul(self.<act>, gate, up)`: with SiLU one pass
on the host with the same roundings, the same expression otherwise (the wrapper checks the activation at run
time, so whatever the attribute holds, the product is computed as written). The operands keep their code; for
`up * self.<act>(gate)` gate is now evaluated first, which only matters to operands with side effects. An
activation set any other way, or assigned again in the class, is left as it is."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import SELF_ATTR, Transformer, findall, method
from skills.migrator.rule import Rule

ACT2FN = m.Subscript(m.Name("ACT2FN"))


def _activations(cls: cst.ClassDef) -> set[str]:
    """The attributes `__init__` sets to `ACT2FN[...]` and nothing in the class sets again."""
    init = method(cls, "__init__")
    if init is None:
        return set()
    assigned = findall(init, m.Assign([m.AssignTarget(SELF_ATTR)], ACT2FN))
    return {attr for a in assigned if _sets(cls, attr := a.targets[0].target.attr.value) == 1}


def _sets(cls: cst.ClassDef, attr: str) -> int:
    """How many assignments in the class bind `self.<attr>` (alone, in a tuple, annotated or augmented)."""
    self_attr = m.Attribute(m.Name("self"), m.Name(attr))
    targets = [t.target for t in findall(cls, m.AssignTarget() | m.AnnAssign() | m.AugAssign())]
    return sum(bool(m.matches(t, self_attr) or findall(t, self_attr)) for t in targets)


class FusedActAndMul(Rule):
    ID = "MG031"
    DESCRIPTION = (
        "A gated MLP's self.<act>(gate) * up becomes the runtime's act_and_mul(self.<act>, gate, up)."
    )

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        products = _Products()
        module = module.visit(products)
        if products.changed:
            self.add_needed_import("runtime.layers.activation", "act_and_mul")
        return module


class _Products(Transformer):
    def __init__(self):
        self.activations: list[set[str]] = []
        self.changed = False

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.activations.append(_activations(node))

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        self.activations.pop()
        return updated

    def leave_BinaryOperation(
        self, original: cst.BinaryOperation, updated: cst.BinaryOperation
    ) -> cst.BaseExpression:
        if not self.activations or not isinstance(updated.operator, cst.Multiply):
            return updated
        for applied, other in ((updated.left, updated.right), (updated.right, updated.left)):
            if self._activation_call(applied):
                self.changed = True
                args = [cst.Arg(applied.func), cst.Arg(applied.args[0].value), cst.Arg(other)]
                return cst.Call(cst.Name("act_and_mul"), args, lpar=updated.lpar, rpar=updated.rpar)
        return updated

    def _activation_call(self, node: cst.BaseExpression) -> bool:
        call = m.Call(m.Attribute(m.Name("self"), m.Name()), [m.Arg(keyword=None, star="")])
        return m.matches(node, call) and node.func.attr.value in self.activations[-1]
