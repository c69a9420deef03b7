"""model_outputs: inner models return the last hidden state itself; transformers return annotations go."""

from textwrap import dedent

from skills.migrator.rules.model_outputs import ModelOutputs as rule

BEFORE = dedent("""\
    import torch

    from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast


    class LlamaModel(nn.Module):
        def forward(self, input_ids, position_ids=None, **kwargs) -> BaseModelOutputWithPast:
            hidden_states = self.norm(self.embed_tokens(input_ids))
            return BaseModelOutputWithPast(
                last_hidden_state=hidden_states,
                cache=None,
            )


    class LlamaForCausalLM(nn.Module):
        def forward(self, input_ids, **kwargs) -> CausalLMOutputWithPast | tuple:
            outputs: BaseModelOutputWithPast = self.model(input_ids=input_ids, **kwargs)
            return outputs
    """)

AFTER = dedent("""\
    import torch

    from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast


    class LlamaModel(nn.Module):
        def forward(self, input_ids, position_ids=None, **kwargs):
            hidden_states = self.norm(self.embed_tokens(input_ids))
            return hidden_states


    class LlamaForCausalLM(nn.Module):
        def forward(self, input_ids, **kwargs):
            outputs = self.model(input_ids=input_ids, **kwargs)
            return outputs
    """)


def test_outputs_become_tensors(run_rule):
    assert run_rule(rule, BEFORE) == AFTER


def test_idempotent(run_rule):
    assert run_rule(rule, AFTER) == AFTER


def test_torch_annotations_and_plain_returns_untouched(run_rule):
    code = dedent("""\
        import torch

        from transformers.modeling_outputs import BaseModelOutputWithPast


        class LlamaRMSNorm(nn.Module):
            def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
                return hidden_states


        class LlamaAttention(nn.Module):
            def forward(self, hidden_states) -> tuple[torch.Tensor, torch.Tensor | None]:
                return hidden_states, None


        def make(x) -> dict:
            return dict(hidden=x)
        """)
    assert run_rule(rule, code) == code


def test_a_wrapper_reads_the_inner_models_tensor(run_rule):
    # OPTModel (v5) returns what its OPTDecoder returned, read off the output dataclass.
    code = dedent("""\
        from transformers.modeling_outputs import BaseModelOutputWithPast


        class OPTModel(nn.Module):
            def forward(self, input_ids, **kwargs):
                decoder_outputs: BaseModelOutputWithPast = self.decoder(input_ids=input_ids, **kwargs)
                return decoder_outputs.last_hidden_state
        """)
    out = run_rule(rule, code)
    assert (
        "decoder_outputs = self.decoder(input_ids=input_ids, **kwargs)\n        return decoder_outputs\n"
        in out
    )
    assert run_rule(rule, out) == out
