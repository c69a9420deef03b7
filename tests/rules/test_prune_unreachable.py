"""prune_unreachable: only definitions the entry class (or EntryClass) needs stay."""

from textwrap import dedent

from skills.migrator.rules.prune_unreachable import PruneUnreachable as rule

BEFORE = dedent("""\
    import torch
    from torch import nn

    logger = logging.get_logger(__name__)


    def rotate_half(x):
        return torch.cat((-x, x), dim=-1)


    def eager_attention_forward(module, query, key, value, attention_mask, scaling, **kwargs):
        return query


    class LlamaRMSNorm(nn.Module):
        def forward(self, x):
            return x


    class LlamaModel(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.norm = LlamaRMSNorm(config.hidden_size)

        def forward(self, x):
            return rotate_half(self.norm(x))


    class LlamaPreTrainedModel(nn.Module):
        base_model_prefix = "model"


    class LlamaForCausalLM(LlamaPreTrainedModel):
        _can_record_outputs = {"attentions": eager_attention_forward}

        def __init__(self, config):
            super().__init__()
            self.model = LlamaModel(config)


    class LlamaForSequenceClassification(GenericForSequenceClassification, LlamaPreTrainedModel): ...


    EntryClass = LlamaForCausalLM

    __all__ = ["LlamaForCausalLM", "LlamaModel", "LlamaPreTrainedModel", "LlamaForSequenceClassification"]
    """)

AFTER = dedent("""\
    import torch
    from torch import nn


    def rotate_half(x):
        return torch.cat((-x, x), dim=-1)


    class LlamaRMSNorm(nn.Module):
        def forward(self, x):
            return x


    class LlamaModel(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.norm = LlamaRMSNorm(config.hidden_size)

        def forward(self, x):
            return rotate_half(self.norm(x))


    class LlamaForCausalLM(LlamaPreTrainedModel):
        _can_record_outputs = {"attentions": eager_attention_forward}

        def __init__(self, config):
            super().__init__()
            self.model = LlamaModel(config)


    EntryClass = LlamaForCausalLM
    """)


def test_unreachable_definitions_dropped(run_rule):
    # Reached through __init__ and forward; the PreTrainedModel base, names only HF-only class attributes
    # use (`_can_record_outputs`), other heads, the logger and __all__ go. Imports are unused_imports' job.
    assert run_rule(rule, BEFORE) == AFTER


def test_idempotent(run_rule):
    assert run_rule(rule, AFTER) == AFTER


def test_everything_reachable_untouched(run_rule):
    code = dedent("""\
        import torch

        MAX = 4


        def helper(x):
            return x * MAX


        class LlamaForCausalLM(torch.nn.Module):
            def forward(self, x):
                return helper(x)
        """)
    assert run_rule(rule, code) == code


def test_without_a_root_untouched(run_rule):
    # Neither the entry class nor EntryClass in the file (e.g. the configuration module): nothing goes.
    code = BEFORE.replace("EntryClass = LlamaForCausalLM\n", "")
    assert run_rule(rule, code, entry_class="MistralForCausalLM") == code


def test_entry_class_alias_is_a_root(run_rule):
    out = run_rule(rule, BEFORE, entry_class="MistralForCausalLM")
    assert out == AFTER
