"""absolute_imports: relative imports of a vendored HF modeling file become absolute."""

from textwrap import dedent

from skills.migrator.rules.absolute_imports import AbsoluteImports as rule

# The import block of transformers/models/gemma3/modeling_gemma3.py, shortened.
GEMMA3_IMPORTS = dedent("""\
    from collections.abc import Callable

    import torch
    import torch.nn as nn

    from ... import initialization as init
    from ...activations import ACT2FN
    from ...cache_utils import Cache, DynamicCache
    from ...utils.generic import merge_with_config_defaults
    from ..auto import AutoModel
    from .configuration_gemma3 import Gemma3Config, Gemma3TextConfig
    """)

GEMMA3_CTX = {"config_module": "configuration_gemma3", "hf_package": "transformers.models.gemma3"}


def test_relative_imports_become_absolute(run_rule):
    assert run_rule(rule, GEMMA3_IMPORTS, **GEMMA3_CTX) == dedent("""\
        from collections.abc import Callable

        import torch
        import torch.nn as nn

        from transformers import initialization as init
        from transformers.activations import ACT2FN
        from transformers.cache_utils import Cache, DynamicCache
        from transformers.utils.generic import merge_with_config_defaults
        from transformers.models.auto import AutoModel
        from configuration_gemma3 import Gemma3Config, Gemma3TextConfig
        """)


def test_siblings_other_than_the_configuration_stay_under_the_model_package(run_rule):
    code = dedent("""\
        from .modeling_gemma3 import Gemma3RMSNorm
        from . import configuration_gemma3
        """)
    assert run_rule(rule, code, **GEMMA3_CTX) == dedent("""\
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
        from transformers.models.gemma3 import configuration_gemma3
        """)


def test_without_a_config_module_the_configuration_stays_in_transformers(run_rule):
    out = run_rule(rule, "from .configuration_llama import LlamaConfig\n", config_module="")
    assert out == "from transformers.models.llama.configuration_llama import LlamaConfig\n"


def test_remote_code_configuration_takes_the_registered_name(run_rule):
    # Remote code (auto_map) is vendored with hf_package="transformers"; its configuration module is
    # registered under the model's snake name, whatever the checkpoint called the file.
    out = run_rule(
        rule,
        "from .configuration_chatglm import ChatGLMConfig\n",
        config_module="configuration_chatglm3",
        hf_package="transformers",
    )
    assert out == "from configuration_chatglm3 import ChatGLMConfig\n"


def test_idempotent(run_rule):
    once = run_rule(rule, GEMMA3_IMPORTS, **GEMMA3_CTX)
    assert run_rule(rule, once, **GEMMA3_CTX) == once


def test_absolute_imports_untouched(run_rule):
    code = dedent("""\
        import torch
        from torch import nn
        from transformers.activations import ACT2FN
        from configuration_llama import LlamaConfig  # already vendored


        def f():
            from transformers.utils import logging
            return logging
        """)
    assert run_rule(rule, code) == code


# exaone has no modeling file of its own: it runs LlamaForCausalLM with its ExaoneConfig.
BORROWED = dedent("""\
    from .configuration_llama import LlamaConfig


    class LlamaModel(nn.Module):
        def __init__(self, config: LlamaConfig):
            super().__init__()
    """)
EXAONE_CTX = {"config_module": "configuration_exaone", "config_rename": ("LlamaConfig", "ExaoneConfig")}


def test_borrowed_modeling_code_names_the_types_own_config_class(run_rule):
    assert run_rule(rule, BORROWED, **EXAONE_CTX) == dedent("""\
        from configuration_exaone import ExaoneConfig


        class LlamaModel(nn.Module):
            def __init__(self, config: ExaoneConfig):
                super().__init__()
        """)


def test_borrowed_rename_idempotent(run_rule):
    once = run_rule(rule, BORROWED, **EXAONE_CTX)
    assert run_rule(rule, once, **EXAONE_CTX) == once
