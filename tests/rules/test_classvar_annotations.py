"""classvar_annotations: mutable class-level metadata of a configuration class is annotated ClassVar."""

from textwrap import dedent

from codemod_harness import assert_codemod, assert_noop

from skills.migrator.rules.classvar_annotations import ClassVarAnnotations as rule

BEFORE = dedent("""\
    from transformers.configuration_utils import PreTrainedConfig


    class LlamaConfig(PreTrainedConfig):
        model_type = "llama"
        keys_to_ignore_at_inference = ["past_key_values"]
        base_model_tp_plan = {"layers.*.self_attn.q_proj": "colwise"}

        def __init__(self, vocab_size=32000):
            self.aliases = {"n": "vocab_size"}  # an instance attribute, not class data
            self.vocab_size = vocab_size
    """)

AFTER = dedent("""\
    from transformers.configuration_utils import PreTrainedConfig
    from typing import ClassVar


    class LlamaConfig(PreTrainedConfig):
        model_type = "llama"
        keys_to_ignore_at_inference: ClassVar[list] = ["past_key_values"]
        base_model_tp_plan: ClassVar[dict] = {"layers.*.self_attn.q_proj": "colwise"}

        def __init__(self, vocab_size=32000):
            self.aliases = {"n": "vocab_size"}  # an instance attribute, not class data
            self.vocab_size = vocab_size
    """)


def test_class_data_annotated_once(make_ctx):
    assert_codemod(rule, BEFORE, AFTER, make_ctx)


def test_immutable_and_module_level_values_untouched(make_ctx):
    code = dedent("""\
        DEFAULTS = {"a": 1}


        class LlamaConfig:
            model_type = "llama"
            default_theta = 10000.0
        """)
    assert_noop(rule, code, make_ctx)
