"""Shared helpers for the parallelize rule tests: run one rule over a dedented snippet of migrated code."""

import pytest
from codemod_harness import run_codemod

from skills.migrator.rule import Rule
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
    """run_rule(RuleClass, code, ctx=None) -> rewritten code; pass ctx to inspect rewrites / findings."""

    def run(rule: type[Rule], code: str, ctx: ParallelRewriteContext | None = None) -> str:
        return run_codemod(rule, code, ctx if ctx is not None else make_parallel_context())

    return run
