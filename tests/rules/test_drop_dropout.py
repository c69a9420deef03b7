"""drop_dropout: dropout modules, their calls and functional dropout disappear."""
from textwrap import dedent

from skills.migrator.rules import drop_dropout as rule

# Shapes from Qwen2 / Phi / BLT-style code: a Dropout module, torch.nn.Dropout, functional dropout.
BEFORE = dedent('''\
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
    ''')

AFTER = dedent('''\
    class PhiAttention(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.dropout = config.dropout

        def forward(self, hidden_states, attn_weights):
            attn_output = self.o_proj(hidden_states) + attn_weights
            return attn_output
    ''')


def test_dropout_removed(run_rule):
    # `self.dropout` is a float rate here, not a module: its assignment stays (dead_code removes it later).
    assert run_rule(rule, BEFORE) == AFTER


def test_idempotent(run_rule):
    assert run_rule(rule, AFTER) == AFTER


def test_no_dropout_untouched(run_rule):
    code = dedent('''\
        class LlamaMLP(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.attention_dropout = config.attention_dropout
                self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size)

            def forward(self, x):
                y = self.down_proj(x)
                return attention_interface(self, y, dropout=0.0 if not self.training else self.attention_dropout)
        ''')
    assert run_rule(rule, code) == code
