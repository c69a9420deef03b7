"""HF base classes (PreTrainedModel and its per-model subclass, GradientCheckpointingLayer,
GenerationMixin, recognised by qualified name whatever the import's alias) become plain `nn.Module`; with
them go `post_init()`, gradient-checkpointing flags, `super().__init__(config)` arguments and HF-only class
attributes (`_tp_plan`, `config: XConfig`, ...)."""

import libcst as cst
import libcst.matchers as m
from torch import nn

from skills.migrator.context import RewriteContext
from skills.migrator.cst_utils import Transformer, dotted, findall
from skills.migrator.imports import import_bindings, qualified_names
from skills.migrator.reachability import reachable, top_level_names
from skills.migrator.rule import Rule

HF_BASES = {"PreTrainedModel", "GradientCheckpointingLayer", "GenerationMixin"}
NN_MODULE = cst.Arg(cst.parse_expression("nn.Module"))


def _hf_bases(module: cst.Module) -> set[int]:
    """ids of the class-base expressions naming an HF base: imported from transformers, or an in-file
    `*PreTrainedModel` deriving from one (e.g. LlamaPreTrainedModel)."""
    bindings, found, local = import_bindings(module), set(), set()
    for node in findall(module, m.ClassDef()):
        hf = [
            b.value
            for b in node.bases
            if dotted(b.value) in local
            or any(
                q.startswith("transformers.") and q.split(".")[-1] in HF_BASES
                for q in qualified_names(b.value, bindings)
            )
        ]
        found.update(map(id, hf))
        if node.name.value.endswith("PreTrainedModel") and hf:
            local.add(node.name.value)
    return found


def _is_hf_only_class_attr(stmt: cst.BaseStatement, used: set[str]) -> bool:
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return False
    small = stmt.body[0]
    if isinstance(small, cst.AnnAssign) and small.value is None:
        return True  # `config: LlamaConfig`
    target = small.targets[0].target if isinstance(small, cst.Assign) else None
    return isinstance(target, cst.Name) and target.value.startswith("_") and target.value not in used


class _PlainSuperInit(Transformer):
    """`super().__init__(config)` -> `super().__init__()` plus the `self.config` PreTrainedModel used to set."""

    def leave_SimpleStatementLine(self, original, updated):
        call = updated.body[0].value if isinstance(updated.body[0], cst.Expr) else None
        if not m.matches(
            call, m.Call(func=m.Attribute(value=m.Call(func=m.Name("super")), attr=m.Name("__init__")))
        ):
            return updated
        plain = updated.with_changes(body=[cst.Expr(call.with_changes(args=[]))])
        if len(call.args) == 1 and isinstance(call.args[0].value, cst.Name):
            return cst.FlattenSentinel(
                [plain, cst.parse_statement(f"self.config = {call.args[0].value.value}\n")]
            )
        return plain


class _DropInheritedHFCalls(Transformer):
    """`self.warn_if_padding_and_no_attention_mask(...)`-style statements call PreTrainedModel helpers that a
    plain nn.Module lacks: bare calls go; any other use is reported."""

    def __init__(self, own: set[str], ctx: RewriteContext | None, scope: str):
        self.own, self.ctx, self.scope = own, ctx, scope
        self.bare: set[int] = set()  # ids of the calls that are whole statements, which simply go

    def _inherited(self, node) -> str | None:
        if m.matches(node, m.Call(func=m.Attribute(value=m.Name("self")))):
            name = node.func.attr.value
            if name not in self.own and not hasattr(nn.Module, name):
                return name
        return None

    def _bare_call(self, line: cst.SimpleStatementLine) -> cst.Call | None:
        small = line.body[0]
        whole = len(line.body) == 1 and isinstance(small, cst.Expr) and self._inherited(small.value)
        return small.value if whole else None

    def visit_SimpleStatementLine(self, node) -> None:
        if call := self._bare_call(node):
            self.bare.add(id(call))

    def leave_SimpleStatementLine(self, original, updated):
        return cst.RemoveFromParent() if self._bare_call(original) else updated

    def leave_Call(self, original, updated):
        if self.ctx is None or id(original) in self.bare:
            return updated
        if (name := self._inherited(updated)) is not None:
            self.ctx.unsupported(
                self.scope, 0, f"`self.{name}(...)` is a PreTrainedModel method that nn.Module lacks"
            )
        return updated


class _Bases(Transformer):
    def __init__(self, hf: set[int], ctx: RewriteContext, used: set[str]):
        self.hf, self.ctx, self.used = hf, ctx, used  # used: classes the entry needs (others get pruned)

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        bases = [
            new
            for old, new in zip(original.bases, updated.bases, strict=True)
            if id(old.value) not in self.hf
        ]
        if len(bases) == len(updated.bases):
            return updated
        used = {n.attr.value for n in findall(updated, m.Attribute(value=m.Name("self")))}
        body = [s for s in updated.body.body if not _is_hf_only_class_attr(s, used)]
        if body and body[0] is not updated.body.body[0]:
            body[0] = body[0].with_changes(leading_lines=[])
        updated = updated.with_changes(bases=bases or [NN_MODULE], body=updated.body.with_changes(body=body))
        own = {n for s in body for n in top_level_names(s)} | {
            t.target.attr.value for t in findall(updated, m.AssignTarget(m.Attribute(value=m.Name("self"))))
        }
        report = updated.name.value in self.used
        updated = updated.visit(_DropInheritedHFCalls(own, self.ctx if report else None, updated.name.value))
        return updated.visit(_PlainSuperInit())

    def leave_SimpleStatementLine(self, original, updated):
        drop = m.OneOf(
            m.Expr(m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name("post_init")))),
            m.Assign(
                targets=[
                    m.AssignTarget(m.Attribute(value=m.Name("self"), attr=m.Name("gradient_checkpointing")))
                ]
            ),
        )
        if len(updated.body) == 1 and m.matches(updated.body[0], drop):
            return cst.RemoveFromParent()
        return updated


class ModuleBases(Rule):
    ID = "MG008"
    DESCRIPTION = "HF base classes (PreTrainedModel, GradientCheckpointingLayer, ...) become nn.Module."

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        ctx = self.rewrite
        used = {n for i in reachable(module, {ctx.entry_class}) for n in top_level_names(module.body[i])}
        return module.visit(_Bases(_hf_bases(module), ctx, used))
