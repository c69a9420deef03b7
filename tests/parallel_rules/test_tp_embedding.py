"""embedding: the vocab nn.Embedding -> VocabParallelEmbedding (padding_idx dropped); others untouched."""

from textwrap import dedent

from skills.parallel_impl.rules.embedding import ShardEmbedding as rule

BEFORE = dedent("""\
    class LlamaModel(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.padding_idx = config.pad_token_id
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
    """)

AFTER = dedent("""\
    from runtime.layers.embedding import VocabParallelEmbedding
    from runtime.layers.prefix import join_prefix

    class LlamaModel(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.padding_idx = config.pad_token_id
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, comm_manager=comm_manager, tp_group="embed_tp_group", prefix=join_prefix(prefix, "embed_tokens"))
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
    """)


def test_vocab_embedding_sharded(run_rule, make_ctx):
    ctx = make_ctx()
    assert run_rule(rule, BEFORE, ctx) == AFTER
    assert ctx.rewrites == ["LlamaModel: embed_tokens -> VocabParallelEmbedding (embed_tp_group)"]


def test_idempotent(run_rule, make_ctx):
    ctx = make_ctx()
    assert run_rule(rule, AFTER, ctx) == AFTER
    assert ctx.rewrites == []


def test_other_embeddings_untouched(run_rule, make_ctx):
    cases = [
        BEFORE.replace(', comm_manager=None, prefix=""', ""),  # no migrated plumbing: stays replicated
        BEFORE.replace("self.padding_idx)", "max_norm=1.0)"),  # max_norm changes inference
        BEFORE.replace("config.vocab_size", "config.type_vocab"),
    ]
    for code in cases:
        ctx = make_ctx()
        assert run_rule(rule, code, ctx) == code
        assert ctx.rewrites == ctx.findings == []
