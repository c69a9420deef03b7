"""cache_query_positions: query positions counted from the offset the cache reports (`torch.arange(n) +
cache.get_query_offset(...)`) become the runtime's `forward_metadata.positions`, before MG004 folds the cache
and its offset to 0."""

from textwrap import dedent

import pytest
from codemod_harness import assert_codemod, assert_noop

from skills.migrator.rules.cache_query_positions import CacheQueryPositions as rule

BEFORE = dedent("""\
    class InklingAttention(nn.Module):
        def forward(self, hidden_states, cache=None, **kwargs):
            q_length = query_states.shape[2]
            if cache is not None:
                q_offset = cache.get_query_offset(self.layer_idx)
                key_states, value_states = cache.update(key_states, value_states, self.layer_idx)
            else:
                q_offset = 0
            q_positions = torch.arange(q_length, device=hidden_states.device) + q_offset
            tau = torch.log(q_positions + 1.0)
            return query_states * tau
""")
AFTER = "from runtime.engine.forward_metadata import ForwardMetaData\n\n" + BEFORE.replace(
    "torch.arange(q_length, device=hidden_states.device) + q_offset", "forward_metadata.positions"
).replace(
    "def forward(self, hidden_states, cache=None, **kwargs):",
    "def forward(self, hidden_states, cache=None, *, forward_metadata: ForwardMetaData, **kwargs):",
)


def test_positions_from_the_query_offset_become_the_runtimes(make_ctx):
    assert_codemod(rule, BEFORE, AFTER, make_ctx)


def test_the_offset_may_come_first(make_ctx):
    swapped = BEFORE.replace(
        "torch.arange(q_length, device=hidden_states.device) + q_offset",
        "q_offset + torch.arange(q_length, device=hidden_states.device)",
    )
    assert_codemod(rule, swapped, AFTER, make_ctx)


@pytest.mark.parametrize(
    "before, after",
    [
        ("q_offset = cache.get_query_offset(self.layer_idx)", "q_offset = self.offset"),  # not the cache's
        ("+ q_offset", "* q_offset"),  # not counted from it
        ("cache=None, **kwargs", "past=None, **kwargs"),  # not a cache parameter
    ],
    ids=["other-offset", "product", "no-cache"],
)
def test_other_positions_are_left_alone(make_ctx, before, after):
    assert before in BEFORE
    assert_noop(rule, BEFORE.replace(before, after), make_ctx)
