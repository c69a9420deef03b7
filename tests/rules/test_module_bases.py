"""module_bases: HF base classes become nn.Module, with post_init, gradient checkpointing flags,
`super().__init__(config)` arguments and HF-only class attributes gone."""

import ast
from textwrap import dedent

from codemod_harness import assert_noop

from skills.migrator.rules.module_bases import ModuleBases as rule

IMPORTS = (
    "from transformers import GenerationMixin, PreTrainedModel\n"
    "from transformers.modeling_layers import GradientCheckpointingLayer\n\n\n"
)

BEFORE = IMPORTS + dedent("""\
    class LlamaPreTrainedModel(PreTrainedModel):
        config: LlamaConfig
        base_model_prefix = "model"
        supports_gradient_checkpointing = True
        _no_split_modules = ["LlamaDecoderLayer"]
        _supports_flash_attn = True


    class LlamaDecoderLayer(GradientCheckpointingLayer):
        def __init__(self, config: LlamaConfig, layer_idx: int):
            super().__init__()
            self.hidden_size = config.hidden_size


    class LlamaModel(LlamaPreTrainedModel):
        _layer_cls = LlamaDecoderLayer

        def __init__(self, config: LlamaConfig):
            super().__init__(config)
            self.padding_idx = config.pad_token_id
            self.gradient_checkpointing = False

            # Initialize weights and apply final processing
            self.post_init()

        def forward(self, x):
            return self._layer_cls(x)


    class LlamaForCausalLM(LlamaPreTrainedModel, GenerationMixin):
        _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
        _tp_plan = {"lm_head": "colwise_gather_output"}

        def __init__(self, config):
            super().__init__(config)
            self.model = LlamaModel(config)
            self.post_init()
    """)

AFTER = IMPORTS + dedent("""\
    class LlamaPreTrainedModel(nn.Module):
        base_model_prefix = "model"
        supports_gradient_checkpointing = True


    class LlamaDecoderLayer(nn.Module):
        def __init__(self, config: LlamaConfig, layer_idx: int):
            super().__init__()
            self.hidden_size = config.hidden_size


    class LlamaModel(nn.Module):
        _layer_cls = LlamaDecoderLayer

        def __init__(self, config: LlamaConfig):
            super().__init__()
            self.config = config
            self.padding_idx = config.pad_token_id

        def forward(self, x):
            return self._layer_cls(x)


    class LlamaForCausalLM(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.model = LlamaModel(config)
    """)


def test_hf_bases_become_nn_module(run_rule):
    # `_layer_cls` is read through self, so it is not an HF-only attribute and stays.
    assert run_rule(rule, BEFORE) == AFTER


def test_idempotent(run_rule):
    assert run_rule(rule, AFTER) == AFTER


def test_other_bases_kept_beside_hf_ones(run_rule):
    code = IMPORTS + dedent("""\
        class LlamaPreTrainedModel(PreTrainedModel):
            pass


        class LlamaForSequenceClassification(GenericForSequenceClassification, LlamaPreTrainedModel):
            def __init__(self, config):
                super().__init__(config)
        """)
    out = run_rule(rule, code)
    cls = ast.parse(out).body[-1]
    assert [ast.unparse(b) for b in cls.bases] == ["GenericForSequenceClassification"]
    assert [ast.unparse(s) for s in cls.body[0].body] == ["super().__init__()", "self.config = config"]
    assert run_rule(rule, out) == out


def test_non_hf_subclasses_untouched(make_ctx):
    # Gemma3TextScaledWordEmbedding: a torch subclass whose super().__init__ needs its arguments.
    code = dedent('''\
        class Gemma3TextScaledWordEmbedding(nn.Embedding):
            """
            This module overrides nn.Embeddings' forward by multiplying with embeddings scale.
            """

            def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int, embed_scale: float = 1.0):
                super().__init__(num_embeddings, embedding_dim, padding_idx)
                self.scalar_embed_scale = embed_scale
                self.embed_scale = nn.Buffer(torch.tensor(embed_scale), persistent=False)


        class E(nn.Embedding):
            _private = 1

            def __init__(self, config):
                super().__init__(config)
        ''')
    assert_noop(rule, code, make_ctx)


# FalconModel (v5): the flag is assigned in __init__ and read in forward.
FALCON = IMPORTS + dedent("""\
    class FalconPreTrainedModel(PreTrainedModel):
        base_model_prefix = "transformer"


    class FalconModel(FalconPreTrainedModel):
        def __init__(self, config):
            super().__init__(config)
            self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
            self.gradient_checkpointing = False
            self.post_init()

        def forward(self, input_ids, use_cache=None, **kwargs):
            if self.gradient_checkpointing and self.training:
                if use_cache:
                    use_cache = False
            return self.word_embeddings(input_ids)
    """)


def test_gradient_checkpointing_reads_go_with_the_flag(run_rule, make_ctx):
    """fold_hf_only_params (which runs first) folds the reads; module_bases drops the flag."""
    from skills.migrator.rules.fold_hf_only_params import FoldHFOnlyParams

    ctx = make_ctx(entry_class="FalconForCausalLM")
    out = run_rule(rule, run_rule(FoldHFOnlyParams, FALCON, ctx), ctx)
    assert ctx.findings or "self.gradient_checkpointing" not in out or "self.gradient_checkpointing =" in out


# GPT2Model.forward (v5) calls a PreTrainedModel method.
GPT2 = IMPORTS + dedent("""\
    class GPT2PreTrainedModel(PreTrainedModel):
        base_model_prefix = "transformer"


    class GPT2Model(GPT2PreTrainedModel):
        def __init__(self, config):
            super().__init__(config)
            self.wte = nn.Embedding(config.vocab_size, config.n_embd)

        def forward(self, input_ids, **kwargs):
            if input_ids is not None:
                self.warn_if_padding_and_no_attention_mask(input_ids, None)
            return self.wte(input_ids)
    """)


def test_bare_inherited_hf_method_calls_go(run_rule, make_ctx):
    ctx = make_ctx(entry_class="GPT2Model")
    out = run_rule(rule, GPT2, ctx)
    assert not ctx.findings
    assert (
        "warn_if_padding_and_no_attention_mask" not in out
        and "if input_ids is not None:\n            pass" in out
    )


def test_inherited_hf_method_results_are_reported(run_rule, make_ctx):
    ctx = make_ctx(entry_class="GPT2Model")
    used = GPT2.replace("return self.wte(input_ids)", "return self.get_extended_attention_mask(input_ids)")
    run_rule(rule, used, ctx)
    assert [f.what for f in ctx.findings] == [
        "`self.get_extended_attention_mask(...)` is a PreTrainedModel method that nn.Module lacks"
    ]


def test_recognised_by_qualified_name_not_by_spelling(run_rule, make_ctx):
    aliased = dedent("""\
        from transformers.modeling_utils import PreTrainedModel as Base


        class MyPreTrainedModel(Base):
            pass


        class MyModel(MyPreTrainedModel):
            def __init__(self, config):
                super().__init__(config)
        """)
    out = run_rule(rule, aliased)
    assert "class MyPreTrainedModel(nn.Module)" in out and "class MyModel(nn.Module)" in out
    homemade = dedent("""\
        class PreTrainedModel(nn.Module):  # the file's own class of that name, not transformers'
            pass


        class MyModel(PreTrainedModel):
            def __init__(self, config):
                super().__init__(config)
        """)
    assert_noop(rule, homemade, make_ctx)
