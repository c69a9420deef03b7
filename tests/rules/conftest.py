"""Shared helpers for the per-rule tests: run one rewrite rule over a dedented snippet.

Snippets are written `dedent('''\\ ...''')`-style; `run_rule` dedents again, so either form works."""

import pytest
from codemod_harness import run_codemod

from skills.migrator.context import RewriteContext
from skills.migrator.rule import Rule

DEFAULT_CTX = {
    "entry_class": "LlamaForCausalLM",
    "config_module": "configuration_llama",
    "hf_package": "transformers.models.llama",
    "kv_layout": "paged",
    "filename": "modeling_llama.py",
}


def make_rewrite_context(**overrides) -> RewriteContext:
    return RewriteContext(**{**DEFAULT_CTX, **overrides})


def apply_rule(rule: type[Rule], code: str, ctx: RewriteContext | None = None, **overrides) -> str:
    """The rule on the dedented code; pass ctx to inspect its findings afterwards."""
    return run_codemod(rule, code, ctx if ctx is not None else make_rewrite_context(**overrides))


@pytest.fixture
def make_ctx():
    """make_ctx(**overrides) -> RewriteContext (llama defaults: entry LlamaForCausalLM, paged KV)."""
    return make_rewrite_context


@pytest.fixture
def run_rule():
    """run_rule(RuleClass, code, ctx=None, **ctx_overrides) -> rewritten code."""
    return apply_rule
