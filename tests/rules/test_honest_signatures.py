"""honest_signatures: a `= None` parameter that every known call passes and the body never tests becomes
required; parameters that are tested, sometimes omitted, or after a kept default stay optional."""

from textwrap import dedent

from codemod_harness import assert_codemod, assert_noop

from skills.migrator.rules.honest_signatures import HonestSignatures as rule

BEFORE = dedent("""\
    class LlamaAttention(nn.Module):
        def forward(self, hidden_states, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                    scale: Optional[float] = None, forward_metadata=None, **kwargs):
            cos, sin = position_embeddings
            return hidden_states * cos * scale


    class LlamaDecoderLayer(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.self_attn = LlamaAttention()

        def forward(self, hidden_states, position_embeddings=None, **kwargs):
            return self.self_attn(hidden_states, position_embeddings=position_embeddings, scale=2.0, **kwargs)
    """)

AFTER = dedent("""\
    class LlamaAttention(nn.Module):
        def forward(self, hidden_states, position_embeddings: tuple[torch.Tensor, torch.Tensor], *,
                    scale: float, forward_metadata=None, **kwargs):
            cos, sin = position_embeddings
            return hidden_states * cos * scale


    class LlamaDecoderLayer(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.self_attn = LlamaAttention()

        def forward(self, hidden_states, position_embeddings=None, **kwargs):
            return self.self_attn(hidden_states, position_embeddings=position_embeddings, scale=2.0, **kwargs)
    """)


def test_always_passed_never_tested_becomes_required(make_ctx):
    # The decoder layer's own forward has no known caller here, and forward_metadata is the contract's.
    assert_codemod(rule, BEFORE, AFTER, make_ctx)


def test_tested_omitted_or_ordered_parameters_untouched(make_ctx):
    code = dedent("""\
        class Mlp(nn.Module):
            def __init__(self, config, hidden=None, bias=None, act=None):
                super().__init__()
                self.hidden = hidden if hidden is not None else config.hidden_size  # tested
                self.act = act  # `bias` stays optional (one call omits it), so `act` after it must too


        class Block(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.a = Mlp(config, 8, True, "gelu")
                self.b = Mlp(config, 8, act="relu")
        """)
    assert_noop(rule, code, make_ctx)
