"""shared_inputs: forward parameters every call binds to the same name become one parameter, passed once; a
parameter bound otherwise at some call, rebound in forward, or a module called where the file does not show, stays."""

from textwrap import dedent

from codemod_harness import assert_codemod, assert_noop

from skills.migrator.rules.shared_inputs import SharedInputs as rule

# CTRL's attention and its one caller, migrated.
BEFORE = dedent("""\
    class MultiHeadAttention(nn.Module):
        def forward(self, v, k, q, *, forward_metadata, **kwargs):
            input_shape = q.shape[:-1]
            query_states = self.Wq(q).view(input_shape)
            key_states = self.Wk(k).view(input_shape)
            value_states = self.Wv(v).view(input_shape)
            return self.attn(query_states, key_states, value_states, forward_metadata, q=None)


    class EncoderLayer(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.multi_head_attention = MultiHeadAttention(config)

        def forward(self, x, **kwargs):
            normed = self.layernorm1(x)
            attn_output = self.multi_head_attention(
                normed,
                normed,
                normed,
                **kwargs,
            )
            return x + attn_output
    """)

AFTER = dedent("""\
    class MultiHeadAttention(nn.Module):
        def forward(self, hidden_states, *, forward_metadata, **kwargs):
            input_shape = hidden_states.shape[:-1]
            query_states = self.Wq(hidden_states).view(input_shape)
            key_states = self.Wk(hidden_states).view(input_shape)
            value_states = self.Wv(hidden_states).view(input_shape)
            return self.attn(query_states, key_states, value_states, forward_metadata, q=None)


    class EncoderLayer(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.multi_head_attention = MultiHeadAttention(config)

        def forward(self, x, **kwargs):
            normed = self.layernorm1(x)
            attn_output = self.multi_head_attention(
                normed,
                **kwargs,
            )
            return x + attn_output
    """)


def test_parameters_every_call_binds_to_one_name_are_one(make_ctx):
    assert_codemod(rule, BEFORE, AFTER, make_ctx)


def _call_with(code: str, *args: str) -> str:
    passed = "".join(f"            {a},\n" for a in args)
    return code.replace("            normed,\n            normed,\n            normed,\n", passed)


def test_a_keyword_binding_is_renamed_and_a_taken_name_kept(run_rule):
    out = run_rule(rule, _call_with(BEFORE, "q=normed", "k=normed", "v=normed"))
    assert "self.multi_head_attention(\n            hidden_states=normed,\n            **kwargs," in out
    out = run_rule(rule, _call_with(BEFORE, "normed", "k=normed", "q=normed"))
    assert "self.multi_head_attention(\n            normed,\n            **kwargs," in out
    taken = BEFORE.replace("input_shape = q.shape", "hidden_states = q\n        input_shape = q.shape")
    out = run_rule(rule, taken)
    assert "def forward(self, v, *, forward_metadata, **kwargs):" in out and "self.Wq(v)" in out


def test_parameters_bound_otherwise_rebound_or_called_unseen_stay(make_ctx):
    assert_noop(rule, _call_with(BEFORE, "normed", "x", "encoder_states"), make_ctx)
    rebound = BEFORE.replace(
        "input_shape = q.shape[:-1]", "k, q = k * 2, q * 2\n        input_shape = q.shape[:-1]"
    )
    assert_noop(rule, rebound, make_ctx)
    assert_noop(rule, BEFORE + "\n\nisinstance(x, MultiHeadAttention)\n", make_ctx)
