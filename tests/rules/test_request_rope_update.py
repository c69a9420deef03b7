"""request_rope_update: transformers' `@dynamic_rope_update` becomes the runtime's, and the rotary module's callers
pass forward_metadata on (by name where they take it, their **kwargs otherwise)."""

from textwrap import dedent

from codemod_harness import assert_codemod, assert_noop

from skills.migrator.rules.request_rope_update import RequestRopeUpdate as rule

BEFORE = dedent("""\
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update


    class PhiRotaryEmbedding(nn.Module):
        @dynamic_rope_update
        def forward(self, x, position_ids):
            return x, x


    class PhiModel(nn.Module):
        def __init__(self, config):
            self.rotary_emb = PhiRotaryEmbedding(config=config)

        def forward(self, input_ids, position_ids):
            return self.rotary_emb(input_ids, position_ids=position_ids)


    class PhiAttention(nn.Module):
        def __init__(self, config):
            self.rotary = PhiRotaryEmbedding(config)

        def forward(self, hidden_states, *, forward_metadata, **kwargs):
            cos, sin = self.rotary(hidden_states, kwargs["position_ids"])
            return cos
    """)

AFTER = dedent("""\
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from runtime.layers.rotary import dynamic_rope_update


    class PhiRotaryEmbedding(nn.Module):
        @dynamic_rope_update
        def forward(self, x, position_ids):
            return x, x


    class PhiModel(nn.Module):
        def __init__(self, config):
            self.rotary_emb = PhiRotaryEmbedding(config=config)

        def forward(self, input_ids, position_ids, **kwargs):
            return self.rotary_emb(input_ids, position_ids=position_ids, **kwargs)


    class PhiAttention(nn.Module):
        def __init__(self, config):
            self.rotary = PhiRotaryEmbedding(config)

        def forward(self, hidden_states, *, forward_metadata, **kwargs):
            cos, sin = self.rotary(hidden_states, kwargs["position_ids"], forward_metadata=forward_metadata)
            return cos
    """)


def test_the_decorator_is_the_runtime_s_and_callers_pass_forward_metadata(make_ctx):
    assert_codemod(rule, BEFORE, AFTER, make_ctx)


def test_an_import_of_the_decorator_alone_goes_whole(make_ctx):
    before = BEFORE.replace("ROPE_INIT_FUNCTIONS, dynamic_rope_update", "dynamic_rope_update")
    after = AFTER.replace("from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS\n", "")
    assert_codemod(rule, before, after, make_ctx)


def test_a_rotary_without_the_decorator_is_untouched(make_ctx):
    """MG018 drops it where the checkpoint pins a RoPE type it does nothing for."""
    assert_noop(rule, BEFORE.replace("    @dynamic_rope_update\n", ""), make_ctx)


def test_a_caller_s_own_double_star_parameter_carries_it(make_ctx):
    before = BEFORE.replace(
        "def forward(self, input_ids, position_ids):", "def forward(self, input_ids, position_ids, **extra):"
    )
    after = AFTER.replace(
        "def forward(self, input_ids, position_ids, **kwargs):",
        "def forward(self, input_ids, position_ids, **extra):",
    ).replace("position_ids=position_ids, **kwargs)", "position_ids=position_ids, **extra)")
    assert before != BEFORE and after != AFTER
    assert_codemod(rule, before, after, make_ctx)
