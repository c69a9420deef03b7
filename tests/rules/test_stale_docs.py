"""stale_docs: docstring examples of names the file does not define go, HF doc cross-references become code
spans, and docstrings that still describe the file stay."""

from textwrap import dedent

from codemod_harness import assert_codemod, assert_noop

from skills.migrator.rules.stale_docs import StaleDocs as rule

BEFORE = dedent('''\
    from transformers.configuration_utils import PreTrainedConfig


    class LlamaConfig(PreTrainedConfig):
        r"""
        ```python
        >>> from transformers import LlamaModel, LlamaConfig

        >>> # Initializing a model from the llama-7b style configuration
        >>> model = LlamaModel(LlamaConfig())
        ```"""

        model_type = "llama"


    class GemmaConfig(PreTrainedConfig):
        r"""
        query_pre_attn_scalar (`float`, *optional*, defaults to 256):
            scaling factor used on the attention scores

        ```python
        >>> from transformers import GemmaModel
        >>> model = GemmaModel(GemmaConfig())
        ```
        """

        def rope(config, **kwargs):
            """
            Args:
                config ([`~transformers.PreTrainedConfig`]): see [`LlamaConfig`].
            """
            return config
    ''')

AFTER = dedent('''\
    from transformers.configuration_utils import PreTrainedConfig


    class LlamaConfig(PreTrainedConfig):

        model_type = "llama"


    class GemmaConfig(PreTrainedConfig):
        r"""
        query_pre_attn_scalar (`float`, *optional*, defaults to 256):
            scaling factor used on the attention scores
        """

        def rope(config, **kwargs):
            """
            Args:
                config (`PreTrainedConfig`): see `LlamaConfig`.
            """
            return config
    ''')


def test_stale_examples_and_doc_markup_go(make_ctx):
    assert_codemod(rule, BEFORE, AFTER, make_ctx)


def test_docstrings_that_describe_the_file_untouched(make_ctx):
    code = dedent('''\
        import torch
        from torch import nn


        class LlamaRMSNorm(nn.Module):
            """
            LlamaRMSNorm is equivalent to T5LayerNorm; usage:

            ```python
            >>> norm = LlamaRMSNorm(8)
            >>> y = norm(torch.ones(8))
            ```
            """

            def extra_repr(self):
                """Shape and eps, as `nn.Module` prints them."""
                return "x"
        ''')
    assert_noop(rule, code, make_ctx)
