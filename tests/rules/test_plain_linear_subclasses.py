"""plain_linear_subclasses: an nn.Linear subclass whose forward only recomputes the linear map is nn.Linear."""

from functools import partial
from textwrap import dedent

import pytest
from codemod_harness import assert_codemod, assert_noop

from skills.migrator.rules.plain_linear_subclasses import PlainLinearSubclasses as rule

# Falcon's FalconLinear and its attention, shortened.
BEFORE = dedent("""\
    from torch import nn


    class FalconLinear(nn.Linear):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            hidden_states = input @ self.weight.T
            if self.bias is None:
                return hidden_states
            return hidden_states + self.bias


    class FalconAttention(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.query_key_value = FalconLinear(config.hidden_size, 3 * config.hidden_size, bias=config.bias)
            self.dense = FalconLinear(config.hidden_size, config.hidden_size, bias=config.bias)
    """)

AFTER = dedent("""\
    from torch import nn


    class FalconAttention(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.bias)
            self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.bias)
    """)


@pytest.fixture
def falcon_ctx(make_ctx):
    return partial(make_ctx, entry_class="FalconAttention")


def test_a_linear_recomputed_by_hand_becomes_nn_linear(falcon_ctx):
    assert_codemod(rule, BEFORE, AFTER, falcon_ctx)


def test_a_name_used_only_by_code_the_entry_no_longer_reaches_does_not_count(falcon_ctx):
    # FalconPreTrainedModel's weight initialiser tests isinstance(module, FalconLinear); no class derives it now
    unreached = "\n\nclass FalconPreTrainedModel(nn.Module):\n    def _init_weights(self, module):\n        return isinstance(module, FalconLinear)\n"
    assert_codemod(rule, BEFORE + unreached, AFTER + unreached, falcon_ctx)


def test_the_product_returned_directly_and_a_docstring_are_the_same_map(falcon_ctx):
    code = BEFORE.replace(
        """        hidden_states = input @ self.weight.T
        if self.bias is None:
            return hidden_states
        return hidden_states + self.bias
""",
        '''        """x W^T + b."""
        if self.bias is None:
            return input @ self.weight.t()
        return self.bias + input @ self.weight.t()
''',
    )
    assert code != BEFORE
    assert_codemod(rule, code, AFTER, falcon_ctx)


@pytest.mark.parametrize(
    "change",
    [
        ("input @ self.weight.T\n", "input @ self.weight.T * 2\n"),  # a scaled product
        ("return hidden_states + self.bias", "return hidden_states - self.bias"),
        ("        if self.bias is None:\n            return hidden_states\n", ""),  # bias always added
        (  # the name used otherwise by the code the entry reaches
            "        self.dense = FalconLinear(config.hidden_size, config.hidden_size, bias=config.bias)\n",
            (
                "        self.dense = FalconLinear(config.hidden_size, config.hidden_size, bias=config.bias)\n"
                "        assert isinstance(self.dense, FalconLinear)\n"
            ),
        ),
        (
            "        return hidden_states + self.bias\n",
            "        return hidden_states + self.bias\n\n    def extra_repr(self):\n        return 'falcon'\n",
        ),
    ],
)
def test_anything_else_stays(falcon_ctx, change):
    code = BEFORE.replace(*change)
    assert code != BEFORE
    assert_noop(rule, code, falcon_ctx)
