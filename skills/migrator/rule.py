"""What a rewrite rule is, for `skill migrate` and `skill parallelize` alike: a LibCST codemod command with an
id and a one-line description (as bump-pydantic's BP001...), run over one file with the rewrite context.
Import changes are queued (`self.add_needed_import`, `self.remove_unused_import`) and applied once, after
the rule, by the command itself."""

from typing import ClassVar

import libcst as cst
import libcst.matchers as m
from libcst.codemod import Codemod, CodemodCommand, CodemodContext, VisitorBasedCodemodCommand
from libcst.codemod.visitors import AddImportsVisitor, RemoveImportsVisitor

from skills.migrator.context import RewriteContext
from skills.migrator.cst_utils import visits_subtree

_IMPORT_LINE = m.SimpleStatementLine(body=[m.Import() | m.ImportFrom()])


class Rule(CodemodCommand):
    ID: ClassVar[str]  # e.g. "MG009"; stable: users pass it to --disable
    DESCRIPTION: ClassVar[str]  # one line, for --list-rules

    def __init__(self, context: CodemodContext, rewrite: RewriteContext) -> None:
        super().__init__(context)
        self.rewrite = rewrite

    def transform_module(self, tree: cst.Module) -> cst.Module:
        """CodemodCommand.transform_module, cheaper: no MetadataWrapper (a deep copy of the module) for a rule
        with nothing to resolve, and the queued imports added on the top of the file alone."""
        if self.get_inherited_dependencies():
            tree = Codemod.transform_module(self, tree)
        else:
            tree = self.transform_module_impl(tree)
        if AddImportsVisitor.CONTEXT_KEY in self.context.scratch:
            tree = self._add_imports(tree)
        if RemoveImportsVisitor.CONTEXT_KEY in self.context.scratch:
            tree = RemoveImportsVisitor(self.context).transform_module(tree)
        return tree

    def _add_imports(self, tree: cst.Module) -> cst.Module:
        """AddImportsVisitor on the statements it reads and changes: the first, the import lines after it and the
        statement after those (on the whole module it copies and walks every node: a third of the rules' time)."""
        end = 1
        while end < len(tree.body) and m.matches(tree.body[end], _IMPORT_LINE):
            end += 1
        head = AddImportsVisitor(self.context).transform_module(tree.with_changes(body=tree.body[: end + 1]))
        return tree.with_changes(body=(*head.body, *tree.body[end + 1 :]))

    def add_needed_imports(self, imports: list[tuple[str, str]]) -> None:
        for module, name in imports:
            self.add_needed_import(module, name)


class VisitorRule(Rule, VisitorBasedCodemodCommand):
    """A rule that is itself the transformer (visit_* / leave_* methods), with metadata providers declared in
    METADATA_DEPENDENCIES and read through `self.get_metadata`. As cst_utils.Transformer, it does not walk into a
    subtree holding no node its methods name."""

    def on_visit(self, node: cst.CSTNode) -> bool:
        return visits_subtree(self, VisitorRule, node) and super().on_visit(node)
