"""Rule.transform_module adds queued imports on the top of the file alone: the result equals libcst's
AddImportsVisitor run over the whole module, whatever the file's shape."""

import textwrap

import libcst as cst
import pytest
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor

from skills.migrator.context import RewriteContext
from skills.migrator.rule import Rule

SHAPES = {
    "docstring_then_imports": '''
        """Doc."""

        import os
        from torch import nn

        x = 1
    ''',
    "merges_into_an_existing_from_import": """
        from runtime.layers import rms_norm
        import os

        def f():
            from runtime.layers import rms_norm

            return rms_norm
    """,
    "code_first": """
        x = 1
        import os
    """,
    "comment_before_the_code": """
        import os
        # a comment
        class A:
            pass
    """,
    "imports_only": """
        import os
        from torch import nn
    """,
    "empty": "",
}
WANTED = [
    ("runtime.layers", "rms_norm"),
    ("runtime.layers", "Attention"),
    ("torch", "nn"),
    ("__future__", "annotations"),
]


class _AddsImports(Rule):
    ID = "T001"
    DESCRIPTION = "test: queues imports"

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        self.add_needed_imports(WANTED)
        return tree


@pytest.mark.parametrize("shape", SHAPES)
def test_imports_added_on_the_head_equal_the_whole_module_pass(shape):
    module = cst.parse_module(textwrap.dedent(SHAPES[shape]))
    context = CodemodContext(filename="modeling_x.py")
    for module_name, name in WANTED:
        AddImportsVisitor.add_needed_import(context, module_name, name)
    want = AddImportsVisitor(context).transform_module(module).code
    got = (
        _AddsImports(CodemodContext(filename="modeling_x.py"), RewriteContext("X"))
        .transform_module(module)
        .code
    )
    assert got == want
