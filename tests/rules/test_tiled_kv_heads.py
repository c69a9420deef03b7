"""tiled_kv_heads: keys and values tiled over the query heads with `.repeat` are cached once, and the runtime
Attention maps query heads onto them the same way (`kv_heads_tiled=True`)."""

from textwrap import dedent

import pytest
from codemod_harness import assert_codemod, assert_noop

from skills.migrator.rules.tiled_kv_heads import TiledKVHeads as rule

# JetMoE's attention after MG005 (runtime Attention), shortened.
BEFORE = dedent("""\
    class JetMoeAttention(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.top_k = config.num_experts_per_tok
            self.attn = Attention(num_heads=8, head_dim=16, num_kv_heads=4, scale=0.25)

        def forward(self, hidden_states, *, forward_metadata, **kwargs):
            query_states, key_states, value_states = self.project(hidden_states)

            # repeated, not interleaved
            key_states = key_states.repeat(1, self.top_k, 1, 1)
            value_states = value_states.repeat(1, self.top_k, 1, 1)

            attn_output = self.attn(query_states, key_states, value_states, forward_metadata)
            return self.experts.reduce(attn_output)
    """)

AFTER = dedent("""\
    class JetMoeAttention(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.top_k = config.num_experts_per_tok
            self.attn = Attention(num_heads=8, head_dim=16, num_kv_heads=4, scale=0.25, kv_heads_tiled=True)

        def forward(self, hidden_states, *, forward_metadata, **kwargs):
            query_states, key_states, value_states = self.project(hidden_states)

            attn_output = self.attn(query_states, key_states, value_states, forward_metadata)
            return self.experts.reduce(attn_output)
    """)


def test_tiled_keys_and_values_are_cached_once(make_ctx):
    assert_codemod(rule, BEFORE, AFTER, make_ctx)


@pytest.mark.parametrize(
    "before,after",
    [
        (
            "value_states = value_states.repeat(1, self.top_k, 1, 1)",
            "value_states = value_states * 2",
        ),  # keys only
        ("value_states.repeat(1, self.top_k, 1, 1)", "value_states.repeat(1, 2, 1, 1)"),  # counts differ
        ("key_states.repeat(1, self.top_k, 1, 1)", "key_states.repeat(1, 1, self.top_k, 1)"),  # not the heads
    ],
)
def test_other_repeats_are_left_alone(make_ctx, before, after):
    assert_noop(rule, BEFORE.replace(before, after), make_ctx)


def test_attention_without_repeats_untouched(make_ctx):
    assert_noop(rule, AFTER.replace(", kv_heads_tiled=True", ""), make_ctx)


# Remote code in transformers' older style, after MG005: GQA written out before the heads-first attention call.
GROUPED_BEFORE = dedent("""\
    class GroupAttention(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.num_key_value_groups = 2
            self.attn = Attention(num_heads=4, head_dim=16, num_kv_heads=2, scale=0.25)

        def forward(self, hidden_states, *, forward_metadata):
            q, key_states, value_states = self.project(hidden_states)
            key_states = repeat_kv(key_states, self.num_key_value_groups)
            value_states = repeat_kv(value_states, self.num_key_value_groups)
            out = self.attn.forward_heads_first(q, key_states, value_states, forward_metadata)
            return self.wo(out)
    """)

GROUPED_AFTER = dedent("""\
    class GroupAttention(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.num_key_value_groups = 2
            self.attn = Attention(num_heads=4, head_dim=16, num_kv_heads=2, scale=0.25)

        def forward(self, hidden_states, *, forward_metadata):
            q, key_states, value_states = self.project(hidden_states)
            out = self.attn.forward_heads_first(q, key_states, value_states, forward_metadata)
            return self.wo(out)
    """)


@pytest.mark.parametrize(
    "form",
    [
        "repeat_kv({x}, self.num_key_value_groups)",
        "{x}.repeat_interleave(self.num_key_value_groups, dim=1)",
        "torch.repeat_interleave({x}, repeats=self.num_key_value_groups, dim=1)",
    ],
)
def test_keys_and_values_repeated_per_group_are_passed_unrepeated(make_ctx, form):
    """The runtime groups query heads over the cached key heads as these repeats do (head h reads h // n)."""
    before = GROUPED_BEFORE
    for x in ("key_states", "value_states"):
        before = before.replace(f"repeat_kv({x}, self.num_key_value_groups)", form.format(x=x))
    assert_codemod(rule, before, GROUPED_AFTER, make_ctx)


@pytest.mark.parametrize(
    "before,after",
    [
        (
            "repeat_kv(value_states, self.num_key_value_groups)",
            "value_states.repeat(1, 2, 1, 1)",
        ),  # kinds differ
        ("repeat_kv(value_states, self.num_key_value_groups)", "repeat_kv(value_states, 3)"),  # counts differ
        (
            "repeat_kv(key_states, self.num_key_value_groups)",
            "key_states.repeat_interleave(2, dim=2)",
        ),  # tokens
    ],
)
def test_other_grouped_repeats_are_left_alone(make_ctx, before, after):
    assert_noop(rule, GROUPED_BEFORE.replace(before, after), make_ctx)


def test_grouped_repeats_stay_where_the_layer_is_not_told_its_key_heads_or_the_helper_tiles(make_ctx):
    assert_noop(rule, GROUPED_BEFORE.replace(", num_kv_heads=2", ""), make_ctx)
    tiling = "def repeat_kv(x, n):\n    return x.repeat(1, n, 1, 1)\n\n\n" + GROUPED_BEFORE
    assert_noop(rule, tiling, make_ctx)
    interleaving = tiling.replace("x.repeat(1, n, 1, 1)", "x.repeat_interleave(n, dim=1)")
    assert_codemod(rule, interleaving, interleaving[: interleaving.index("class")] + GROUPED_AFTER, make_ctx)


INLINE = "{x} = {x}[:, :, None].expand(b, 2, self.num_key_value_groups, t, 16)\n        {x} = {x}.reshape(b, 4, t, 16)\n"


@pytest.mark.parametrize(
    "form",
    [
        INLINE,  # repeat_kv's own steps, written out
        "{x} = {x}[:, :, None, :, :].expand(b, 2, self.num_key_value_groups, t, 16).flatten(1, 2)\n",
    ],
)
def test_keys_and_values_repeated_per_group_inline_are_passed_unrepeated(make_ctx, form):
    before = GROUPED_BEFORE
    for x in ("key_states", "value_states"):
        before = before.replace(f"{x} = repeat_kv({x}, self.num_key_value_groups)\n", form.format(x=x))
    assert before != GROUPED_BEFORE
    assert_codemod(rule, before, GROUPED_AFTER, make_ctx)


@pytest.mark.parametrize(
    "change",
    [
        (
            ".expand(b, 2, self.num_key_value_groups, t, 16)\n        value",
            ".expand(b, 2, 3, t, 16)\n        value",
        ),
        ("value_states[:, :, None]", "value_states[:, None]"),  # a new axis before the heads: tiling
    ],
)
def test_other_inline_repeats_are_left_alone(make_ctx, change):
    before = GROUPED_BEFORE
    for x in ("key_states", "value_states"):
        before = before.replace(f"{x} = repeat_kv({x}, self.num_key_value_groups)\n", INLINE.format(x=x))
    assert before.replace(*change) != before
    assert_noop(rule, before.replace(*change), make_ctx)
