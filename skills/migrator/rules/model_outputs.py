"""Inner models return their last hidden state as a tensor instead of an HF output dataclass, so a wrapper
reading `outputs.last_hidden_state` off such a call reads the tensor (OPTModel around OPTDecoder), as does one
reading `outputs[0]` off a module of an in-file class that returned such a dataclass (BERT's encoder), and
return and variable annotations that name transformers types go."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import Transformer, classes, findall, kwarg, method, names_in
from skills.migrator.imports import transformers_names
from skills.migrator.rule import Rule


class _Outputs(Transformer):
    def __init__(self, hf_names: set[str], dataclass_modules: dict[str, set[str]]):
        self.hf_names, self.dataclass_modules = hf_names, dataclass_modules
        self.modules: set[str] = set()  # the current class's `self.X` holding such a module

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.modules = self.dataclass_modules.get(node.name.value, set())

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        self.modules = set()  # a module-level function after the class has no such modules
        return updated

    def leave_Return(self, original: cst.Return, updated: cst.Return) -> cst.Return:
        if isinstance(updated.value, cst.Call) and (arg := kwarg(updated.value, "last_hidden_state")):
            return updated.with_changes(value=arg.value)
        return updated

    def leave_AnnAssign(self, original: cst.AnnAssign, updated: cst.AnnAssign):
        """`outputs: BaseModelOutputWithPast = self.model(...)` holds a tensor now: the annotation goes."""
        if updated.value is not None and names_in(updated.annotation.annotation) & self.hf_names:
            return cst.Assign([cst.AssignTarget(updated.target)], updated.value)
        return updated

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        if outputs := _submodule_results(updated):
            indexed = _submodule_results(updated, self.modules)
            updated = updated.with_changes(body=updated.body.visit(_ReadTensor(outputs, indexed)))
        if updated.returns is not None and names_in(updated.returns.annotation) & self.hf_names:
            return updated.with_changes(returns=None)
        return updated


def _submodule_results(fn: cst.FunctionDef, modules: set[str] | None = None) -> set[str]:
    """Names fn binds to the result of a `self.<module>(...)` call (of one of `modules` where given)."""
    attr = m.Name() if modules is None else m.OneOf(*map(m.Name, modules))
    call = m.Call(func=m.Attribute(value=m.Name("self"), attr=attr))
    assigns = findall(fn.body, m.Assign(targets=[m.AssignTarget(m.Name())], value=call))
    return {a.targets[0].target.value for a in assigns}


def _dataclass_modules(module: cst.Module) -> dict[str, set[str]]:
    """Per class, its `self.X` attributes built from an in-file class whose forward returned an output dataclass
    (`return BaseModelOutput(last_hidden_state=...)`), which now returns the tensor itself."""
    field = m.Arg(keyword=m.Name("last_hidden_state"))
    returned = m.Return(value=m.Call(args=[m.ZeroOrMore(), field, m.ZeroOrMore()]))
    local = classes(module)
    producers = {n for n, c in local.items() if (fwd := method(c, "forward")) and findall(fwd, returned)}
    built = m.Assign(
        targets=[m.AssignTarget(m.Attribute(value=m.Name("self")))],
        value=m.Call(func=m.OneOf(*map(m.Name, producers))),
    )
    return {
        name: {a.targets[0].target.attr.value for a in findall(cls, built)} for name, cls in local.items()
    }


class _ReadTensor(Transformer):
    """`outputs.last_hidden_state` -> `outputs` for outputs in names; `outputs[0]` -> `outputs` for those in indexed."""

    def __init__(self, names: set[str], indexed: set[str]):
        self.names, self.indexed = names, indexed

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.BaseExpression:
        read = m.Attribute(value=m.Name(), attr=m.Name("last_hidden_state"))
        return updated.value if m.matches(updated, read) and updated.value.value in self.names else updated

    def leave_Subscript(self, original: cst.Subscript, updated: cst.Subscript) -> cst.BaseExpression:
        first = m.Subscript(
            value=m.OneOf(*map(m.Name, self.indexed)), slice=[m.SubscriptElement(m.Index(m.Integer("0")))]
        )
        return updated.value if self.indexed and m.matches(updated, first) else updated


class ModelOutputs(Rule):
    ID = "MG006"
    DESCRIPTION = "Inner models return the last hidden state tensor, not an HF output dataclass."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        return module.visit(_Outputs(transformers_names(module), _dataclass_modules(module)))
