"""cache_keys: the offset a looped layer adds to the cache index it updates becomes its attention call's
`cache_key` (HRM-Text's `self.layer_idx + cycle_offset`, Dory's `self.layer_idx + cache_offset`)."""

from textwrap import dedent

from codemod_harness import assert_codemod, assert_noop

from skills.migrator.rules.cache_keys import CacheKeys as rule

# HRM-Text's attention forward, shortened.
BEFORE = dedent("""\
    class HrmTextAttention(nn.Module):
        def forward(self, hidden_states, attention_mask=None, cache=None, cycle_offset: int = 0, **kwargs):
            query_states, key_states, value_states = self.project(hidden_states)
            if cache is not None:
                key_states, value_states = cache.update(
                    key_states, value_states, self.layer_idx + cycle_offset, kwargs=kwargs
                )
            attn_output, attn_weights = attention_interface(
                self,
                query_states,
                key_states,
                value_states,
                attention_mask,
                scaling=self.scaling,
            )
            return self.o_proj(attn_output), attn_weights
    """)

AFTER = BEFORE.replace(
    "            scaling=self.scaling,\n",
    "            scaling=self.scaling,\n            cache_key=cycle_offset,\n",
)


def test_an_offset_cache_index_becomes_the_attention_call_s_cache_key(make_ctx):
    assert_codemod(rule, BEFORE, AFTER, make_ctx)


def test_the_offset_may_come_first_or_as_a_keyword(make_ctx):
    before = BEFORE.replace(
        "self.layer_idx + cycle_offset, kwargs=kwargs", "layer_idx=2 * cycle_offset + self.layer_idx"
    )
    after = before.replace(
        "            scaling=self.scaling,\n",
        "            scaling=self.scaling,\n            cache_key=2 * cycle_offset,\n",
    )
    assert_codemod(rule, before, after, make_ctx)


def test_a_plain_layer_index_is_left_alone(make_ctx):
    assert_noop(rule, BEFORE.replace("self.layer_idx + cycle_offset", "self.layer_idx"), make_ctx)


def test_an_offset_without_an_attention_call_to_carry_it_is_refused(make_ctx, run_rule):
    ctx = make_ctx()
    code = BEFORE.replace("attention_interface(", "my_attention(")
    assert run_rule(rule, code, ctx) == code
    (finding,) = ctx.findings
    assert "offset by `cycle_offset`" in finding.what and "no single attention_interface call" in finding.what


def test_the_offset_may_come_through_a_name_bound_once(make_ctx):
    """Inkling2-Loop names the index first: `cache_layer_idx = self.layer_idx + cache_offset`."""
    before = BEFORE.replace(
        "        query_states, key_states, value_states = self.project(hidden_states)\n",
        "        cache_layer_idx = self.layer_idx + cycle_offset\n"
        "        query_states, key_states, value_states = self.project(hidden_states)\n",
    ).replace("self.layer_idx + cycle_offset, kwargs=kwargs", "cache_layer_idx, kwargs=kwargs")
    after = before.replace(
        "            scaling=self.scaling,\n",
        "            scaling=self.scaling,\n            cache_key=cycle_offset,\n",
    )
    assert_codemod(rule, before, after, make_ctx)
    rebound = before.replace(
        "        if cache is not None:\n",
        "        cache_layer_idx = self.layer_idx\n        if cache is not None:\n",
    )
    assert_noop(rule, rebound, make_ctx)  # bound twice: which index the update uses is not the rule's to say
