"""Relative imports become absolute: `...x` -> `transformers.x`, the model's own configuration module
by the name the runtime registers it under, other siblings under the model's transformers package."""
import libcst as cst

from skills.migrator.context import RewriteContext


class _Absolute(cst.CSTTransformer):
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


def apply(module: cst.Module, ctx: RewriteContext) -> cst.Module:
    return module.visit(_Absolute(ctx))
