"""drop_dropout: dropout modules, their calls and functional dropout disappear, found by qualified name."""

from textwrap import dedent

from codemod_harness import assert_codemod, assert_noop

from skills.migrator.rules.drop_dropout import DropDropout as rule

IMPORTS = dedent("""\
    import torch
    import torch.nn.functional as F
    from torch import nn


    """)

# Shapes from Qwen2 / Phi / BLT-style code: a Dropout module, torch.nn.Dropout, functional dropout.
BEFORE = IMPORTS + dedent("""\
    class PhiAttention(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.dropout = config.dropout
            self.attn_drop = nn.Dropout(config.attention_dropout)
            self.resid_dropout = torch.nn.Dropout(p=0.1)

        def forward(self, hidden_states, attn_weights):
            hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
            attn_weights = self.attn_drop(attn_weights)
            attn_output = self.o_proj(self.resid_dropout(hidden_states)) + attn_weights
            return F.dropout(attn_output, p=0.1, training=self.training)
    """)

# `self.dropout` is a float rate here, not a module: its assignment stays (dead_code removes it later).
AFTER = IMPORTS + dedent("""\
    class PhiAttention(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.dropout = config.dropout

        def forward(self, hidden_states, attn_weights):
            attn_output = self.o_proj(hidden_states) + attn_weights
            return attn_output
    """)


def test_dropout_removed_and_idempotent(make_ctx):
    assert_codemod(rule, BEFORE, AFTER, make_ctx)


def test_no_torch_dropout_untouched(make_ctx):
    code = IMPORTS + dedent("""\
        from mylib import layers


        class LlamaMLP(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.attention_dropout = config.attention_dropout
                self.noise = layers.Dropout(0.5)  # not torch's: its meaning is unknown, so it stays
                self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size)

            def forward(self, x):
                y = self.noise(self.down_proj(x))
                return attention_interface(self, y, dropout=0.0 if not self.training else self.attention_dropout)
        """)
    assert_noop(rule, code, make_ctx)
