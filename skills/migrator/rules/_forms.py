"""Helpers of the rules that recognise a computation written out in a known form (MG029, MG030): a function's
statements as Python's own parser reads them (layout, parentheses and comments do not matter), and a transformer
that replaces such bodies by one `return` of the runtime's fused call, keeping the docstring."""

import ast
import textwrap

import libcst as cst

from skills.migrator.cst_utils import Transformer, is_docstring


def statements(function: cst.FunctionDef) -> list[ast.stmt]:
    """The function's statements, docstring left out."""
    body = ast.parse(textwrap.dedent(cst.Module([]).code_for_node(function))).body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        return body[1:]
    return body


def unparsed(code: str | list[ast.stmt]) -> list[str]:
    """Each statement of the code as `ast.unparse` writes it: equal lists mean the same statements."""
    return [ast.unparse(s) for s in (ast.parse(code).body if isinstance(code, str) else code)]


def assigned_targets(body: list[ast.stmt], count: int) -> list[str] | None:
    """The names the first `count` statements assign, one plain name each, or None."""
    if len(body) < count or not all(isinstance(s, ast.Assign) and len(s.targets) == 1 for s in body[:count]):
        return None
    names = [s.targets[0] for s in body[:count]]
    return [n.id for n in names] if all(isinstance(n, ast.Name) for n in names) else None


def plain_parameters(function: cst.FunctionDef) -> list[str] | None:
    """The parameter names of a function that takes only positional-or-keyword parameters and has no
    decorators, or None."""
    params = function.params
    if (
        function.decorators
        or isinstance(params.star_arg, cst.Param)
        or params.kwonly_params
        or params.star_kwarg
    ):
        return None
    return [p.name.value for p in params.params]


class ReturnInstead(Transformer):
    """Replaces the body of each given function (by identity) with `return <expression>`, keeping its
    docstring."""

    def __init__(self, returns: dict[cst.FunctionDef, str]):
        self.returns = returns

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        if (expression := self.returns.get(original)) is None:
            return updated
        first = updated.body.body[0]
        body = [*([first] if is_docstring(first) else []), cst.parse_statement(f"return {expression}")]
        return updated.with_changes(body=updated.body.with_changes(body=body))
