"""What a rewrite rule is, for `skill migrate` and `skill parallelize` alike: a LibCST codemod command with an
id and a one-line description (as bump-pydantic's BP001...), run over one file with the rewrite context.
Import changes are queued (`self.add_needed_import`, `self.remove_unused_import`) and applied once, after
the rule, by the command itself."""

from typing import ClassVar

import libcst as cst
from libcst.codemod import CodemodCommand, CodemodContext, VisitorBasedCodemodCommand
from libcst.codemod.visitors import AddImportsVisitor, RemoveImportsVisitor

from skills.migrator.context import RewriteContext


class Rule(CodemodCommand):
    ID: ClassVar[str]  # e.g. "MG009"; stable: users pass it to --disable
    DESCRIPTION: ClassVar[str]  # one line, for --list-rules

    def __init__(self, context: CodemodContext, rewrite: RewriteContext) -> None:
        super().__init__(context)
        self.rewrite = rewrite

    def transform_module(self, tree: cst.Module) -> cst.Module:
        if self.get_inherited_dependencies():
            return super().transform_module(tree)
        # Nothing to resolve: skip the MetadataWrapper (a deep copy of the module per rule), then apply the
        # queued import changes as CodemodCommand.transform_module does.
        tree = self.transform_module_impl(tree)
        for visitor in (AddImportsVisitor, RemoveImportsVisitor):
            if visitor.CONTEXT_KEY in self.context.scratch:
                tree = visitor(self.context).transform_module(tree)
        return tree

    def add_needed_imports(self, imports: list[tuple[str, str]]) -> None:
        for module, name in imports:
            self.add_needed_import(module, name)


class VisitorRule(Rule, VisitorBasedCodemodCommand):
    """A rule that is itself the transformer (visit_* / leave_* methods), with metadata providers declared in
    METADATA_DEPENDENCIES and read through `self.get_metadata`."""
