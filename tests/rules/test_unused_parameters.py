"""unused_parameters: constructor and forward parameters nothing reads go with their arguments, and keywords
a forward would swallow into an unread **kwargs are dropped; whatever the file alone cannot prove stays."""

from textwrap import dedent

from codemod_harness import assert_codemod, assert_noop, run_codemod

from skills.migrator.rules.unused_parameters import UnusedParameters as rule

# Llama after the other rules: layer_idx only fed HF's cache index, position_ids only reached **kwargs.
BEFORE = dedent("""\
    class LlamaAttention(nn.Module):
        def __init__(self, config, layer_idx: int, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.o_proj = nn.Linear(config.hidden_size, config.hidden_size)

        def forward(self, hidden_states, position_embeddings=None, *, forward_metadata, **kwargs):
            return self.o_proj(hidden_states)


    class LlamaDecoderLayer(nn.Module):
        def __init__(self, config, layer_idx: int, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.self_attn = LlamaAttention(config=config, layer_idx=layer_idx, infer_config=infer_config)

        def forward(self, hidden_states, position_ids=None, position_embeddings=None, **kwargs):
            return self.self_attn(hidden_states, position_ids=position_ids, position_embeddings=position_embeddings,
                                  **kwargs)


    class LlamaModel(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.layers = nn.ModuleList([LlamaDecoderLayer(config, i, infer_config) for i in range(2)])

        def forward(self, hidden_states, position_ids, **kwargs):
            for layer in self.layers[:2]:
                hidden_states = layer(hidden_states, position_ids=position_ids, **kwargs)
            return hidden_states


    EntryClass = LlamaModel
    """)

AFTER = dedent("""\
    class LlamaAttention(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.o_proj = nn.Linear(config.hidden_size, config.hidden_size)

        def forward(self, hidden_states, *, forward_metadata, **kwargs):
            return self.o_proj(hidden_states)


    class LlamaDecoderLayer(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.self_attn = LlamaAttention(config=config, infer_config=infer_config)

        def forward(self, hidden_states, **kwargs):
            return self.self_attn(hidden_states, **kwargs)


    class LlamaModel(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.layers = nn.ModuleList([LlamaDecoderLayer(config, infer_config) for i in range(2)])

        def forward(self, hidden_states, position_ids, **kwargs):
            for layer in self.layers[:2]:
                hidden_states = layer(hidden_states, **kwargs)
            return hidden_states


    EntryClass = LlamaModel
    """)


def test_unread_parameters_and_swallowed_keywords_go(make_ctx):
    # The attention's position_embeddings is unread and every call is known: it goes, and then the decoder
    # layer's; the entry class (its name escapes into EntryClass) keeps the runtime's signature.
    assert_codemod(rule, BEFORE, AFTER, make_ctx)


def test_what_the_file_cannot_prove_untouched(make_ctx):
    code = dedent("""\
        class Block(nn.Module):
            def __init__(self, config, layer_idx, scale, infer_config=None, comm_manager=None, prefix=""):
                super().__init__()

            def forward(self, x, mask=None):
                return x


        class Other(nn.Module):
            def __init__(self, config, kind):
                super().__init__()
                self.block = Block(config, next(counter), *extra)  # a splat could bind anything
                self.blocks = [Block(config, 0, scale=make_scale())]  # not an nn.ModuleList: calls unknown

            def forward(self, x, infer_config, prefix, forward_metadata):  # contract names stay
                self.block.mask = None  # the instance escapes: its forward keeps `mask`
                return self.block(x, mask=1)


        isinstance(Other, type)  # the class escapes: its constructor keeps `kind`
        """)
    assert_noop(rule, code, make_ctx)


def test_a_parameter_one_of_two_classes_a_layer_chooses_between_reads_stays_in_both(make_ctx):
    """Inkling2 builds `LogScaledClip(...) if log_scaling else ScaledClip(...)` and calls it with the positions
    only the first reads: the other keeps the parameter, or the shared call would pass one too many."""
    code = dedent("""\
        class LogScaledClip(nn.Module):
            def forward(self, x, position_ids):
                return x * position_ids


        class ScaledClip(nn.Module):
            def forward(self, x, position_ids=None):
                return x


        class Projection(nn.Module):
            def __init__(self, config, log_scaling):
                super().__init__()
                self.norm = LogScaledClip() if log_scaling else ScaledClip().to(dtype=torch.float32)

            def forward(self, x, position_ids):
                return self.norm(x, position_ids)


        class Model(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.proj = Projection(config, True)

            def forward(self, x, position_ids):
                return self.proj(x, position_ids)
        """)
    assert_noop(rule, code, make_ctx)


SPLAT = dedent("""\
    class Attention(nn.Module):
        def forward(self, x, freqs_cis, mask, *, forward_metadata):
            return x * freqs_cis


    class Block(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.attention = Attention()

        def forward(self, x, freqs_cis, mask, **kwargs):
            return self.attention(x, freqs_cis, mask, **kwargs)
    """)


def test_a_parameter_every_call_binds_itself_goes_beside_a_keyword_splat(make_ctx):
    # Meta's reference attention takes no **kwargs; the call's `**kwargs` cannot bind `mask`, which it passes
    after = SPLAT.replace("freqs_cis, mask, *,", "freqs_cis, *,").replace(
        "self.attention(x, freqs_cis, mask, **kwargs)", "self.attention(x, freqs_cis, **kwargs)"
    )
    assert_codemod(
        rule, SPLAT, after.replace("freqs_cis, mask, **kwargs):", "freqs_cis, **kwargs):"), make_ctx
    )
    # a call that does not pass `mask` could pass it in the splat: it stays
    unbound = SPLAT.replace("mask, *,", "mask=None, *,").replace(
        "freqs_cis, mask, **kwargs)\n", "freqs_cis, **kwargs)\n"
    )
    assert "def forward(self, x, freqs_cis, mask=None, *, forward_metadata):" in run_codemod(
        rule, unbound, make_ctx()
    )
