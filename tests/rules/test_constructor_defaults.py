"""constructor_defaults: a constructor parameter no call in the file passes is its literal default; its reads and
an attribute set to it fold, with the branches they decide. What the file cannot prove stays."""

from textwrap import dedent

from codemod_harness import assert_codemod, assert_noop

from skills.migrator.rules.constructor_defaults import ConstructorDefaults as rule

# GPT-2 once MG024 dropped the cross-attention block, the only call that passed is_cross_attention=True.
BEFORE = dedent("""\
    class GPT2Attention(nn.Module):
        def __init__(self, config, is_cross_attention=False, layer_idx=None, infer_config=None, prefix=""):
            super().__init__()
            self.is_cross_attention = is_cross_attention
            self.layer_idx = layer_idx
            if self.is_cross_attention:
                self.c_attn = Conv1D(2 * config.hidden_size, config.hidden_size)
                self.q_attn = Conv1D(config.hidden_size, config.hidden_size)
            else:
                self.c_attn = Conv1D(3 * config.hidden_size, config.hidden_size)
            self.inner = Inner(flag=is_cross_attention)

        def forward(self, hidden_states):
            if not self.is_cross_attention:
                hidden_states = hidden_states * 2
            return self.c_attn(hidden_states)


    class GPT2Block(nn.Module):
        def __init__(self, config, layer_idx, infer_config=None, prefix=""):
            super().__init__()
            self.attn = GPT2Attention(config=config, layer_idx=layer_idx, infer_config=infer_config)
    """)

AFTER = dedent("""\
    class GPT2Attention(nn.Module):
        def __init__(self, config, layer_idx=None, infer_config=None, prefix=""):
            super().__init__()
            self.is_cross_attention = False
            self.layer_idx = layer_idx
            self.c_attn = Conv1D(3 * config.hidden_size, config.hidden_size)
            self.inner = Inner(flag=False)

        def forward(self, hidden_states):
            hidden_states = hidden_states * 2
            return self.c_attn(hidden_states)


    class GPT2Block(nn.Module):
        def __init__(self, config, layer_idx, infer_config=None, prefix=""):
            super().__init__()
            self.attn = GPT2Attention(config=config, layer_idx=layer_idx, infer_config=infer_config)
    """)


def test_a_default_no_call_overrides_folds(make_ctx):
    # layer_idx has a literal default too, but the block passes it; `Inner(flag=...)` keeps its argument
    assert_codemod(rule, BEFORE, AFTER, make_ctx)


def test_what_the_file_cannot_prove_untouched(make_ctx):
    cases = [
        BEFORE.replace("layer_idx=layer_idx, infer", "is_cross_attention=True, layer_idx=layer_idx, infer"),
        BEFORE.replace("layer_idx=layer_idx, infer", "*args, layer_idx=layer_idx, infer"),  # a splat
        BEFORE + "\n\nEntryClass = GPT2Attention\n",  # built where the file does not show
        BEFORE.replace(
            "class GPT2Block(nn.Module):", "class GPT2Block(GPT2Attention):"
        ),  # a family shares self
        BEFORE.replace(
            "is_cross_attention=False, layer_idx", "is_cross_attention=FLAG, layer_idx"
        ),  # not literal
    ]
    for code in cases:
        assert code != BEFORE
        assert_noop(rule, code, make_ctx)


def test_a_default_only_passed_on_stays(make_ctx):
    code = dedent("""\
        class RotaryEmbedding(nn.Module):
            def __init__(self, config, device=None):
                super().__init__()
                self.inv_freq = rope_init_fn(config, device)


        class Model(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.rotary_emb = RotaryEmbedding(config)
        """)
    assert_noop(rule, code, make_ctx)


def test_an_attribute_changed_later_keeps_its_reads(run_rule):
    code = BEFORE.replace(
        "        return self.c_attn(hidden_states)",
        "        self.is_cross_attention |= True\n        return self.c_attn(hidden_states)",
    )
    out = run_rule(rule, code)
    assert "def __init__(self, config, layer_idx=None," in out  # the parameter still folds where it is read
    assert "self.is_cross_attention = False" in out and "if not self.is_cross_attention:" in out
    assert "if self.is_cross_attention:" in out  # __init__'s branch reads the attribute, which is not known
