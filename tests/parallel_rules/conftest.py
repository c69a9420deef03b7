"""Shared helpers for the parallelize rule tests: run one rule over a dedented snippet of migrated code."""

import textwrap

import libcst as cst
import pytest

from skills.parallel_impl.rewrite import ParallelRewriteContext


def make_parallel_context(**overrides) -> ParallelRewriteContext:
    return ParallelRewriteContext(
        **{"entry_class": "LlamaForCausalLM", "filename": "modeling_llama.py", **overrides}
    )


@pytest.fixture
def make_ctx():
    """make_ctx(**overrides) -> ParallelRewriteContext (entry class LlamaForCausalLM)."""
    return make_parallel_context


@pytest.fixture
def run_rule():
    """run_rule(rule_module, code, ctx=None) -> rewritten code; pass ctx to inspect rewrites / findings."""

    def run(rule, code: str, ctx: ParallelRewriteContext | None = None) -> str:
        ctx = ctx if ctx is not None else make_parallel_context()
        return rule.apply(cst.parse_module(textwrap.dedent(code)), ctx).code

    return run
