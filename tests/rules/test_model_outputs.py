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


def test_a_wrapper_indexing_an_in_file_models_output_reads_the_tensor(run_rule):
    # BertGenerationEncoder (v5) takes `encoder_outputs[0]` off its BertEncoder's output dataclass; the first
    # element of another module's plain tensor result stays an index.
    code = dedent("""\
        class BertEncoder(nn.Module):
            def forward(self, hidden_states, **kwargs):
                return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=hidden_states)


        class BertGenerationEncoder(nn.Module):
            def __init__(self, config):
                self.encoder = BertEncoder(config)
                self.pooler = Pooler(config)

            def forward(self, input_ids, **kwargs):
                encoder_outputs = self.encoder(self.embeddings(input_ids), **kwargs)
                pooled = self.pooler(encoder_outputs[0])
                return encoder_outputs[0] + pooled[0]
        """)
    out = run_rule(rule, code)
    assert "return hidden_states\n" in out
    assert "pooled = self.pooler(encoder_outputs)\n" in out
    assert "return encoder_outputs + pooled[0]\n" in out
    assert run_rule(rule, out) == out
