"""lm_head: the entry class's nn.Linear head -> ParallelLMHead, its tie -> tie_weights, tokens gathered
before the last-token selection."""

from textwrap import dedent

import pytest

from skills.parallel_impl.rules.lm_head import ShardLMHead as rule

EMBEDDING = dedent("""\
    class LlamaModel(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, comm_manager=comm_manager, tp_group="embed_tp_group", prefix=join_prefix(prefix, "embed_tokens"))


    """)

BEFORE = EMBEDDING + dedent("""\
    class LlamaForCausalLM(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.model = LlamaModel(config, infer_config, comm_manager, join_prefix(prefix, "model"))
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            if config.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight

        def forward(self, input_ids, position_ids, forward_metadata, **kwargs):
            hidden_states = self.model(input_ids=input_ids[None], position_ids=position_ids[None])
            hidden_states = hidden_states[0, forward_metadata.last_token_indices]
            return self.lm_head(hidden_states)[:, None, :]
    """)

AFTER = (
    dedent("""\
    from runtime.layers.embedding import ParallelLMHead
    from runtime.layers.prefix import join_prefix
    from runtime.layers.token_layout import gather_tokens, own_chunk

    """)
    + EMBEDDING
    + dedent("""\
    class LlamaForCausalLM(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.model = LlamaModel(config, infer_config, comm_manager, join_prefix(prefix, "model"))
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, bias=False, comm_manager=comm_manager, tp_group="lmhead_tp_group", prefix=join_prefix(prefix, "lm_head"))
            if config.tie_word_embeddings:
                self.lm_head.tie_weights(self.model.embed_tokens)

        def forward(self, input_ids, position_ids, forward_metadata, **kwargs):
            input_ids = own_chunk(input_ids)
            hidden_states = self.model(input_ids=input_ids[None], position_ids=position_ids[None])
            hidden_states = gather_tokens(hidden_states)[0, forward_metadata.last_token_indices]
            return self.lm_head(hidden_states)[:, None, :]
    """)
)


def test_lm_head_sharded_and_tied(run_rule, make_ctx):
    ctx = make_ctx()
    assert run_rule(rule, BEFORE, ctx) == AFTER
    assert ctx.rewrites == [
        "LlamaForCausalLM: lm_head -> ParallelLMHead (lmhead_tp_group), tied to self.model.embed_tokens via tie_weights",
        "LlamaForCausalLM: forward feeds the model this rank's chunk of the input ids and gathers the tokens of every rank before the LM head",
    ]
    assert ctx.findings == []


def test_idempotent(run_rule, make_ctx):
    ctx = make_ctx()
    assert run_rule(rule, AFTER, ctx) == AFTER
    assert ctx.rewrites == ctx.findings == []


def test_no_parallel_layers_untouched(run_rule, make_ctx):
    # Another entry class: this one isn't rewritten, and nothing in the file is parallel to gather for.
    ctx = make_ctx(entry_class="MistralForCausalLM")
    assert run_rule(rule, BEFORE, ctx) == BEFORE
    assert ctx.rewrites == ctx.findings == []


def test_tied_to_a_replicated_embedding_stays_replicated(run_rule, make_ctx):
    # Gemma3's scaled embedding subclasses nn.Embedding and stays whole: so does the head sharing its weight.
    code = BEFORE.replace(EMBEDDING, "")
    ctx = make_ctx()
    assert run_rule(rule, code, ctx) == code
    assert ctx.rewrites == ctx.findings == []


def test_untied_head_of_a_replicated_embedding_sharded(run_rule, make_ctx):
    code = BEFORE.replace(EMBEDDING, "").replace(
        "        if config.tie_word_embeddings:\n            self.lm_head.weight = self.model.embed_tokens.weight\n",
        "",
    )
    out = run_rule(rule, code)
    assert "self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, bias=False," in out
    assert "gather_tokens(hidden_states)[0, forward_metadata.last_token_indices]" in out


def test_unshardable_head_tied_to_a_parallel_embedding_is_a_finding(run_rule, make_ctx):
    code = BEFORE.replace("bias=False)", "bias=False, dtype=torch.bfloat16)")
    ctx = make_ctx()
    assert "ParallelLMHead" not in run_rule(rule, code, ctx)
    (finding,) = ctx.findings
    assert finding.scope == "LlamaForCausalLM" and "tied to a vocab-parallel embedding" in finding.what


def test_missing_last_token_selection_is_a_finding(run_rule, make_ctx):
    code = BEFORE.replace("hidden_states[0, forward_metadata.last_token_indices]", "hidden_states[0, -1:]")
    ctx = make_ctx()
    run_rule(rule, code, ctx)
    (finding,) = ctx.findings
    assert "no `[..., forward_metadata.last_token_indices]` selection" in finding.what


def test_head_named_otherwise_found_by_its_vocabulary_output(run_rule, make_ctx):
    # GPT-NeoX-Japanese's head is `embed_out`: the one linear whose output counts the vocabulary. Left replicated,
    # its weight would be tied to one rank's vocab shard and give that shard's logits only.
    code = BEFORE.replace("lm_head", "embed_out")
    ctx = make_ctx()
    out = run_rule(rule, code, ctx)
    assert out == AFTER.replace("lm_head", "embed_out")
    assert ctx.rewrites[0].startswith(
        "LlamaForCausalLM: embed_out -> ParallelLMHead (lmhead_tp_group), tied to"
    )
    again = make_ctx()
    assert run_rule(rule, out, again) == out and again.rewrites == again.findings == []


def test_unrecognised_head_tied_to_a_parallel_embedding_is_a_finding(run_rule, make_ctx):
    code = BEFORE.replace("lm_head", "out").replace("config.vocab_size", "config.num_labels")
    ctx = make_ctx()
    run_rule(rule, code, ctx)
    assert "ParallelLMHead" not in run_rule(rule, code, make_ctx())
    assert any(
        "`self.out.weight = self.model.embed_tokens.weight` ties a layer that is not one nn.Linear LM head"
        in f.what
        for f in ctx.findings
    )


# BertGeneration's head: the linear inside a module of its own, its weight tied to the embedding and its bias to the
# module's `bias`, the one the checkpoint names.
HEAD_MODULE = dedent("""\
    class LMHead(nn.Module):
        def __init__(self, config, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
            self.bias = nn.Parameter(torch.zeros(config.vocab_size))

        def forward(self, hidden_states):
            return self.decoder(hidden_states)


    """)
HEAD = """\
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
"""
NESTED_HEAD = """\
        self.lm_head = LMHead(config, infer_config, comm_manager, join_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head.decoder.weight = self.model.embed_tokens.weight
            self.lm_head.decoder.bias = self.lm_head.bias
"""
NESTED = EMBEDDING + HEAD_MODULE + BEFORE.replace(EMBEDDING, "").replace(HEAD, NESTED_HEAD)


def test_head_inside_a_module_of_its_own_sharded_with_its_ties(run_rule, make_ctx):
    assert HEAD in BEFORE
    ctx = make_ctx()
    out = run_rule(rule, NESTED, ctx)
    # the module's bias becomes the parallel head's, a vocab shard loaded from the checkpoint's `lm_head.bias`
    parallel_head = (
        "ParallelLMHead(config.vocab_size, config.hidden_size, bias=True, comm_manager=comm_manager, "
        'tp_group="lmhead_tp_group", prefix=join_prefix(prefix, "decoder"))'
    )
    entry = AFTER[AFTER.index("class LlamaForCausalLM") :]
    assert out == AFTER.replace(entry, "") + HEAD_MODULE.replace(
        "nn.Linear(config.hidden_size, config.vocab_size)", parallel_head
    ) + entry.replace(
        """\
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, bias=False, comm_manager=comm_manager, tp_group="lmhead_tp_group", prefix=join_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
""",
        """\
        self.lm_head = LMHead(config, infer_config, comm_manager, join_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head.decoder.tie_weights(self.model.embed_tokens)
            self.lm_head.bias = self.lm_head.decoder.bias
""",
    )
    assert ctx.rewrites[0] == (
        "LMHead: decoder -> ParallelLMHead (lmhead_tp_group), tied to self.model.embed_tokens via tie_weights, its "
        "bias shared as lm_head.bias"
    )
    again = make_ctx()
    assert run_rule(rule, out, again) == out and again.rewrites == again.findings == []


def test_head_inside_a_module_whose_bias_is_read_whole_is_a_finding(run_rule, make_ctx):
    code = NESTED.replace(
        "return self.decoder(hidden_states)", "return self.decoder(hidden_states) + self.bias"
    )
    assert code != NESTED
    ctx = make_ctx()
    assert "ParallelLMHead" not in run_rule(rule, code, ctx)
    assert any(
        "`self.lm_head.decoder.weight = self.model.embed_tokens.weight` ties" in f.what for f in ctx.findings
    )


def test_head_tied_inside_its_own_module_stays_replicated(run_rule, make_ctx):
    # transformers' own spelling of the bias tie, inside the head module: its ParallelLMHead would get the whole bias
    code = NESTED.replace(
        "        self.bias = nn.Parameter(torch.zeros(config.vocab_size))\n",
        "        self.bias = nn.Parameter(torch.zeros(config.vocab_size))\n        self.decoder.bias = self.bias\n",
    ).replace("            self.lm_head.decoder.bias = self.lm_head.bias\n", "")
    assert code != NESTED
    ctx = make_ctx()
    assert "ParallelLMHead(" not in run_rule(rule, code, ctx)
    assert any("ties a layer that is not one nn.Linear LM head" in f.what for f in ctx.findings)


# Dory's head: an nn.Linear subclass scaling each logit by a learned factor per vocabulary entry.
SCALED_HEAD = dedent("""\
    class ScaledHead(nn.Linear):
        def __init__(self, config):
            super().__init__(config.hidden_size, config.vocab_size, bias=False)
            self.logit_scale = nn.Parameter(torch.ones(config.vocab_size))

        def forward(self, hidden_states):
            return super().forward(hidden_states) * self.logit_scale


    """)
SUBCLASSED = (
    EMBEDDING
    + SCALED_HEAD
    + BEFORE.replace(EMBEDDING, "").replace(
        "nn.Linear(config.hidden_size, config.vocab_size, bias=False)", "ScaledHead(config)"
    )
)


def test_a_head_subclassing_nn_linear_becomes_a_subclass_of_the_parallel_head(run_rule, make_ctx):
    """Its `super().forward` returns the gathered logits, which its own parameters (whole) then scale."""
    ctx = make_ctx()
    out = run_rule(rule, SUBCLASSED, ctx)
    assert ctx.findings == []
    assert "from runtime.config.comm_manager import CommManager\n" in out
    assert (
        "class ScaledHead(ParallelLMHead):\n"
        '    def __init__(self, config, comm_manager: CommManager | None = None, prefix: str = ""):\n'
        "        super().__init__(config.vocab_size, config.hidden_size, bias=False, comm_manager=comm_manager, "
        'tp_group="lmhead_tp_group", prefix=prefix)\n'
        "        self.logit_scale = nn.Parameter(torch.ones(config.vocab_size))\n"
    ) in out
    assert (
        'self.lm_head = ScaledHead(config, comm_manager=comm_manager, prefix=join_prefix(prefix, "lm_head"))\n'
        "        if config.tie_word_embeddings:\n"
        "            self.lm_head.tie_weights(self.model.embed_tokens)\n"
    ) in out
    assert "return super().forward(hidden_states) * self.logit_scale" in out
    again = make_ctx()
    assert run_rule(rule, out, again) == out and again.rewrites == again.findings == []


def test_a_subclassed_head_already_given_the_plumbing_keeps_one_of_each_argument(run_rule):
    code = SUBCLASSED.replace(
        "def __init__(self, config):", 'def __init__(self, config, comm_manager=None, prefix=""):'
    ).replace(
        "ScaledHead(config)",
        'ScaledHead(config, comm_manager=comm_manager, prefix=join_prefix(prefix, "lm_head"))',
    )
    out = run_rule(rule, code)
    compile(out, "modeling.py", "exec")
    assert 'ScaledHead(config, comm_manager=comm_manager, prefix=join_prefix(prefix, "lm_head"))\n' in out
    assert 'def __init__(self, config, comm_manager=None, prefix=""):' in out


@pytest.mark.parametrize(
    "change",
    [
        (  # `self.weight` outside `super().forward` would be a rank's vocab shard
            "return super().forward(hidden_states) * self.logit_scale",
            "return hidden_states @ self.weight.T * self.logit_scale",
        ),
        (
            "* self.logit_scale",
            "* self.logit_scale[: self.out_features]",
        ),  # ParallelLMHead has no out_features
        ("class ScaledHead(nn.Linear):", "class ScaledHead(nn.Linear, Scaled):"),  # another base to keep
    ],
    ids=["own_weight", "nn_linear_attribute", "two_bases"],
)
def test_a_subclassed_head_the_rule_cannot_rebase_is_a_finding_when_tied(run_rule, make_ctx, change):
    code = SUBCLASSED.replace(*change)
    assert code != SUBCLASSED
    ctx = make_ctx()
    assert "ParallelLMHead" not in run_rule(rule, code, ctx)
    assert any("ties a layer that is not one nn.Linear LM head" in f.what for f in ctx.findings)
