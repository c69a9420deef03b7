"""fused_rms_norm: a forward that is Llama's RMS norm written out returns the runtime's rms_norm of its input."""

from textwrap import dedent

import pytest
from codemod_harness import assert_codemod, assert_noop

from skills.migrator.rules.fused_rms_norm import FusedRMSNorm as rule

# transformers' LlamaRMSNorm (the form 142 of its norm classes copy)
BEFORE = dedent('''\
    import torch
    from torch import nn


    class LlamaRMSNorm(nn.Module):
        def __init__(self, hidden_size, eps: float = 1e-6) -> None:
            """
            LlamaRMSNorm is equivalent to T5LayerNorm
            """
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden_size))
            self.variance_epsilon = eps

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * hidden_states.to(input_dtype)
    ''')

FORWARD = BEFORE[BEFORE.index("        input_dtype") :]
AFTER = BEFORE.replace(
    "from torch import nn\n", "from torch import nn\nfrom runtime.layers.norm import rms_norm\n"
).replace(FORWARD, "        return rms_norm(hidden_states, self.weight, self.variance_epsilon)\n")


def test_llamas_rms_norm_becomes_one_call(make_ctx):
    assert_codemod(rule, BEFORE, AFTER, make_ctx)


def test_the_weight_times_the_float_rows_rounded_once(make_ctx):
    """GPT-OSS / OLMo-style: `(self.weight * x).to(input_dtype)`; other local names, a docstring kept."""
    forward = AFTER[AFTER.index("    def forward") :]
    before = forward.replace(
        "hidden_states: torch.Tensor) -> torch.Tensor:\n        return rms_norm(hidden_states, self.weight, self.variance_epsilon)",
        """x):
        \"\"\"Norm.\"\"\"
        dt = x.dtype
        x = x.to(torch.float32)
        var = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(var + self.variance_epsilon)
        return (self.weight * x).to(dt)""",
    )
    after = forward.replace(
        "hidden_states: torch.Tensor) -> torch.Tensor:\n        return rms_norm(hidden_states, self.weight, self.variance_epsilon)",
        """x):
        \"\"\"Norm.\"\"\"
        return rms_norm(x, self.weight, self.variance_epsilon, weight_in_float=True)""",
    )
    head = AFTER[: AFTER.index("    def forward")]
    assert_codemod(
        rule, head.replace("from runtime.layers.norm import rms_norm\n", "") + before, head + after, make_ctx
    )


def test_layout_and_comments_do_not_matter(make_ctx):
    before = BEFORE.replace(
        "variance = hidden_states.pow(2).mean(-1, keepdim=True)",
        "variance = hidden_states.pow(2).mean(  # over the hidden size\n            -1, keepdim=True\n        )",
    )
    assert_codemod(rule, before, AFTER, make_ctx)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        # Gemma's offset weight
        (
            "return self.weight * hidden_states.to(input_dtype)",
            "return (1.0 + self.weight) * hidden_states.to(input_dtype)",
        ),
        # the mean over another axis, an epsilon not from self, a float16 upcast, a statement more
        ("mean(-1, keepdim=True)", "mean(1, keepdim=True)"),
        ("variance + self.variance_epsilon", "variance + 1e-6"),
        ("hidden_states.to(torch.float32)", "hidden_states.to(torch.float16)"),
        ("return self.weight", "hidden_states = hidden_states.clamp(-1, 1)\n        return self.weight"),
        # T5's: the variance from the input, the weight's dtype chosen at run time
        ("        input_dtype = hidden_states.dtype\n", ""),
        # the variance held in the input's name: the form's statements, with another meaning
        (
            (
                "variance = hidden_states.pow(2).mean(-1, keepdim=True)\n"
                "        hidden_states = hidden_states * torch.rsqrt(variance"
            ),
            (
                "hidden_states = hidden_states.pow(2).mean(-1, keepdim=True)\n"
                "        hidden_states = hidden_states * torch.rsqrt(hidden_states"
            ),
        ),
        # more inputs than the rows
        (
            "def forward(self, hidden_states: torch.Tensor)",
            "def forward(self, hidden_states: torch.Tensor, gate=None)",
        ),
    ],
    ids=[
        "gemma-offset",
        "other-axis",
        "literal-eps",
        "float16",
        "extra-statement",
        "t5",
        "aliased",
        "extra-input",
    ],
)
def test_anything_else_is_left_as_it_is(make_ctx, old, new):
    assert old in BEFORE
    assert_noop(rule, BEFORE.replace(old, new), make_ctx)


def test_a_file_without_norms_is_unchanged(make_ctx):
    assert_noop(rule, "import torch\n\n\ndef f(x):\n    return x\n", make_ctx)
