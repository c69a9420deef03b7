"""Inner models return their last hidden state as a tensor instead of an HF output dataclass, and
`forward` methods lose return annotations that name transformers types."""

import libcst as cst

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

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        if updated.returns is not None and names_in(updated.returns.annotation) & self.hf_names:
            return updated.with_changes(returns=None)
        return updated


class ModelOutputs(Rule):
    ID = "MG006"
    DESCRIPTION = "Inner models return the last hidden state tensor, not an HF output dataclass."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        return module.visit(_Outputs(transformers_names(module)))
