"""latent_kv_cache: MLA attention hands the runtime Attention its latents and the method that expands them, and
the layer caches the latents (`latent_dim`) instead of per-head keys and values."""

from textwrap import dedent

import pytest
from codemod_harness import assert_codemod, assert_noop, run_codemod

from skills.migrator.rules.latent_kv_cache import LatentKVCache as rule

# DeepSeek-V3's attention after MG005 (runtime Attention), shortened.
BEFORE = dedent("""\
    class DeepseekV3Attention(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.kv_lora_rank = config.kv_lora_rank
            self.qk_rope_head_dim = config.qk_rope_head_dim
            self.kv_b_proj = nn.Linear(config.kv_lora_rank, 4 * 32, bias=False)
            self.attn = Attention(
                num_heads=4,
                head_dim=24,
                v_head_dim=16,
                scale=1.0,
            )

        def expand_kv(self, kv_nope, k_rot):
            k_nope, value_states = self.kv_b_proj(kv_nope).view(1, -1, 4, 32).transpose(1, 2).split([16, 16], -1)
            return torch.cat([k_nope, k_rot.expand(-1, 4, -1, -1)], -1), value_states

        def forward(self, hidden_states, query_states, *, forward_metadata, **kwargs):
            kv_nope, k_rot = hidden_states.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)

            key_states, value_states = self.expand_kv(kv_nope, k_rot)

            attn_output = self.attn(query_states, key_states, value_states, forward_metadata)
            return self.o_proj(attn_output.flatten(-2))
    """)

AFTER = dedent("""\
    class DeepseekV3Attention(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.kv_lora_rank = config.kv_lora_rank
            self.qk_rope_head_dim = config.qk_rope_head_dim
            self.kv_b_proj = nn.Linear(config.kv_lora_rank, 4 * 32, bias=False)
            self.attn = Attention(
                num_heads=4,
                head_dim=24,
                v_head_dim=16,
                scale=1.0,
                latent_dim=config.kv_lora_rank + config.qk_rope_head_dim,
            )

        def expand_kv(self, kv_nope, k_rot):
            k_nope, value_states = self.kv_b_proj(kv_nope).view(1, -1, 4, 32).transpose(1, 2).split([16, 16], -1)
            return torch.cat([k_nope, k_rot.expand(-1, 4, -1, -1)], -1), value_states

        def forward(self, hidden_states, query_states, *, forward_metadata, **kwargs):
            kv_nope, k_rot = hidden_states.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)

            attn_output = self.attn.forward_latent(query_states, (kv_nope, k_rot), self.expand_kv, forward_metadata)
            return self.o_proj(attn_output.flatten(-2))
    """)


def test_latents_cached_and_expanded_by_the_layer(make_ctx):
    assert_codemod(rule, BEFORE, AFTER, make_ctx)


def test_attention_without_latents_untouched(make_ctx):
    # llama-style: keys and values come from their own projections, nothing reads kv_lora_rank
    code = dedent("""\
        class LlamaAttention(nn.Module):
            def __init__(self, config, infer_config, comm_manager=None, prefix=""):
                super().__init__()
                self.attn = Attention(num_heads=4, head_dim=16, scale=1.0)

            def forward(self, hidden_states, *, forward_metadata, **kwargs):
                key_states, value_states = self.kv_proj(hidden_states).chunk(2, dim=-1)
                return self.attn(self.q_proj(hidden_states), key_states, value_states, forward_metadata)
        """)
    assert_noop(rule, code, make_ctx)


@pytest.mark.parametrize(
    "change",
    [
        # the keys are read again: caching only the latents would not give them back
        (
            "        return self.o_proj(",
            "        attn_output = attn_output + key_states.sum()\n        return self.o_proj(",
        ),
        # a latent rebound between the expansion and the attention call
        (
            "\n        attn_output = self.attn(",
            "\n        kv_nope = kv_nope * 2\n        attn_output = self.attn(",
        ),
        # the cached width would be unknown
        ("config.qk_rope_head_dim\n", "16\n"),
    ],
    ids=["keys_read_again", "latent_rebound", "no_rope_width_in_config"],
)
def test_latents_left_expanded_where_caching_them_would_change_the_result(make_ctx, change):
    code = BEFORE.replace(*change)
    assert code != BEFORE
    assert_noop(rule, code, make_ctx)


def test_keywords_the_latent_call_takes_are_kept(make_ctx):
    """An indexer's picks (MG032) and a looped layer's cache key reach forward_latent; sinks, which it does not
    take, leave the keys and values expanded."""
    call = "self.attn(query_states, key_states, value_states, forward_metadata"
    picked = BEFORE.replace(call, call + ", selected=picks")
    assert "self.expand_kv, forward_metadata, selected=picks)" in run_codemod(rule, picked, make_ctx())
    assert_noop(rule, BEFORE.replace(call, call + ", sinks=self.sinks"), make_ctx)
