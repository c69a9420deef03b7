"""Relative imports become absolute: `...x` -> `transformers.x`, the model's own configuration module
by the name the runtime registers it under, other siblings under the model's transformers package. A type
that borrows another's modeling code (exaone runs llama's) names its own config class instead of the
borrowed one (`LlamaConfig` -> `ExaoneConfig`)."""

import libcst as cst

from skills.migrator.context import RewriteContext
from skills.migrator.cst_utils import Transformer
from skills.migrator.rule import Rule


class _Absolute(Transformer):
    def __init__(self, ctx: RewriteContext):
        self.ctx = ctx

    def leave_ImportFrom(self, original: cst.ImportFrom, updated: cst.ImportFrom) -> cst.ImportFrom:
        dots = len(updated.relative)
        if not dots:
            return updated
        tail = cst.Module([]).code_for_node(updated.module) if updated.module else ""
        if dots == 1 and tail.startswith("configuration_") and self.ctx.config_module:
            target = self.ctx.config_module
        else:
            package = self.ctx.hf_package.split(".")  # transformers.models.llama
            base = package[: len(package) - dots + 1]
            target = ".".join([*base, tail] if tail else base)
        return updated.with_changes(relative=[], module=cst.parse_expression(target))


class _AbsoluteRenamed(_Absolute):
    """Also the borrowed config class's name, wherever it is written (a walk of every name: only when needed)."""

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.Name:
        old, new = self.ctx.config_rename
        return updated.with_changes(value=new) if updated.value == old else updated


class AbsoluteImports(Rule):
    ID = "MG001"
    DESCRIPTION = (
        "Relative imports become absolute: transformers.x, the vendored configuration module and class."
    )

    def transform_module_impl(self, module: cst.Module) -> cst.Module:
        ctx = self.rewrite
        return module.visit((_AbsoluteRenamed if ctx.config_rename else _Absolute)(ctx))
