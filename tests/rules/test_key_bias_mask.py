"""key_bias_mask: an attention mask that is a score bias per key (Doge's dynamic mask) becomes the attention call's
`key_bias=`, and a top-k of the largest past a window becomes `keep_keys=`; MG005 builds the runtime Attention
with both."""

from textwrap import dedent

import pytest
from codemod_harness import assert_codemod, assert_noop, run_codemod

from skills.migrator.rules.key_bias_mask import KeyBiasMask as rule
from skills.migrator.rules.runtime_attention import RuntimeAttention

# Doge's attention after MG003 folded the HF mask out of its builder, shortened.
BEFORE = dedent('''\
    class DogeAttention(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.keep_window_size = config.keep_window_size

        def forward(self, hidden_states, position_embeddings, **kwargs):
            dt_states = torch.exp(self.A * F.softplus(self.dt_proj(value_states))).transpose(-1, -2)
            attn_mask = self.prepare_dynamic_mask(
                hidden_states=hidden_states,
                dt_states=dt_states,
                keep_window_size=self.keep_window_size,
            )
            attn_mask = repeat_kv(attn_mask, self.num_key_value_groups)
            attn_output, attn_weights = attention_interface(
                self,
                query_states,
                key_states,
                value_states,
                attention_mask=attn_mask,
                scaling=self.scaling,
                **kwargs,
            )
            return self.o_proj(attn_output), attn_weights

        def prepare_dynamic_mask(self, hidden_states, dt_states, keep_window_size: int = 2048):
            """The mask from dt_states."""
            min_dtype = torch.finfo(hidden_states.dtype).min
            attn_mask = dt_states[:, :, None, :].expand(-1, -1, hidden_states.shape[1], -1)
            if attn_mask.shape[-1] > keep_window_size:
                active_mask = torch.zeros_like(attn_mask)
                topk_indices = torch.topk(attn_mask, keep_window_size, dim=-1, largest=True, sorted=False).indices
                active_mask = active_mask.scatter(-1, topk_indices, 1.0)
                attn_mask = attn_mask.masked_fill(active_mask == 0.0, min_dtype)
            return attn_mask
''')

AFTER = dedent('''\
    class DogeAttention(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.keep_window_size = config.keep_window_size

        def forward(self, hidden_states, position_embeddings, **kwargs):
            dt_states = torch.exp(self.A * F.softplus(self.dt_proj(value_states))).transpose(-1, -2)
            attn_output, attn_weights = attention_interface(
                self,
                query_states,
                key_states,
                value_states,
                scaling=self.scaling,
                key_bias=dt_states, keep_keys=self.keep_window_size, **kwargs,
            )
            return self.o_proj(attn_output), attn_weights

        def prepare_dynamic_mask(self, hidden_states, dt_states, keep_window_size: int = 2048):
            """The mask from dt_states."""
            min_dtype = torch.finfo(hidden_states.dtype).min
            attn_mask = dt_states[:, :, None, :].expand(-1, -1, hidden_states.shape[1], -1)
            if attn_mask.shape[-1] > keep_window_size:
                active_mask = torch.zeros_like(attn_mask)
                topk_indices = torch.topk(attn_mask, keep_window_size, dim=-1, largest=True, sorted=False).indices
                active_mask = active_mask.scatter(-1, topk_indices, 1.0)
                attn_mask = attn_mask.masked_fill(active_mask == 0.0, min_dtype)
            return attn_mask
''')


def test_a_per_key_bias_mask_becomes_key_bias_and_its_window_keep_keys(make_ctx):
    assert_codemod(rule, BEFORE, AFTER, make_ctx)


def test_a_builder_without_a_window_called_with_positional_arguments(make_ctx):
    before = dedent("""\
        class A(nn.Module):
            def forward(self, x, **kwargs):
                mask = self.mask(x, bias)
                out, w = attention_interface(self, q, k, v, attention_mask=mask, scaling=self.scaling)
                return out

            def mask(self, x, b):
                per_key = b[:, :, None, :]
                return per_key
        """)
    after = before.replace("        mask = self.mask(x, bias)\n", "").replace(
        "attention_mask=mask, scaling=self.scaling", "scaling=self.scaling, key_bias=bias"
    )
    assert_codemod(rule, before, after, make_ctx)


def test_the_runtime_attention_takes_the_bias_per_call_and_its_window_at_init(make_ctx):
    """MG005 after MG033: `key_bias=` on every call, `key_bias=True, keep_keys=...` on the layer."""
    ctx = make_ctx(entry_class="DogeAttention")
    out = run_codemod(RuntimeAttention, run_codemod(rule, BEFORE, ctx), ctx)
    assert ctx.findings == []
    assert "self.attn(query_states, key_states, value_states, forward_metadata, key_bias=dt_states)" in out
    assert "keep_keys=self.keep_window_size, key_bias=True)" in out


@pytest.mark.parametrize(
    "before, after",
    [
        ("attention_mask=attn_mask,", "attention_mask=attention_mask,"),  # the HF mask: MG003's
        ("dt_states[:, :, None, :]", "dt_states[:, None, :, :]"),  # a bias per query, not per key
        ("    return attn_mask", "    return attn_mask * 2"),  # more than a bias
        ("torch.topk(attn_mask, keep_window_size", "torch.topk(attn_mask, 4"),  # another count than tested
        ("largest=True", "largest=False"),  # the smallest
        (
            "attn_mask = repeat_kv(attn_mask,",
            "attn_mask = attn_mask.flip(-1)\n        attn_mask = repeat_kv(attn_mask,",
        ),
        ("dim=-1, largest", "dim=1, largest"),  # a top-k over another axis
        (
            "        min_dtype = ",
            "        dt_states = dt_states * 2\n        min_dtype = ",
        ),  # the bias changed first
        ("dt_states[:, :, None, :]", "min_dtype[:, :, None, :]"),  # a local, not the caller's
        (
            "        return self.o_proj(",
            "        print(attn_mask)\n        return self.o_proj(",
        ),  # read again
    ],
)
def test_other_masks_are_left_to_mg005(make_ctx, before, after):
    assert before in BEFORE
    assert_noop(rule, BEFORE.replace(before, after), make_ctx)
