"""Inner models return their last hidden state as a tensor instead of an HF output dataclass, so a wrapper
reading `outputs.last_hidden_state` off such a call reads the tensor (OPTModel around OPTDecoder), and
return and variable annotations that name transformers types go."""

import libcst as cst
import libcst.matchers as m

from skills.migrator.cst_utils import kwarg, names_in
from skills.migrator.rule import Rule
from skills.migrator.rules.strip_hf_decorators import transformers_names


class _Outputs(cst.CSTTransformer):
    def __init__(self, hf_names: set[str]):
        self.hf_names = hf_names

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
            updated = updated.with_changes(body=updated.body.visit(_ReadTensor(outputs)))
        if updated.returns is not None and names_in(updated.returns.annotation) & self.hf_names:
            return updated.with_changes(returns=None)
        return updated


SUBMODULE_CALL = m.Call(func=m.Attribute(value=m.Name("self")))


def _submodule_results(fn: cst.FunctionDef) -> set[str]:
    """Names fn binds to the result of a `self.<module>(...)` call."""
    assigns = m.findall(fn.body, m.Assign(targets=[m.AssignTarget(m.Name())], value=SUBMODULE_CALL))
    return {a.targets[0].target.value for a in assigns}


class _ReadTensor(cst.CSTTransformer):
    def __init__(self, names: set[str]):
        self.names = names

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.BaseExpression:
        read = m.Attribute(value=m.Name(), attr=m.Name("last_hidden_state"))
        return updated.value if m.matches(updated, read) and updated.value.value in self.names else updated


class ModelOutputs(Rule):
    ID = "MG006"
    DESCRIPTION = "Inner models return the last hidden state tensor, not an HF output dataclass."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        return module.visit(_Outputs(transformers_names(module)))
