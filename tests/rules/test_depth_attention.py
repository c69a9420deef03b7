"""depth_attention: attention over each token's own stack of states (Inkling2's block attention residual) through
the attention interface becomes the runtime's `stack_attention`, before MG005 could build a sequence attention
and a KV cache for it."""

from textwrap import dedent

import pytest
from codemod_harness import assert_codemod, assert_noop

from skills.migrator.rules.depth_attention import DepthAttention as rule

BEFORE = dedent("""\
    class BlockAttentionResidual(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.query = nn.Parameter(torch.zeros(config.hidden_size))
            self.num_key_value_groups = 1
            self.is_causal = False

        def forward(self, block_states, partial_block_states):
            stacked_states = torch.cat([block_states, partial_block_states.unsqueeze(-2)], dim=-2)
            hidden_size = stacked_states.shape[-1]
            query_states = self.query.view(-1, hidden_size).expand(*stacked_states.shape[:-2], -1, -1)
            attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention_forward
            )
            attn_output, _ = attention_interface(
                self, query_states, stacked_states, stacked_states, None, scaling=hidden_size**-0.5
            )
            return attn_output.transpose(1, 2).unbind(-2)
""")
AFTER = "from runtime.layers.attention import stack_attention\n\n" + BEFORE.replace(
    """        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, _ = attention_interface(
            self, query_states, stacked_states, stacked_states, None, scaling=hidden_size**-0.5
        )
""",
    "        attn_output = stack_attention(query_states, stacked_states, stacked_states, hidden_size**-0.5)"
    ".transpose(1, 2)\n",
)


def test_attention_over_a_stack_of_states_becomes_stack_attention(make_ctx):
    assert_codemod(rule, BEFORE, AFTER, make_ctx)


@pytest.mark.parametrize(
    "before, after",
    [
        ("self.is_causal = False", "self.is_causal = True"),  # a sequence's attention
        ("stacked_states, None, scaling", "stacked_states, attention_mask, scaling"),  # masked
        ("scaling=hidden_size**-0.5", "scaling=hidden_size**-0.5, dropout=0.1"),  # more than a scale
        ("def forward(self, block_states, partial_block_states):", "def forward(self, block_states, cache):"),
    ],
    ids=["causal", "masked", "dropout", "cached"],
)
def test_other_attention_is_left_to_mg005(make_ctx, before, after):
    assert before in BEFORE
    assert_noop(rule, BEFORE.replace(before, after), make_ctx)
