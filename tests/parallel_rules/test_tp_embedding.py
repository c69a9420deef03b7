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


POSITIONS = BEFORE + (
    "\n"
    "    def forward(self, input_ids, position_ids, **kwargs):\n"
    "        hidden_states = self.embed_tokens(input_ids) + self.embed_positions(position_ids)\n"
    "        return self.layers(hidden_states, self.rotary_emb(hidden_states, position_ids), **kwargs)\n"
)


def test_a_position_table_looks_up_this_ranks_chunk_of_the_positions(run_rule, make_ctx):
    # GPT-2's wpe: under attention DP a rank holds its chunk of the tokens, as own_chunk gives the entry's ids;
    # rotary embeddings, read inside attention over the whole sequence, keep every position
    ctx = make_ctx()
    out = run_rule(rule, POSITIONS, ctx)
    assert "self.embed_tokens(input_ids) + self.embed_positions(own_chunk(position_ids))" in out
    assert "self.rotary_emb(hidden_states, position_ids)" in out
    assert "from runtime.layers.token_layout import own_chunk" in out
    assert ctx.rewrites[-1] == "LlamaModel: self.embed_positions looks up this rank's chunk of position_ids"
    again = make_ctx()
    assert run_rule(rule, out, again) == out and again.rewrites == []


def test_positions_computed_in_forward_are_left_as_they_are(run_rule, make_ctx):
    code = POSITIONS.replace(
        "        hidden_states = self.embed_tokens",
        "        position_ids = position_ids + 2\n        hidden_states = self.embed_tokens",
    )
    assert code != POSITIONS
    assert "self.embed_positions(position_ids)" in run_rule(rule, code, make_ctx())


def test_a_position_table_of_an_in_file_embedding_class_looked_up_by_keyword_too(run_rule, make_ctx):
    # OPT: `class OPTLearnedPositionalEmbedding(nn.Embedding)` adds an offset; called `position_ids=position_ids`
    code = (
        "class OPTLearnedPositionalEmbedding(nn.Embedding):\n"
        "    def forward(self, position_ids):\n"
        "        return super().forward(position_ids + 2)\n\n\n"
        + POSITIONS.replace(
            "nn.Embedding(config.max_position_embeddings",
            "OPTLearnedPositionalEmbedding(config.max_position_embeddings",
        ).replace("self.embed_positions(position_ids)", "self.embed_positions(position_ids=position_ids)")
    )
    assert "self.embed_positions(position_ids=own_chunk(position_ids))" in run_rule(rule, code, make_ctx())


def test_a_position_table_given_one_row_of_the_positions_after_other_arguments_looks_up_this_ranks_chunk(
    run_rule, make_ctx
):
    # TrOCR's learned table, as MG004 passes it the positions: `self.embed_positions(input, position_ids=...[0])`
    code = POSITIONS.replace(
        "self.embed_positions(position_ids)", "self.embed_positions(input_ids, position_ids=position_ids[0])"
    )
    out = run_rule(rule, code, make_ctx())
    assert "self.embed_positions(input_ids, position_ids=own_chunk(position_ids)[0])" in out
    assert run_rule(rule, out, make_ctx()) == out


SINUSOIDAL = (
    "class XGLMSinusoidalPositionalEmbedding(nn.Module):\n"
    "    def forward(self, position_ids, cache_length=0):\n"
    "        return self.weights.index_select(0, position_ids.view(-1) + 2)\n\n\n"
    + POSITIONS.replace(
        "nn.Embedding(config.max_position_embeddings, config.hidden_size)",
        "XGLMSinusoidalPositionalEmbedding(config.max_position_embeddings, config.hidden_size)",
    )
)


def test_an_in_file_position_module_whose_rows_join_the_embeddings_looks_up_this_ranks_chunk(
    run_rule, make_ctx
):
    # XGLM's sinusoidal table, called positionally with a second argument, directly or through a name
    code = SINUSOIDAL.replace(
        "self.embed_positions(position_ids)", "self.embed_positions(position_ids, 0).to(x)"
    )
    out = run_rule(rule, code, make_ctx())
    assert "self.embed_tokens(input_ids) + self.embed_positions(own_chunk(position_ids), 0).to(x)" in out
    assert "self.rotary_emb(hidden_states, position_ids)" in out
    bound = SINUSOIDAL.replace(
        "        hidden_states = self.embed_tokens(input_ids) + self.embed_positions(position_ids)\n",
        "        positions = self.embed_positions(position_ids)\n"
        "        hidden_states = positions + self.embed_tokens(input_ids)\n",
    )
    out = run_rule(rule, bound, make_ctx())
    assert "positions = self.embed_positions(own_chunk(position_ids))" in out
    again = make_ctx()
    assert run_rule(rule, out, again) == out and again.rewrites == []


def test_an_in_file_position_module_whose_output_is_not_added_keeps_every_position(run_rule, make_ctx):
    # CodeGen's rotary table, `self.embed_positions(position_ids)` -> (sin, cos), is read inside attention over
    # the whole sequence
    code = SINUSOIDAL.replace(
        "        hidden_states = self.embed_tokens(input_ids) + self.embed_positions(position_ids)\n",
        "        hidden_states = self.embed_tokens(input_ids)\n"
        "        sin_cos = self.embed_positions(position_ids)\n",
    )
    ctx = make_ctx()
    assert "self.embed_positions(position_ids)" in run_rule(rule, code, ctx)
    assert not any("chunk" in r for r in ctx.rewrites)


def test_a_position_buffer_indexed_by_the_positions_and_added_looks_up_this_ranks_chunk(run_rule, make_ctx):
    # CTRL's sinusoidal buffer: `pos_embeds = self.pos_encoding[position_ids, :]`, then summed with the tokens'
    code = POSITIONS.replace(
        "        hidden_states = self.embed_tokens(input_ids) + self.embed_positions(position_ids)\n",
        "        pos_embeds = self.pos_encoding[position_ids, :]\n"
        "        hidden_states = self.embed_tokens(input_ids) + pos_embeds + 0\n",
    )
    ctx = make_ctx()
    out = run_rule(rule, code, ctx)
    assert "pos_embeds = self.pos_encoding[own_chunk(position_ids), :]" in out
    assert ctx.rewrites[-1] == "LlamaModel: self.pos_encoding looks up this rank's chunk of position_ids"
    again = make_ctx()
    assert run_rule(rule, out, again) == out and again.rewrites == []


def test_rows_multiplied_before_they_are_added_keep_every_position(run_rule, make_ctx):
    # CodeGen-style rotary: `sincos = self.embed_positions[position_ids]`, applied as q * cos + rotate(q) * sin
    code = POSITIONS.replace(
        "        hidden_states = self.embed_tokens(input_ids) + self.embed_positions(position_ids)\n",
        "        cos = self.cos_cached[position_ids]\n"
        "        hidden_states = self.embed_tokens(input_ids) * cos + self.embed_tokens(input_ids)\n",
    )
    out = run_rule(rule, code, make_ctx())
    assert "self.cos_cached[position_ids]" in out and "own_chunk" not in out
