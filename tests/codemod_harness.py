"""The one harness of both rule folders (tests/rules, tests/parallel_rules), in the shape of libcst's
CodemodTest: a rule runs as a codemod command over a dedented snippet; `assert_codemod` checks before ->
after and that the rule is idempotent (after -> after), `assert_noop` that it leaves code alone."""

import textwrap
from collections.abc import Callable

import libcst as cst
from libcst.codemod import CodemodContext

from skills.migrator.context import RewriteContext
from skills.migrator.rule import Rule


def run_codemod(rule: type[Rule], code: str, ctx: RewriteContext) -> str:
    module = cst.parse_module(textwrap.dedent(code))
    return rule(CodemodContext(filename=ctx.filename), ctx).transform_module(module).code


def assert_codemod(rule: type[Rule], before: str, after: str, make_ctx: Callable[[], RewriteContext]) -> None:
    after = textwrap.dedent(after)
    assert run_codemod(rule, before, make_ctx()) == after
    assert run_codemod(rule, after, make_ctx()) == after, f"{rule.ID} is not idempotent"


def assert_noop(rule: type[Rule], code: str, make_ctx: Callable[[], RewriteContext]) -> None:
    ctx = make_ctx()
    assert run_codemod(rule, code, ctx) == textwrap.dedent(code)
    assert ctx.findings == []
