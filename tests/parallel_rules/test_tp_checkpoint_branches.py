"""checkpoint_branches (PR008): a config branch the checkpoint never takes that builds per-head modules (or uses
them) becomes a guard before the layers are sharded, so nothing it builds needs a rule; taken branches, other
untaken ones and a rewrite without the checkpoint's config are left alone."""

from functools import partial
from textwrap import dedent

from codemod_harness import assert_codemod, assert_noop, run_codemod
from transformers import CohereConfig, FalconConfig, GPTBigCodeConfig

from skills.parallel_impl.rules.checkpoint_branches import GuardUntakenBranches as rule

# Cohere: per-head q / k norms, sized for every head, built and applied only under use_qk_norm.
BEFORE = dedent("""\
    class CohereAttention(nn.Module):
        def __init__(self, config: CohereConfig, layer_idx, infer_config, comm_manager=None, prefix=""):
            super().__init__()
            self.use_qk_norm = config.use_qk_norm
            if self.use_qk_norm:
                self.q_norm = CohereLayerNorm(hidden_size=(config.num_attention_heads, 16))

        def forward(self, hidden_states, *, forward_metadata, **kwargs):
            if self.use_qk_norm:
                hidden_states = self.q_norm(hidden_states)
            return hidden_states
    """)

GUARD = (
    "raise NotImplementedError('parallelized for a checkpoint where `self.use_qk_norm` is false; '\n"
    "                'run `skill migrate` and `skill parallelize` on this checkpoint')\n"
)
AFTER = BEFORE.replace(
    "            self.q_norm = CohereLayerNorm(hidden_size=(config.num_attention_heads, 16))\n",
    "            " + GUARD,
).replace("            hidden_states = self.q_norm(hidden_states)\n", "            " + GUARD)


def test_untaken_branches_become_guards(make_ctx):
    assert AFTER != BEFORE
    assert_codemod(rule, BEFORE, AFTER, partial(make_ctx, checkpoint_config=CohereConfig(use_qk_norm=False)))


def test_taken_branches_and_a_rewrite_without_the_config_untouched(make_ctx):
    assert_noop(rule, BEFORE, partial(make_ctx, checkpoint_config=CohereConfig(use_qk_norm=True)))
    assert_noop(rule, BEFORE, make_ctx)


# One `if` / `elif` chain per layout (as Falcon writes its layouts); the checkpoint (multi-query) takes the last
# arm. An untaken `elif` cannot become two statements inside its chain (it is its parent's `orelse`): it keeps the
# rest of the chain.
CHAIN = dedent("""\
    class FalconAttention(nn.Module):
        def __init__(self, config: FalconConfig):
            super().__init__()
            self.new_decoder_architecture = config.new_decoder_architecture
            self.multi_query = config.multi_query
            if self.new_decoder_architecture:
                self.norm = Norm(config.num_attention_heads * 4)
            elif not self.multi_query:
                self.norm = Norm(config.num_attention_heads * 2)
            elif self.multi_query:
                self.norm = Norm(4)
    """)


def _guard(test: str, value: str = "false") -> str:
    return (
        f"            raise NotImplementedError('parallelized for a checkpoint where `{test}` is {value}; '\n"
        "                'run `skill migrate` and `skill parallelize` on this checkpoint')\n"
    )


def test_an_untaken_elif_keeps_the_rest_of_its_chain(make_ctx):
    after = CHAIN.replace(
        "            self.norm = Norm(config.num_attention_heads * 4)\n"
        "        elif not self.multi_query:\n"
        "            self.norm = Norm(config.num_attention_heads * 2)\n",
        _guard("self.new_decoder_architecture")
        + "        if not self.multi_query:\n"
        + _guard("not self.multi_query"),
    )
    assert after != CHAIN
    config = FalconConfig(new_decoder_architecture=False, multi_query=True)
    assert_codemod(rule, CHAIN, after, partial(make_ctx, checkpoint_config=config))


def test_an_untaken_branch_without_per_head_modules_stays_general(make_ctx):
    # llama's weight tie under tie_word_embeddings: nothing in it for the parallel rules to shard
    code = dedent("""\
        class LlamaForCausalLM(nn.Module):
            def __init__(self, config: CohereConfig):
                super().__init__()
                if config.tie_word_embeddings:
                    self.lm_head.weight = self.model.embed_tokens.weight
        """)
    assert_noop(rule, code, partial(make_ctx, checkpoint_config=CohereConfig(tie_word_embeddings=False)))


# GPT-BigCode: the fused q/k/v cut one way under multi_query, per head otherwise; its attention takes `config`
# unannotated, passed by a block built from the annotated config.
BIGCODE = dedent("""\
    class GPTBigCodeAttention(nn.Module):
        def __init__(self, config, infer_config=None, comm_manager=None, prefix=""):
            super().__init__()
            self.multi_query = config.multi_query

        def forward(self, hidden_states, *, forward_metadata, **kwargs):
            if self.multi_query:
                q, k, v = self.c_attn(hidden_states).unsqueeze(1).split((64, 16, 16), dim=3)
            else:
                q, k, v = self.c_attn(hidden_states).view(1, 2, 4, 48).split(3 * [16], dim=3)
            return self.attn(q, k, v, forward_metadata)


    class GPTBigCodeBlock(nn.Module):
        def __init__(self, config: GPTBigCodeConfig, infer_config=None, comm_manager=None, prefix=""):
            super().__init__()
            self.attn = GPTBigCodeAttention(config, infer_config=infer_config)
    """)


def test_an_untaken_else_cutting_a_fused_projection_becomes_a_guard(make_ctx):
    after = BIGCODE.replace(
        "        if self.multi_query:\n"
        "            q, k, v = self.c_attn(hidden_states).unsqueeze(1).split((64, 16, 16), dim=3)\n"
        "        else:\n"
        "            q, k, v = self.c_attn(hidden_states).view(1, 2, 4, 48).split(3 * [16], dim=3)\n",
        "        if not self.multi_query:\n"
        + _guard("self.multi_query", "true")  # an untaken `else:` names the test the checkpoint makes true
        + "        q, k, v = self.c_attn(hidden_states).unsqueeze(1).split((64, 16, 16), dim=3)\n",
    )
    assert after != BIGCODE
    config = GPTBigCodeConfig(multi_query=True)
    assert_codemod(rule, BIGCODE, after, partial(make_ctx, checkpoint_config=config))
    # the per-head branch taken: the `if` body is the untaken branch, guarded as before
    out = run_codemod(rule, BIGCODE, make_ctx(checkpoint_config=GPTBigCodeConfig(multi_query=False)))
    assert "if self.multi_query:\n" + _guard("self.multi_query") in out


def test_a_class_given_something_else_than_the_config_keeps_its_branches(make_ctx):
    code = BIGCODE.replace(
        "GPTBigCodeAttention(config, infer_config", "GPTBigCodeAttention(other, infer_config"
    )
    assert_noop(rule, code, partial(make_ctx, checkpoint_config=GPTBigCodeConfig(multi_query=True)))


# Falcon: forward passes `query_key_value`'s output to a helper that cuts it one way per layout, and calls its
# ALiBi Attention (a second runtime Attention on the same cache) only under `config.alibi`.
FALCON = dedent("""\
    class FalconAttention(nn.Module):
        def __init__(self, config: FalconConfig, layer_idx=None, infer_config=None, comm_manager=None, prefix=""):
            super().__init__()
            self.new_decoder_architecture = config.new_decoder_architecture
            self.multi_query = config.multi_query
            self.use_alibi = config.alibi
            self.attn = Attention(num_heads=4, head_dim=16)
            self.attn_2 = Attention(num_heads=4, head_dim=16, alibi_slopes=[1.0] * 4, cache_of=self.attn)

        def _split_heads(self, fused_qkv):
            if self.new_decoder_architecture:
                return fused_qkv.view(1, 1, -1, 4, 16)
            elif not self.multi_query:
                return fused_qkv.view(1, 1, 4, 3, 16)
            else:
                return fused_qkv.view(1, 1, 6, 16)

        def forward(self, hidden_states, *, forward_metadata, **kwargs):
            fused_qkv = self.query_key_value(hidden_states)
            q, k, v = self._split_heads(fused_qkv)
            if not self.use_alibi:
                out = self.attn(q, k, v, forward_metadata)
            else:
                out = self.attn_2(q, k, v, forward_metadata)
            return self.dense(out)
    """)


def test_layouts_a_helper_cuts_and_another_attention_s_branch_untaken_become_guards(make_ctx):
    config = FalconConfig(new_decoder_architecture=False, multi_query=True, alibi=False)
    out = run_codemod(rule, FALCON, make_ctx(checkpoint_config=config))
    assert "if self.new_decoder_architecture:\n" + _guard("self.new_decoder_architecture") in out
    assert "        if not self.multi_query:\n" + _guard("not self.multi_query") in out
    # the layout the checkpoint has, after the guards
    assert _guard("not self.multi_query") + "        return fused_qkv.view(1, 1, 6, 16)\n" in out
    # `if not x: A else: B`, x false: `if x: raise ...`, then A
    after = (
        "        if self.use_alibi:\n"
        + _guard("self.use_alibi")
        + "        out = self.attn(q, k, v, forward_metadata)\n"
    )
    assert after in out and "self.attn_2(q" not in out
    assert run_codemod(rule, out, make_ctx(checkpoint_config=config)) == out


def test_an_elif_left_alone_by_guarding_the_tests_before_it_is_an_if_like_any_other(make_ctx):
    # falcon-rw (per head): the grouped arm is guarded, the per-head `elif` is taken, so the multi-query `else:`
    # after it is guarded too, leaving one layout
    config = FalconConfig(new_decoder_architecture=False, multi_query=False, alibi=False)
    out = run_codemod(rule, FALCON, make_ctx(checkpoint_config=config))
    assert "        if self.multi_query:\n" + _guard("self.multi_query") in out
    assert "view(1, 1, 6, 16)" not in out and "        return fused_qkv.view(1, 1, 4, 3, 16)\n" in out
    assert run_codemod(rule, out, make_ctx(checkpoint_config=config)) == out


def test_a_taken_if_followed_by_elif_arms_guards_them_all(make_ctx):
    config = FalconConfig(new_decoder_architecture=True, alibi=False)
    out = run_codemod(rule, FALCON, make_ctx(checkpoint_config=config))
    guard = _guard("self.new_decoder_architecture", "true")
    assert (
        "        if not self.new_decoder_architecture:\n"
        + guard
        + "        return fused_qkv.view(1, 1, -1, 4, 16)\n"
        in out
    )
    assert "multi_query" not in out.split("def _split_heads")[1].split("def forward")[0]
