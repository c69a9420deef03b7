"""Shared helpers for the per-rule tests: run one rewrite rule over a dedented snippet.

Snippets are written `dedent('''\\ ...''')`-style; `run_rule` dedents again, so either form works."""
import textwrap

import libcst as cst
import pytest

from skills.migrator.context import RewriteContext

DEFAULT_CTX = {
    "entry_class": "LlamaForCausalLM",
    "config_module": "configuration_llama",
    "hf_package": "transformers.models.llama",
    "kv_layout": "paged",
    "filename": "modeling_llama.py",
}


def make_rewrite_context(**overrides) -> RewriteContext:
    return RewriteContext(**{**DEFAULT_CTX, **overrides})


def apply_rule(rule, code: str, ctx: RewriteContext | None = None, **overrides) -> str:
    """`rule.apply` on the dedented code; pass ctx to inspect its findings afterwards."""
    ctx = ctx if ctx is not None else make_rewrite_context(**overrides)
    return rule.apply(cst.parse_module(textwrap.dedent(code)), ctx).code


@pytest.fixture
def make_ctx():
    """make_ctx(**overrides) -> RewriteContext (llama defaults: entry LlamaForCausalLM, paged KV)."""
    return make_rewrite_context


@pytest.fixture
def run_rule():
    """run_rule(rule_module, code, ctx=None, **ctx_overrides) -> rewritten code."""
    return apply_rule
