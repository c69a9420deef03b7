"""request_states: a layer keeping conv / recurrent state through transformers' cache API runs per request with
the runtime's states (`@per_request`), its callers passing forward_metadata on; any other use of its cache is left
to MG004's refusal."""

from textwrap import dedent

import pytest
from codemod_harness import assert_codemod, assert_noop

from skills.migrator.rules.request_states import PerRequestStates as rule

# LFM2's short convolution, its cache parameter already what MG004 would fold, and the decoder layer calling it.
BEFORE = dedent("""\
    class Lfm2ShortConv(nn.Module):
        def forward(self, hidden_states: torch.Tensor, cache: Cache | None = None, **kwargs):
            seq_len = hidden_states.shape[1]
            conv_state = cache.get_conv_state(self.layer_idx) if cache is not None else None
            if conv_state is not None and seq_len == 1 and not cache.is_recording_past(self.layer_idx):
                return causal_conv1d_update(hidden_states, conv_state, self.weight)
            hidden_states = cache.update_conv_state(hidden_states, self.layer_idx, conv_kernel_size=self.size)
            return causal_conv1d_fn(hidden_states, self.weight)[:, :, -seq_len:]


    class Lfm2DecoderLayer(nn.Module):
        def __init__(self, config, layer_idx):
            self.conv = Lfm2ShortConv(config, layer_idx)

        def forward(self, hidden_states, cache=None):
            return self.conv(hidden_states, cache=cache)
    """)

AFTER = dedent("""\
    from runtime.layers.request_states import RequestStates, per_request

    class Lfm2ShortConv(nn.Module):
        @per_request(states="states")
        def forward(self, hidden_states: torch.Tensor, states: RequestStates | None = None, **kwargs):
            seq_len = hidden_states.shape[1]
            conv_state = states.get_conv_state(self.layer_idx)
            if conv_state is not None and seq_len == 1 and not states.is_recording_past(self.layer_idx):
                return causal_conv1d_update(hidden_states, conv_state, self.weight)
            hidden_states = states.update_conv_state(hidden_states, self.layer_idx, conv_kernel_size=self.size)
            return causal_conv1d_fn(hidden_states, self.weight)[:, :, -seq_len:]


    class Lfm2DecoderLayer(nn.Module):
        def __init__(self, config, layer_idx):
            self.conv = Lfm2ShortConv(config, layer_idx)

        def forward(self, hidden_states, cache=None, **kwargs):
            return self.conv(hidden_states, cache=cache, **kwargs)
    """)


def test_a_conv_state_layer_runs_per_request_and_its_caller_passes_forward_metadata(make_ctx):
    """Its tests of the states against None fold: the decorator always gives them."""
    assert_codemod(rule, BEFORE, AFTER, make_ctx)


def test_a_layer_cast_as_it_is_built_is_called_with_forward_metadata_too(make_ctx):
    """Inkling keeps its short convolutions in float32: `Conv(...).to(dtype=torch.float32)`."""
    cast = ".to(dtype=torch.float32)\n"
    built = "self.conv = Lfm2ShortConv(config, layer_idx)\n"
    assert_codemod(
        rule, BEFORE.replace(built, built[:-1] + cast), AFTER.replace(built, built[:-1] + cast), make_ctx
    )


def test_recurrent_state_under_past_key_values_too(make_ctx):
    before = dedent("""\
        class MambaMixer(nn.Module):
            def forward(self, hidden_states, past_key_values=None):
                ssm = past_key_values.get_recurrent_state(self.layer_idx)
                return past_key_values.update_recurrent_state(ssm * hidden_states, self.layer_idx)
        """)
    after = dedent("""\
        from runtime.layers.request_states import RequestStates, per_request

        class MambaMixer(nn.Module):
            @per_request(states="states")
            def forward(self, hidden_states, states: RequestStates | None = None):
                ssm = states.get_recurrent_state(self.layer_idx)
                return states.update_recurrent_state(ssm * hidden_states, self.layer_idx)
        """)
    assert_codemod(rule, before, after, make_ctx)


@pytest.mark.parametrize(
    "line",
    [
        "keys, values = cache.update(hidden_states, hidden_states, self.layer_idx)",  # ZAYA's CCA: keys too
        "hidden_states = self.inner(hidden_states, cache=cache)",  # the cache handed on
        "cache.layers[self.layer_idx].store_windows(hidden_states)",  # another state of its own
    ],
)
def test_a_cache_used_otherwise_too_is_left_to_mg004(make_ctx, line):
    code = dedent(f"""\
        class Mixer(nn.Module):
            def forward(self, hidden_states, cache=None):
                cache.update_conv_state(hidden_states, self.layer_idx)
                {line}
                return hidden_states
        """)
    assert_noop(rule, code, make_ctx)


def test_a_cache_of_keys_and_values_only_is_untouched(make_ctx):
    code = dedent("""\
        class Attention(nn.Module):
            def forward(self, hidden_states, cache=None):
                if cache is not None:
                    k, v = cache.update(hidden_states, hidden_states, self.layer_idx)
                return hidden_states
        """)
    assert_noop(rule, code, make_ctx)


def test_a_helper_method_keeping_state_is_left_to_mg004(make_ctx):
    # Qwen4-Exp's short convolution is a method its forward calls, which the step's metadata would not reach.
    code = dedent("""\
        class GatedDeltaNet(nn.Module):
            def _short_conv(self, hidden_states, cache):
                return cache.update_conv_state(hidden_states, self.layer_idx)
        """)
    assert_noop(rule, code, make_ctx)
