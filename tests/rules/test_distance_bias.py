"""distance_bias: a relative position bias passed to the attention interface as `position_bias=`, computed by a
module that reads the query and key positions only as their difference (Inkling's), becomes `distance_bias=`,
the module evaluated at `distance_positions(forward_metadata)`; MG005 hands it to the runtime Attention."""

from textwrap import dedent

import pytest
from codemod_harness import assert_codemod, assert_noop, run_codemod

from skills.migrator.rules.distance_bias import DistanceBias as rule
from skills.migrator.rules.runtime_attention import RuntimeAttention

# Inkling's attention and its bias module, shortened.
BEFORE = dedent("""\
    class RelativeLogits(nn.Module):
        def __init__(self, d_rel, rel_extent):
            super().__init__()
            self.rel_extent = rel_extent
            self.proj = nn.Parameter(torch.empty(d_rel, rel_extent))

        def forward(self, relative_states, query_positions, key_positions):
            rel_logits = (relative_states @ self.proj).transpose(1, 2)
            distance = (query_positions[:, None] - key_positions[None, :])[None, None, :, :]
            index = distance.clamp(0, self.rel_extent - 1).expand(*rel_logits.shape[:2], -1, -1)
            return rel_logits.gather(-1, index).masked_fill(distance >= self.rel_extent, 0.0)


    class InklingAttention(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.rel_logits_proj = RelativeLogits(config.d_rel, config.rel_extent)

        def forward(self, hidden_states, attention_mask, **kwargs):
            relative_states = self.r_proj(hidden_states).view(*input_shape, self.num_heads, -1)
            position_bias = self.rel_logits_proj(relative_states, q_positions, kv_positions)
            position_bias = position_bias * tau
            attn_output, attn_weights = attention_interface(
                self,
                query_states,
                key_states,
                value_states,
                attention_mask,
                scaling=self.scaling,
                position_bias=position_bias,
                **kwargs,
            )
            return self.o_proj(attn_output), attn_weights
""")

AFTER = (
    BEFORE.replace(
        "self.rel_logits_proj(relative_states, q_positions, kv_positions)",
        "self.rel_logits_proj(relative_states, *distance_positions(forward_metadata))",
    )
    .replace("position_bias=position_bias,", "distance_bias=position_bias,")
    .replace(
        "def forward(self, hidden_states, attention_mask, **kwargs):",
        "def forward(self, hidden_states, attention_mask, *, forward_metadata: ForwardMetaData, **kwargs):",
    )
)
IMPORTS = (
    "from runtime.engine.forward_metadata import ForwardMetaData\n"
    "from runtime.layers.attention import distance_positions\n\n"
)


def test_a_bias_by_query_minus_key_becomes_distance_bias(make_ctx):
    assert_codemod(rule, BEFORE, IMPORTS + AFTER, make_ctx)


def test_the_runtime_attention_takes_the_table_on_every_call(make_ctx):
    """MG005 after MG038: `distance_bias=` on the runtime Attention's call, nothing refused."""
    ctx = make_ctx(entry_class="InklingAttention")
    out = run_codemod(RuntimeAttention, run_codemod(rule, BEFORE, ctx), ctx)
    assert ctx.findings == []
    assert (
        "self.attn(query_states, key_states, value_states, forward_metadata, distance_bias=position_bias)"
        in out
    )


@pytest.mark.parametrize(
    "before, after",
    [
        (
            "query_positions[:, None] - key_positions",
            "query_positions[:, None] + key_positions",
        ),  # not a distance
        ("index = distance", "index = query_positions[:, None] + distance"),  # an absolute position read too
        (  # a bias computed some other way
            "self.rel_logits_proj(relative_states, q_positions, kv_positions)",
            "bias_of(relative_states, q_positions, kv_positions)",
        ),
        ("self.rel_logits_proj = RelativeLogits(", "self.rel_logits_proj = OtherLogits("),  # not in this file
        ("position_bias=position_bias,", "position_bias=None,"),
    ],
    ids=["sum", "absolute", "not-a-module", "unknown-class", "no-bias"],
)
def test_other_position_biases_are_left_to_mg005(make_ctx, before, after):
    assert before in BEFORE
    assert_noop(rule, BEFORE.replace(before, after), make_ctx)


# Inkling2: the model computes the distances once, the bias module gathers its table at them.
GATHERED = dedent("""\
    def get_relative_distance(inputs_embeds, cache, is_sliding):
        q_positions = torch.arange(inputs_embeds.shape[1]) + cache.get_query_offset(0)
        kv_positions = torch.arange(kv_length) + kv_offset
        return q_positions[:, None] - kv_positions[None, :]


    class RelativePositionBias(nn.Module):
        def __init__(self, config, rel_extent):
            super().__init__()
            self.rel_extent = rel_extent

        def forward(self, hidden_states, relative_distance, position_ids):
            rel_logits = (self.linear(hidden_states) @ self.proj).transpose(1, 2)
            index = relative_distance.clamp(0, self.rel_extent - 1).expand(*rel_logits.shape[:2], -1, -1)
            bias = rel_logits.gather(-1, index)
            return bias.masked_fill((relative_distance < 0) | (relative_distance >= self.rel_extent), 0.0)


    class Attention(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.relative_position_bias = RelativePositionBias(config, config.rel_extent)

        def forward(self, hidden_states, attention_mask, relative_distance, **kwargs):
            position_bias = self.relative_position_bias(hidden_states, relative_distance, kwargs["position_ids"])
            attn_output, attn_weights = attention_interface(self, q, k, v, attention_mask, position_bias=position_bias)
            return attn_output, attn_weights


    class TextModel(nn.Module):
        def forward(self, inputs_embeds, cache, **kwargs):
            distances = get_relative_distance(inputs_embeds, cache, is_sliding=False)
            for layer in self.layers:
                hidden_states = layer(hidden_states, relative_distance=distances, **kwargs)
            return hidden_states
""")


def test_distances_the_model_computes_as_query_minus_key_become_the_runtime_s(make_ctx):
    """The bias module reads its distances only to gather by them: the model's distances become the runtime's
    `distance_columns` (column d distance d), the bias `distance_bias=`; callers of the layers pass
    forward_metadata on by name."""
    after = (
        GATHERED.replace(
            "get_relative_distance(inputs_embeds, cache, is_sliding=False)",
            "distance_columns(forward_metadata)",
        )
        .replace("position_bias=position_bias)", "distance_bias=position_bias)")
        .replace(
            "def forward(self, hidden_states, attention_mask, relative_distance, **kwargs):",
            "def forward(self, hidden_states, attention_mask, relative_distance, *, forward_metadata: ForwardMetaData, **kwargs):",
        )
        .replace(
            "def forward(self, inputs_embeds, cache, **kwargs):",
            "def forward(self, inputs_embeds, cache, *, forward_metadata: ForwardMetaData, **kwargs):",
        )
        .replace(
            "layer(hidden_states, relative_distance=distances, **kwargs)",
            "layer(hidden_states, relative_distance=distances, forward_metadata=forward_metadata, **kwargs)",
        )
    )
    imports = (
        "from runtime.engine.forward_metadata import ForwardMetaData\n"
        "from runtime.layers.attention import distance_columns\n\n"
    )
    assert_codemod(rule, GATHERED, imports + after, make_ctx)


@pytest.mark.parametrize(
    "before, after",
    [
        ("return q_positions[:, None] - kv_positions[None, :]", "return q_positions[:, None] + kv_positions"),
        ("relative_distance < 0", "relative_distance.abs() < 0"),  # read otherwise than to gather by it
    ],
    ids=["no-distances-computed", "read-otherwise"],
)
def test_gathered_biases_without_distances_by_query_minus_key_are_left_to_mg005(make_ctx, before, after):
    assert before in GATHERED
    assert_noop(rule, GATHERED.replace(before, after), make_ctx)


def test_a_bias_by_query_minus_key_leaves_the_file_s_other_distances_alone(make_ctx):
    """Only a module gathering by the model's distances makes MG038 give their calls the runtime's."""
    other = "\n\ndef distances(q, k):\n    return q[:, None] - k[None, :]\n\n\ndef f(a, b):\n    return distances(a, b)\n"
    assert run_codemod(rule, BEFORE + other, make_ctx()) == IMPORTS + AFTER + other
