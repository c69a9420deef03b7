"""checkpoint_branches: a config branch the checkpoint never takes that keeps transformers code alive
becomes a NotImplementedError guard; `@dynamic_rope_update` goes once the RoPE type is pinned to one it
does nothing for. Branches the checkpoint takes, branches of plain code, tests it cannot evaluate and files
migrated without a checkpoint are left alone."""

from functools import partial
from textwrap import dedent

from codemod_harness import assert_codemod, assert_noop, run_codemod
from transformers import LlamaConfig

from skills.migrator.rules.checkpoint_branches import CheckpointBranches as rule

IMPORTS = "from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update\n\n\n"

ROTARY = IMPORTS + dedent("""\
    class LlamaRotaryEmbedding(nn.Module):
        def __init__(self, config: LlamaConfig):
            super().__init__()
            self.config = config
            self.rope_type = self.config.rope_parameters["rope_type"]
            rope_init_fn = self.compute_default_rope_parameters
            if self.rope_type != "default":
                rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
            inv_freq, self.attention_scaling = rope_init_fn(self.config)
            if getattr(config, "use_scaled", False):
                inv_freq = ROPE_INIT_FUNCTIONS["scaled"](config)
            else:
                inv_freq = inv_freq * 1.0
            self.inv_freq = inv_freq

        @dynamic_rope_update  # power user: used with advanced RoPE types (e.g. dynamic rope)
        def forward(self, x, position_ids):
            return x * self.inv_freq
    """)

GUARDED = IMPORTS + dedent("""\
    class LlamaRotaryEmbedding(nn.Module):
        def __init__(self, config: LlamaConfig):
            super().__init__()
            self.config = config
            self.rope_type = self.config.rope_parameters["rope_type"]
            rope_init_fn = self.compute_default_rope_parameters
            if self.rope_type != "default":
                raise NotImplementedError('migrated for a checkpoint where `self.rope_type != "default"` is false; '
                    'run `skill migrate` on this checkpoint')
            inv_freq, self.attention_scaling = rope_init_fn(self.config)
            if getattr(config, "use_scaled", False):
                raise NotImplementedError('migrated for a checkpoint where `getattr(config, "use_scaled", False)` is false; '
                    'run `skill migrate` on this checkpoint')
            inv_freq = inv_freq * 1.0
            self.inv_freq = inv_freq

        def forward(self, x, position_ids):
            return x * self.inv_freq
    """)


def test_untaken_branches_become_guards_and_the_rope_update_goes(make_ctx):
    assert_codemod(rule, ROTARY, GUARDED, partial(make_ctx, checkpoint_config=LlamaConfig()))


def test_the_guard_refuses_another_checkpoint(make_ctx):
    """The guarded code runs for the checkpoint it was migrated for and refuses one with another RoPE type."""
    code = run_codemod(rule, ROTARY, make_ctx(checkpoint_config=LlamaConfig()))
    scope = {"nn": __import__("torch").nn, "LlamaConfig": LlamaConfig}
    exec(code.replace(IMPORTS, "ROPE_INIT_FUNCTIONS = {}\n", 1), scope)  # noqa: S102 (the rule's output)
    cls = scope["LlamaRotaryEmbedding"]
    cls.compute_default_rope_parameters = staticmethod(lambda config: (1.0, 1.0))
    assert cls(LlamaConfig()).inv_freq == 1.0
    linear = LlamaConfig(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    try:
        cls(linear)
    except NotImplementedError as e:
        assert 'self.rope_type != "default"' in str(e)
    else:
        raise AssertionError("a linear-RoPE config passed the guard")


def test_a_checkpoint_that_takes_the_branch_keeps_it(make_ctx):
    dynamic = LlamaConfig(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    code = ROTARY.replace('getattr(config, "use_scaled", False)', "True")
    assert_noop(rule, code, partial(make_ctx, checkpoint_config=dynamic))


def test_no_checkpoint_plain_branches_and_undecidable_tests_untouched(make_ctx):
    assert_noop(rule, ROTARY, make_ctx)  # migrated without a checkpoint config
    plain = dedent("""\
        class LlamaForCausalLM(nn.Module):
            def __init__(self, config: LlamaConfig):
                super().__init__()
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
                if config.tie_word_embeddings:  # no transformers code in it: stays general
                    self.lm_head.weight = self.model.embed_tokens.weight
                if config.no_such_attribute:  # the config cannot answer
                    self.x = ROPE_INIT_FUNCTIONS["a"]
                if self.training:  # not the config's
                    self.y = ROPE_INIT_FUNCTIONS["b"]


        class Other(nn.Module):
            def __init__(self, config):  # not annotated with the checkpoint's config class
                if config.tie_word_embeddings:
                    self.z = ROPE_INIT_FUNCTIONS["c"]
        """)
    assert_noop(rule, IMPORTS + plain, partial(make_ctx, checkpoint_config=LlamaConfig()))


# BLOOM: with pretraining_tp > 1 the output projection's weight is sliced by hand, past the layer (and so past
# any parallel or quantized layer the model is later given); this checkpoint never takes that branch.
WEIGHT_READ = dedent("""\
    class BloomAttention(nn.Module):
        def __init__(self, config: LlamaConfig):
            super().__init__()
            self.pretraining_tp = config.pretraining_tp
            self.dense = nn.Linear(config.hidden_size, config.hidden_size)

        def forward(self, x):
            if self.pretraining_tp > 1:
                out = F.linear(x[..., :8], self.dense.weight[:, :8])
            else:
                out = self.dense(x)
            return out
    """)


def test_an_untaken_branch_reading_a_layer_weight_becomes_a_guard(make_ctx):
    guarded = WEIGHT_READ.replace(
        "        if self.pretraining_tp > 1:\n"
        "            out = F.linear(x[..., :8], self.dense.weight[:, :8])\n"
        "        else:\n"
        "            out = self.dense(x)\n",
        "        if self.pretraining_tp > 1:\n"
        "            raise NotImplementedError('migrated for a checkpoint where `self.pretraining_tp > 1` is false; '\n"
        "                'run `skill migrate` on this checkpoint')\n"
        "        out = self.dense(x)\n",
    )
    assert guarded != WEIGHT_READ
    assert_codemod(
        rule, WEIGHT_READ, guarded, partial(make_ctx, checkpoint_config=LlamaConfig(pretraining_tp=1))
    )
    assert_noop(rule, WEIGHT_READ, partial(make_ctx, checkpoint_config=LlamaConfig(pretraining_tp=2)))


def test_a_class_given_the_config_unannotated_by_a_class_built_from_it_is_read_too(make_ctx):
    # the class takes `config` without an annotation; its one builder passes its own annotated `config`
    code = WEIGHT_READ.replace("config: LlamaConfig", "config") + dedent("""\


        class BloomBlock(nn.Module):
            def __init__(self, config: LlamaConfig):
                super().__init__()
                self.self_attention = BloomAttention(config)
        """)
    config = partial(make_ctx, checkpoint_config=LlamaConfig(pretraining_tp=1))
    assert "raise NotImplementedError" in run_codemod(rule, code, config())
    assert_noop(rule, code.replace("BloomAttention(config)", "BloomAttention(config.text_config)"), config)
