"""remove_mask_machinery: statements building HF 4-D masks, what derives from them, and the keyword
arguments forwarding them disappear."""

from textwrap import dedent

import pytest

from skills.migrator.rules.remove_mask_machinery import RemoveMaskMachinery as rule

# LlamaModel.forward (transformers v5), after the HF-only parameters were folded away.
LLAMA = dedent("""\
    class LlamaModel(LlamaPreTrainedModel):
        def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, **kwargs):
            inputs_embeds = self.embed_tokens(input_ids)
            causal_mask = create_causal_mask(
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                cache=cache,
                position_ids=position_ids,
            )

            hidden_states = inputs_embeds
            position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)

            for decoder_layer in self.layers[: self.config.num_hidden_layers]:
                hidden_states = decoder_layer(
                    hidden_states,
                    attention_mask=causal_mask,
                    position_embeddings=position_embeddings,
                    position_ids=position_ids,
                    **kwargs,
                )
            return self.norm(hidden_states)
    """)

LLAMA_AFTER = dedent("""\
    class LlamaModel(LlamaPreTrainedModel):
        def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, **kwargs):
            inputs_embeds = self.embed_tokens(input_ids)

            hidden_states = inputs_embeds
            position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)

            for decoder_layer in self.layers[: self.config.num_hidden_layers]:
                hidden_states = decoder_layer(
                    hidden_states,
                    position_embeddings=position_embeddings,
                    position_ids=position_ids,
                    **kwargs,
                )
            return self.norm(hidden_states)
    """)

# Gemma3TextModel.forward: walrus on the mask dict, kwargs dicts, two factories, a mapping indexed per layer.
GEMMA3 = dedent("""\
    class Gemma3TextModel(Gemma3PreTrainedModel):
        def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, **kwargs):
            inputs_embeds = self.embed_tokens(input_ids)
            # It may already have been prepared by e.g. `generate`
            if not isinstance(causal_mask_mapping := attention_mask, dict):
                # Prepare mask arguments
                mask_kwargs = {
                    "config": self.config,
                    "inputs_embeds": inputs_embeds,
                    "attention_mask": attention_mask,
                    "cache": cache,
                    "position_ids": position_ids,
                }
                sliding_mask_kwargs = mask_kwargs.copy()

                if self.config.use_bidirectional_attention:
                    mask_kwargs["or_mask_function"] = lambda *args: torch.tensor(True, dtype=torch.bool)
                    sliding_mask_kwargs["or_mask_function"] = _bidirectional_window_overlay(self.config.sliding_window)

                # Create the masks
                causal_mask_mapping = {
                    "full_attention": create_causal_mask(**mask_kwargs),
                    "sliding_attention": create_sliding_window_causal_mask(**sliding_mask_kwargs),
                }

            # embed positions
            hidden_states = inputs_embeds
            position_embeddings = {}
            for layer_type in set(self.config.layer_types):
                position_embeddings[layer_type] = self.rotary_emb(hidden_states, position_ids, layer_type)

            for i, decoder_layer in enumerate(self.layers[: self.config.num_hidden_layers]):
                hidden_states = decoder_layer(
                    hidden_states,
                    attention_mask=causal_mask_mapping[self.config.layer_types[i]],
                    position_embeddings=position_embeddings[self.config.layer_types[i]],
                    position_ids=position_ids,
                    **kwargs,
                )
            return self.norm(hidden_states)
    """)

GEMMA3_AFTER = dedent("""\
    class Gemma3TextModel(Gemma3PreTrainedModel):
        def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, **kwargs):
            inputs_embeds = self.embed_tokens(input_ids)

            # embed positions
            hidden_states = inputs_embeds
            position_embeddings = {}
            for layer_type in set(self.config.layer_types):
                position_embeddings[layer_type] = self.rotary_emb(hidden_states, position_ids, layer_type)

            for i, decoder_layer in enumerate(self.layers[: self.config.num_hidden_layers]):
                hidden_states = decoder_layer(
                    hidden_states,
                    position_embeddings=position_embeddings[self.config.layer_types[i]],
                    position_ids=position_ids,
                    **kwargs,
                )
            return self.norm(hidden_states)
    """)

# MistralModel.forward: the factory is chosen by a conditional expression, then called by its local name.
MISTRAL = dedent("""\
    class MistralModel(MistralPreTrainedModel):
        def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, **kwargs):
            inputs_embeds = self.embed_tokens(input_ids)
            mask_function = create_causal_mask if self.config.sliding_window is None else create_sliding_window_causal_mask
            causal_mask = mask_function(
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                cache=cache,
                position_ids=position_ids,
            )
            hidden_states = inputs_embeds
            for decoder_layer in self.layers[: self.config.num_hidden_layers]:
                hidden_states = decoder_layer(
                    hidden_states,
                    attention_mask=causal_mask,
                    position_ids=position_ids,
                    **kwargs,
                )
            return hidden_states
    """)

MISTRAL_AFTER = dedent("""\
    class MistralModel(MistralPreTrainedModel):
        def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, **kwargs):
            inputs_embeds = self.embed_tokens(input_ids)
            hidden_states = inputs_embeds
            for decoder_layer in self.layers[: self.config.num_hidden_layers]:
                hidden_states = decoder_layer(
                    hidden_states,
                    position_ids=position_ids,
                    **kwargs,
                )
            return hidden_states
    """)

CASES = pytest.mark.parametrize(
    "before,after",
    [(LLAMA, LLAMA_AFTER), (GEMMA3, GEMMA3_AFTER), (MISTRAL, MISTRAL_AFTER)],
    ids=["llama", "gemma3", "mistral"],
)


@CASES
def test_mask_machinery_removed(run_rule, before, after):
    assert run_rule(rule, before) == after


@CASES
def test_idempotent(run_rule, before, after):
    assert run_rule(rule, after) == after


def test_functions_that_build_no_mask_untouched(run_rule):
    # eager_attention_forward *uses* an attention_mask parameter and LlamaRotaryEmbedding has a
    # `mask`-named local; neither builds a mask, so nothing goes.
    code = dedent("""\
        def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
            attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
            if attention_mask is not None:
                attn_weights = attn_weights + attention_mask
            attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
            return attn_weights


        class LlamaDecoderLayer(GradientCheckpointingLayer):
            def forward(self, hidden_states, attention_mask=None, **kwargs):
                padding_mask = attention_mask
                hidden_states = self.self_attn(hidden_states, attention_mask=padding_mask, **kwargs)
                return hidden_states
        """)
    assert run_rule(rule, code) == code


# BlenderbotDecoder.forward (BlenderbotForCausalLM's decoder) passes the mask positionally.
BLENDERBOT = dedent("""\
    class BlenderbotDecoder(BlenderbotPreTrainedModel):
        def forward(self, input_ids, attention_mask=None, encoder_hidden_states=None, cache=None, **kwargs):
            inputs_embeds = self.embed_tokens(input_ids)
            causal_mask = create_causal_mask(
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                cache=cache,
            )
            hidden_states = inputs_embeds
            for idx, decoder_layer in enumerate(self.layers):
                layer_outputs = decoder_layer(
                    hidden_states,
                    causal_mask,
                    encoder_hidden_states,  # as a positional argument for gradient checkpointing
                    cache=cache,
                    **kwargs,
                )
                hidden_states = layer_outputs[0] if isinstance(layer_outputs, tuple) else layer_outputs
            hidden_states = self.layer_norm(hidden_states)
            return hidden_states
    """)


def test_positional_mask_argument(run_rule, make_ctx):
    ctx = make_ctx(entry_class="BlenderbotForCausalLM")
    out = run_rule(rule, BLENDERBOT, ctx)
    assert "create_causal_mask" not in out
    # Either the positional mask is dropped (loop and return kept) or the construct is reported.
    assert (
        "for idx, decoder_layer in enumerate(self.layers):" in out and "return hidden_states" in out
    ) or ctx.findings


# ZambaModel.forward (v5) passes entries of its mask dict positionally.
ZAMBA = dedent("""\
    def forward(self, hidden_states, attention_mask, cache=None):
        causal_mask_mapping = {
            "full_attention": create_causal_mask(hidden_states, attention_mask),
            "linear_attention": create_recurrent_attention_mask(hidden_states, attention_mask),
        }
        for layer_idx, layer in enumerate(self.layers):
            hidden_states = layer(
                hidden_states,
                layer_idx,
                causal_mask_mapping["linear_attention"],
                causal_mask_mapping["full_attention"],
                cache=cache,
            )
        return hidden_states
    """)


def test_positional_entries_of_a_mask_dict_become_none(run_rule):
    out = run_rule(rule, ZAMBA)
    assert "create_causal_mask" not in out and "causal_mask_mapping" not in out
    assert "            None,\n            None,\n            cache=cache," in out
    assert "for layer_idx, layer in enumerate(self.layers):" in out and "return hidden_states" in out
    assert run_rule(rule, out) == out


# BeamModel.forward (v5): the mask loop and the rotary loop share their loop variable.
SHARED_LOOP_VARIABLE = dedent("""\
    def forward(self, hidden_states, position_ids):
        causal_mask_mapping = {}
        for layer_type in set(self.config.layer_types):
            causal_mask_mapping[layer_type] = create_causal_mask(hidden_states)
        position_embeddings = {}
        for layer_type in set(self.config.layer_types):
            position_embeddings[layer_type] = self.rotary_emb(hidden_states, position_ids, layer_type)
        for i, layer in enumerate(self.layers):
            layer_type = self.config.layer_types[i]
            hidden_states = layer(
                hidden_states,
                attention_mask=causal_mask_mapping[layer_type],
                position_embeddings=position_embeddings[layer_type],
            )
        return hidden_states
    """)


def test_a_loop_variable_shared_with_the_mask_loop_is_not_a_mask(run_rule):
    lines = SHARED_LOOP_VARIABLE.splitlines(keepends=True)
    # the mask dict, the loop filling it and the argument passing it go; the rotary loop stays whole
    assert run_rule(rule, SHARED_LOOP_VARIABLE) == "".join(lines[:1] + lines[4:11] + lines[12:])


def test_a_statement_binding_a_mask_beside_other_values_stays(run_rule):
    # Gemma4UnifiedTextModel.forward (v5) slices hidden states, positions and masks in one call.
    code = dedent("""\
        def forward(self, hidden_states, position_embeddings):
            causal_mask_mapping = {"full_attention": create_causal_mask(hidden_states)}
            hidden_states, position_embeddings, causal_mask_mapping = self.slice_inputs(
                hidden_states, position_embeddings, causal_mask_mapping
            )
            return self.layer(hidden_states, position_embeddings, mask=causal_mask_mapping["full_attention"])
        """)
    assert run_rule(rule, code) == dedent("""\
        def forward(self, hidden_states, position_embeddings):
            hidden_states, position_embeddings, causal_mask_mapping = self.slice_inputs(
                hidden_states, position_embeddings, None
            )
            return self.layer(hidden_states, position_embeddings)
        """)


MASK_METHOD = dedent("""\
    class Model(nn.Module):
        def forward(self, input_ids, position_ids, attention_mask=None, encoder_attention_mask=None):
            hidden = self.embeddings(input_ids, position_ids)
            attention_mask, encoder_attention_mask = self._create_attention_masks(attention_mask, hidden)
            return self.encoder(hidden, attention_mask=attention_mask, cross_mask=encoder_attention_mask)

        def _create_attention_masks(self, attention_mask, hidden):
            return create_causal_mask(attention_mask, hidden), None

        def embed(self, input_ids):
            return self.embeddings(input_ids)
    """)


def test_a_mask_factory_method_goes_with_its_calls(run_rule):
    # BertGeneration (v5) builds its masks in `self._create_attention_masks(...)`.
    out = run_rule(rule, MASK_METHOD)
    assert out == dedent("""\
        class Model(nn.Module):
            def forward(self, input_ids, position_ids, attention_mask=None, encoder_attention_mask=None):
                hidden = self.embeddings(input_ids, position_ids)
                return self.encoder(hidden)

            def embed(self, input_ids):
                return self.embeddings(input_ids)
        """)
    assert run_rule(rule, out) == out


def test_a_mask_factory_method_still_referenced_stays(run_rule):
    code = MASK_METHOD.replace("self.embeddings(input_ids)\n", "Model._create_attention_masks\n")
    assert "def _create_attention_masks" in run_rule(rule, code)


def test_a_mask_method_that_computes_model_maths_stays(run_rule):
    # Doge's `prepare_dynamic_mask` is an attention bias from the hidden states, not HF's padding mask.
    code = dedent("""\
        class DogeAttention(nn.Module):
            def forward(self, hidden_states, attention_mask=None):
                attn_mask = self.prepare_dynamic_mask(hidden_states, self.dt_proj(hidden_states))
                return self.attend(hidden_states, attn_mask)

            def prepare_dynamic_mask(self, hidden_states, dt_states):
                return dt_states.topk(4).values
        """)
    assert run_rule(rule, code) == code


# BertGenerationEncoder.forward (v5): causal only when its config says it is a decoder.
KEYED_ON_IS_DECODER = dedent("""\
    class BertGenerationEncoder(nn.Module):
        def forward(self, input_ids, attention_mask=None):
            embedding_output = self.embeddings(input_ids)
            if self.config.is_decoder:
                attention_mask = create_causal_mask(self.config, embedding_output, attention_mask)
            else:
                attention_mask = create_bidirectional_mask(self.config, embedding_output, attention_mask)
            return self.encoder(embedding_output, attention_mask=attention_mask)
    """)


@pytest.mark.parametrize("is_decoder", [True, False])
def test_a_config_that_is_not_a_decoder_is_refused_where_the_mask_depends_on_it(
    run_rule, make_ctx, is_decoder
):
    from transformers import BertGenerationConfig

    ctx = make_ctx(checkpoint_config=BertGenerationConfig(is_decoder=is_decoder))
    out = run_rule(rule, KEYED_ON_IS_DECODER, ctx)
    assert "mask" not in out.replace("attention_mask=None", "")
    assert [f.what.split(",")[0] for f in ctx.findings] == (
        [] if is_decoder else ["the checkpoint's config has `is_decoder: false`"]
    )
