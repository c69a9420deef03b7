"""fused_act_and_mul: a gated MLP's self.<act>(gate) * up becomes the runtime's act_and_mul(self.<act>, gate, up)."""

from textwrap import dedent

import pytest
from codemod_harness import assert_codemod, assert_noop

from skills.migrator.rules.fused_act_and_mul import FusedActAndMul as rule

# transformers' LlamaMLP
BEFORE = dedent("""\
    from torch import nn
    from transformers.activations import ACT2FN


    class LlamaMLP(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
            self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
            self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
            self.act_fn = ACT2FN[config.hidden_act]

        def forward(self, x):
            down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
            return down_proj
    """)

AFTER = BEFORE.replace(
    "from transformers.activations import ACT2FN\n",
    "from transformers.activations import ACT2FN\nfrom runtime.layers.activation import act_and_mul\n",
).replace(
    "self.act_fn(self.gate_proj(x)) * self.up_proj(x)",
    "act_and_mul(self.act_fn, self.gate_proj(x), self.up_proj(x))",
)


def test_the_gated_product_becomes_one_call(make_ctx):
    assert_codemod(rule, BEFORE, AFTER, make_ctx)


def test_the_activation_on_the_right_and_split_outputs(make_ctx):
    """The fused gate_up projection's split outputs (what skill migrate writes at TP 1), up times act(gate)."""
    product = "self.act_fn(self.gate_proj(x)) * self.up_proj(x)"
    before = BEFORE.replace(product, "up * self.act_fn(gate)").replace(
        "        down_proj =", "        gate, up = self.gate_up(x).chunk(2, -1)\n        down_proj ="
    )
    after = AFTER.replace(
        "act_and_mul(self.act_fn, self.gate_proj(x), self.up_proj(x))", "act_and_mul(self.act_fn, gate, up)"
    ).replace("        down_proj =", "        gate, up = self.gate_up(x).chunk(2, -1)\n        down_proj =")
    assert_codemod(rule, before, after, make_ctx)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        # an activation module built another way, set again later, a product with something else
        ("ACT2FN[config.hidden_act]", "nn.GELU()"),
        ("        return down_proj", "        self.act_fn = nn.Identity()\n        return down_proj"),
        (
            "self.act_fn(self.gate_proj(x)) * self.up_proj(x)",
            "self.act_fn(self.gate_proj(x)) + self.up_proj(x)",
        ),
        ("self.act_fn(self.gate_proj(x)) * self.up_proj(x)", "self.gate_proj(x) * self.up_proj(x)"),
        # the activation given a keyword, or a second argument
        ("self.act_fn(self.gate_proj(x))", "self.act_fn(input=self.gate_proj(x))"),
        ("self.act_fn(self.gate_proj(x))", "self.act_fn(self.gate_proj(x), 2)"),
    ],
    ids=["not-act2fn", "set-again", "sum", "no-activation", "keyword", "two-arguments"],
)
def test_anything_else_is_left_as_it_is(make_ctx, old, new):
    assert old in BEFORE
    assert_noop(rule, BEFORE.replace(old, new), make_ctx)


def test_an_activation_of_another_class_does_not_count(make_ctx):
    """`self.act_fn` of a class without one: another class's attribute of the same name is not it."""
    other = BEFORE.replace("        self.act_fn = ACT2FN[config.hidden_act]\n", "") + dedent("""\


        class Other(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.act_fn = ACT2FN[config.hidden_act]
        """)
    assert_noop(rule, other, make_ctx)
