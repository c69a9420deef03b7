"""strip_hf_decorators: decorators imported from transformers go, except numerics-changing rope helpers."""

from textwrap import dedent

from skills.migrator.rules.strip_hf_decorators import StripHFDecorators as rule

IMPORTS = dedent("""\
    import functools

    import torch
    from torch import nn

    from transformers.integrations import use_kernel_forward_from_hub
    from transformers.modeling_rope_utils import dynamic_rope_update
    from transformers.utils import auto_docstring, can_return_tuple
    from transformers.utils.deprecation import deprecate_kwarg
    from ...utils.generic import merge_with_config_defaults as with_defaults
    """)

BEFORE = IMPORTS + dedent("""\


    @use_kernel_forward_from_hub("RMSNorm")
    class LlamaRMSNorm(nn.Module):
        def forward(self, hidden_states):
            return hidden_states


    class LlamaRotaryEmbedding(nn.Module):
        @torch.no_grad()
        @dynamic_rope_update  # power user: used with advanced RoPE types (e.g. dynamic rope)
        def forward(self, x, position_ids):
            return x


    @auto_docstring
    class LlamaForCausalLM(LlamaPreTrainedModel, GenerationMixin):
        @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
        @can_return_tuple
        @auto_docstring
        @functools.cache
        @with_defaults
        def forward(self, input_ids):
            return input_ids
    """)

AFTER = IMPORTS + dedent("""\


    class LlamaRMSNorm(nn.Module):
        def forward(self, hidden_states):
            return hidden_states


    class LlamaRotaryEmbedding(nn.Module):
        @torch.no_grad()
        @dynamic_rope_update  # power user: used with advanced RoPE types (e.g. dynamic rope)
        def forward(self, x, position_ids):
            return x


    class LlamaForCausalLM(LlamaPreTrainedModel, GenerationMixin):
        @functools.cache
        def forward(self, input_ids):
            return input_ids
    """)


def test_transformers_decorators_dropped_others_kept(run_rule):
    # Imports are left for unused_imports; aliased and relative transformers imports count too.
    assert run_rule(rule, BEFORE) == AFTER


def test_transformers_names():
    import libcst as cst

    from skills.migrator.imports import transformers_names

    assert transformers_names(cst.parse_module(BEFORE)) == {
        "use_kernel_forward_from_hub",
        "dynamic_rope_update",
        "auto_docstring",
        "can_return_tuple",
        "deprecate_kwarg",
        "with_defaults",
    }


def test_idempotent(run_rule):
    assert run_rule(rule, AFTER) == AFTER


def test_decorators_not_from_transformers_untouched(run_rule):
    # Same names, but defined locally / imported elsewhere: not transformers' decorators.
    code = dedent("""\
        from dataclasses import dataclass

        from mylib import auto_docstring


        def can_return_tuple(fn):
            return fn


        @dataclass
        @auto_docstring
        class Output:
            logits: object = None

            @can_return_tuple
            @staticmethod
            def make():
                return Output()
        """)
    assert run_rule(rule, code) == code
