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


# TrOCR's decoder forward once MG004 has taken its HF-only parameters: its docstring still described them.
ARGS_BEFORE = dedent('''\
    class TrOCRDecoder(nn.Module):
        def forward(self, input_ids=None, position_ids=None, **kwargs):
            r"""
            Args:
                input_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`):
                    Indices of input sequence tokens in the vocabulary.

                    [What are input IDs?](../glossary#input-ids)
                attention_mask (`torch.Tensor` of shape `(batch_size, sequence_length)`, *optional*):
                    Mask to avoid performing attention on padding token indices.
                cache (`Cache`, *optional*):
                    Contains pre-computed hidden-states.

            Returns:
                The hidden states.
            """
            return self.layers(input_ids, **kwargs)

        def step(self, hidden_states):
            """One step.

            Args:
                cache: the cache, now gone.
            """
            return hidden_states
    ''')

ARGS_AFTER = ARGS_BEFORE.replace(
    """            attention_mask (`torch.Tensor` of shape `(batch_size, sequence_length)`, *optional*):
                Mask to avoid performing attention on padding token indices.
            cache (`Cache`, *optional*):
                Contains pre-computed hidden-states.
""",
    "",
).replace(
    """

        Args:
            cache: the cache, now gone.
""",
    "\n",
)


def test_arguments_a_function_no_longer_takes_leave_its_docstring(make_ctx):
    assert_codemod(rule, ARGS_BEFORE, ARGS_AFTER, make_ctx)


def test_arguments_it_takes_stay_whatever_their_markup(make_ctx):
    code = ARGS_BEFORE.replace("def step(self, hidden_states):", "def step(self, hidden_states, cache=None):")
    code = code.replace(
        "(self, input_ids=None, position_ids=None, **kwargs)",
        "(self, input_ids, attention_mask, cache, **kwargs)",
    )
    assert_noop(rule, code, make_ctx)
