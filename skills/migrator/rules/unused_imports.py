"""Imports nothing uses any more are removed (libcst decides by scope analysis)."""
import libcst as cst
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import RemoveImportsVisitor

from skills.migrator.context import RewriteContext
from skills.migrator.cst_utils import dotted


def apply(module: cst.Module, ctx: RewriteContext) -> cst.Module:
    context = CodemodContext()
    for s in module.body:
        for small in s.body if isinstance(s, cst.SimpleStatementLine) else []:
            if isinstance(small, cst.ImportFrom) and small.module and not isinstance(small.names, cst.ImportStar):
                mod = cst.Module([]).code_for_node(small.module)
                if mod == "__future__":
                    continue
                for alias in small.names:
                    RemoveImportsVisitor.remove_unused_import(
                        context, mod, dotted(alias.name), alias.asname.name.value if alias.asname else None)
            elif isinstance(small, cst.Import):
                for alias in small.names:
                    RemoveImportsVisitor.remove_unused_import(
                        context, dotted(alias.name), asname=alias.asname.name.value if alias.asname else None)
    return RemoveImportsVisitor(context).transform_module(module)
