"""fold_hf_only_params: HF-only parameters leave every signature; branches on their known values fold."""

from functools import partial
from textwrap import dedent, indent

import pytest
from codemod_harness import assert_codemod, run_codemod
from transformers import TrOCRConfig

from skills.migrator.rules.fold_hf_only_params import FoldHFOnlyParams as rule

# LlamaModel.forward, transformers v5.
LLAMA_MODEL = dedent("""\
    class LlamaModel(LlamaPreTrainedModel):
        def forward(
            self,
            input_ids: torch.LongTensor | None = None,
            attention_mask: torch.Tensor | None = None,
            position_ids: torch.LongTensor | None = None,
            cache: Cache | None = None,
            inputs_embeds: torch.Tensor | None = None,
            use_cache: bool | None = None,
            **kwargs: Unpack[TransformersKwargs],
        ) -> BaseModelOutputWithPast:
            if (input_ids is None) ^ (inputs_embeds is not None):
                raise ValueError("You must specify exactly one of input_ids or inputs_embeds")

            if inputs_embeds is None:
                inputs_embeds: torch.Tensor = self.embed_tokens(input_ids)

            if use_cache and cache is None:
                cache = DynamicCache(config=self.config)

            if position_ids is None:
                past_seen_tokens = cache.get_seq_length() if cache is not None else 0
                position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
                position_ids = position_ids.unsqueeze(0)

            hidden_states = inputs_embeds
            for decoder_layer in self.layers[: self.config.num_hidden_layers]:
                hidden_states = decoder_layer(
                    hidden_states,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    cache=cache,
                    use_cache=use_cache,
                    **kwargs,
                )
            return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache if use_cache else None)
    """)

LLAMA_MODEL_AFTER = dedent("""\
    class LlamaModel(LlamaPreTrainedModel):
        def forward(
            self,
            input_ids: torch.LongTensor | None = None,
            position_ids: torch.LongTensor | None = None,
            **kwargs,
        ) -> BaseModelOutputWithPast:
            inputs_embeds: torch.Tensor = self.embed_tokens(input_ids)

            hidden_states = inputs_embeds
            for decoder_layer in self.layers[: self.config.num_hidden_layers]:
                hidden_states = decoder_layer(
                    hidden_states,
                    position_ids=position_ids,
                    **kwargs,
                )
            return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=None)
    """)


def test_llama_model_forward(run_rule):
    # `(input_ids is None) ^ (inputs_embeds is not None)` is False under the contract: the check goes;
    # `inputs_embeds is None` is True: the body is inlined; position_ids is always given.
    assert run_rule(rule, LLAMA_MODEL) == LLAMA_MODEL_AFTER


def test_idempotent(run_rule):
    assert run_rule(rule, LLAMA_MODEL_AFTER) == LLAMA_MODEL_AFTER


def test_if_elif_else_chains(run_rule):
    code = dedent("""\
        def forward(self, hidden_states, output_attentions=False, use_cache=False, labels=None, **kwargs):
            if output_attentions:
                a = 1
            elif use_cache:
                b = 2
            elif hidden_states.dim() == 3:
                c = 3
            else:
                d = 4
            if hidden_states.dim() == 2:
                e = 5
            elif labels is None:
                f = 6
            else:
                g = 7
            if hidden_states.dim() == 4:
                h = 8
            elif labels is not None:
                i = 9
            if not output_attentions:
                j = 10
            else:
                k = 11
            return hidden_states
        """)
    assert run_rule(rule, code) == dedent("""\
        def forward(self, hidden_states, **kwargs):
            if hidden_states.dim() == 3:
                c = 3
            else:
                d = 4
            if hidden_states.dim() == 2:
                e = 5
            else:
                f = 6
            if hidden_states.dim() == 4:
                h = 8
            j = 10
            return hidden_states
        """)


def test_reassignment_ends_constness(run_rule):
    code = dedent("""\
        def forward(self, hidden_states, attention_mask=None, use_cache=None, **kwargs):
            if attention_mask is None:
                a = 1
            attention_mask = self.make_mask(hidden_states)
            if attention_mask is None:
                b = 2
            use_cache = use_cache if use_cache is not None else self.config.use_cache
            if use_cache:
                c = 3
            return hidden_states, attention_mask
        """)
    assert run_rule(rule, code) == dedent("""\
        def forward(self, hidden_states, **kwargs):
            a = 1
            attention_mask = self.make_mask(hidden_states)
            if attention_mask is None:
                b = 2
            use_cache = False
            return hidden_states, attention_mask
        """)


def test_reassignment_inside_a_branch_or_loop_ends_constness_after_it(run_rule):
    code = dedent("""\
        def forward(self, hidden_states, cache=None, **kwargs):
            if hidden_states.dim() == 2:
                cache = self.new_cache()
            if cache is not None:
                hidden_states = cache.update(hidden_states)
            for cache in self.caches:
                if cache is None:
                    continue
            return hidden_states
        """)
    assert run_rule(rule, code) == dedent("""\
        def forward(self, hidden_states, **kwargs):
            if hidden_states.dim() == 2:
                cache = self.new_cache()
            if cache is not None:
                hidden_states = cache.update(hidden_states)
            for cache in self.caches:
                if cache is None:
                    continue
            return hidden_states
        """)


def test_forwarded_keywords_dropped_and_non_read_positions_untouched(run_rule):
    # LlamaForCausalLM.forward: keyword arguments forwarding removed names go; attribute names, keyword
    # names and assignment targets spelled like a removed parameter are not reads and stay.
    code = dedent("""\
        def forward(self, input_ids=None, attention_mask=None, cache=None, inputs_embeds=None, labels=None,
                    use_cache=None, logits_to_keep=0, **kwargs: Unpack[TransformersKwargs]):
            outputs = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                cache=cache,
                inputs_embeds=inputs_embeds,
                use_cache=use_cache,
                **kwargs,
            )
            self.use_cache = self.config.use_cache
            helper(use_cache=True, labels=self.labels)
            hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
            loss = None
            if labels is not None:
                loss = self.loss_function(logits=hidden_states, labels=labels, **kwargs)
            return loss, hidden_states
        """)
    assert run_rule(rule, code) == dedent("""\
        def forward(self, input_ids=None, **kwargs):
            outputs = self.model(
                input_ids=input_ids,
                **kwargs,
            )
            self.use_cache = self.config.use_cache
            helper(use_cache=True, labels=self.labels)
            hidden_states = slice_logits_to_keep(outputs.last_hidden_state, 0)
            loss = None
            return loss, hidden_states
        """)


def test_positional_reads_become_literals(run_rule):
    code = dedent("""\
        def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
            attn_output, attn_weights = attention_interface(self, hidden_states, attention_mask, **kwargs)
            return attn_output, cache
        """)
    assert run_rule(rule, code) == dedent("""\
        def forward(self, hidden_states, position_embeddings, **kwargs):
            attn_output, attn_weights = attention_interface(self, hidden_states, None, **kwargs)
            return attn_output, None
        """)


def test_functions_without_hf_only_params_untouched(run_rule):
    # LlamaRotaryEmbedding / rotate_half / eager attention: no HF-only parameter, plain **kwargs, and
    # reads of HF-only *names* that are not parameters (attributes, locals) stay.
    code = dedent("""\
        def rotate_half(x):
            x1 = x[..., : x.shape[-1] // 2]
            x2 = x[..., x.shape[-1] // 2 :]
            return torch.cat((-x2, x1), dim=-1)


        class LlamaRotaryEmbedding(nn.Module):
            def forward(self, x, position_ids, **kwargs):
                use_cache = self.config.use_cache
                if use_cache and self.labels is None:
                    x = x * 2
                return x, position_ids
        """)
    assert run_rule(rule, code) == code


# CTRLModel.forward (v5): the flag is re-derived from the config, then the cache reaches layers as layer_past.
CTRL = dedent("""\
    def forward(self, input_ids, cache=None, use_cache=None, **kwargs):
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        for h in self.h:
            hidden_states = h(input_ids, layer_past=cache)
        return hidden_states
    """)


def test_a_name_folded_to_a_literal_stays_known(run_rule):
    assert run_rule(rule, CTRL) == dedent("""\
        def forward(self, input_ids, **kwargs):
            use_cache = False
            for h in self.h:
                hidden_states = h(input_ids)
            return hidden_states
        """)


def test_a_name_reassigned_in_a_loop_is_not_known_inside_it(run_rule):
    code = dedent("""\
        def forward(self, x):
            last = None
            for layer in self.layers:
                if last is not None:
                    x = x + last
                last = layer(x)
            return x
        """)
    assert run_rule(rule, code) == code


# OPTDecoder (v5) hands its position mask to the learned positional embedding positionally.
OPT = dedent("""\
    class OPTLearnedPositionalEmbedding(nn.Embedding):
        def forward(self, attention_mask, cache_length: int = 0, position_ids=None):
            return super().forward(position_ids + cache_length)


    class OPTDecoder(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.embed_positions = OPTLearnedPositionalEmbedding(config.max_position_embeddings, config.hidden_size)

        def forward(self, input_ids, position_ids, **kwargs):
            position_attention_mask = torch.ones_like(input_ids)
            return self.embed_positions(position_attention_mask, 0, position_ids=position_ids)
    """)


def test_arguments_bound_to_a_removed_parameter_go_whatever_their_name(run_rule):
    out = run_rule(rule, OPT)
    assert "def forward(self, cache_length: int = 0, position_ids=None):" in out
    assert "return self.embed_positions(0, position_ids=position_ids)" in out
    assert run_rule(rule, out) == out


def test_blocks_called_in_an_enumerate_loop_lose_the_positional_arguments_too(run_rule):
    # GPT2Model.forward (v5) passes cache and mask to each block positionally.
    code = dedent("""\
        class GPT2Block(nn.Module):
            def forward(self, hidden_states, cache=None, attention_mask=None, token_type_ids=None, **kwargs):
                return hidden_states


        class GPT2Model(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.h = nn.ModuleList([GPT2Block(config) for i in range(config.num_hidden_layers)])

            def forward(self, hidden_states, position_ids, **kwargs):
                for i, block in enumerate(self.h):
                    hidden_states = block(hidden_states, None, None, None, position_ids=position_ids)
                return hidden_states
        """)
    out = run_rule(rule, code)
    assert "def forward(self, hidden_states, token_type_ids=None, **kwargs):" in out
    assert "hidden_states = block(hidden_states, None, position_ids=position_ids)" in out


TUPLE_CACHE = dedent("""\
    class Block(nn.Module):
        def forward(self, hidden_states, layer_past=None, use_cache=False):
            return hidden_states, None


    class Model(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])

        def forward(self, hidden_states, past_key_values=None, use_cache=None):
            past_key_values = tuple([None] * len(self.h))
            presents = () if use_cache else None
            for i, (block, layer_past) in enumerate(zip(self.h, past_key_values)):
                outputs = block(hidden_states, layer_past=layer_past, use_cache=use_cache)
                hidden_states = outputs[0]
                if use_cache is True:
                    presents = presents + (outputs[1],)
            return hidden_states, presents
    """)


def test_blocks_called_in_a_loop_over_a_zip_with_the_cache_tuple_lose_its_arguments(run_rule):
    # transformers 4.2x style: `for i, (block, layer_past) in enumerate(zip(self.h, past_key_values))`, and a
    # flag compared by identity once it is known (`use_cache is True`)
    out = run_rule(rule, TUPLE_CACHE)
    assert "def forward(self, hidden_states):" in out  # the block's cache parameters went
    assert "outputs = block(hidden_states)\n" in out  # with the arguments the loop passed them
    assert "is True" not in out and "presents + (outputs[1],)" not in out  # `False is True` is False
    assert run_rule(rule, out) == out
    for known in ("use_cache is not False", "use_cache is None"):  # False is not False, False is None
        assert "presents + (outputs[1],)" not in run_rule(
            rule, TUPLE_CACHE.replace("use_cache is True", known)
        )
    unknown = TUPLE_CACHE.replace("use_cache is True", "hidden_states is None")  # a value of the run
    assert "if hidden_states is None:" in run_rule(rule, unknown)


def _findings(run_rule, make_ctx, code: str, **ctx_overrides) -> list[tuple[str, str]]:
    """(scope, what) of each finding the rule makes on code."""
    ctx = make_ctx(**ctx_overrides)
    run_rule(rule, code, ctx)
    return [(f.scope, f.what) for f in ctx.findings]


def test_state_kept_in_a_cache_layer_is_refused_not_folded_away(run_rule, make_ctx):
    # DeepSeek-V4's compressors keep their pending windows in their cache layer between steps.
    code = dedent("""\
        class Compressor(nn.Module):
            def forward(self, hidden_states, cache, layer_idx):
                cache_layer = cache.layers[layer_idx] if cache is not None else None
                kv = self.kv_proj(hidden_states)
                if cache_layer is not None:
                    kv = cache_layer.store_windows(kv)
                return kv
        """)
    assert _findings(run_rule, make_ctx, code) == [
        (
            "Compressor",
            (
                "state kept in the cache besides keys and values (`store_windows`); "
                "the runtime caches per-token keys and values only"
            ),
        )
    ]


def test_reading_a_cache_layer_s_keys_is_not_a_finding(run_rule, make_ctx):
    code = dedent("""\
        class Attention(nn.Module):
            def forward(self, hidden_states, past_key_values=None):
                if past_key_values is not None:
                    key_states = past_key_values.layers[self.layer_idx].keys.transpose(1, 2)
                    seen = past_key_values.layers[0].get_seq_length()
                    keys = past_key_values.layers[self.layer_idx].keys
                    keys = keys.view(1, -1)
                return self.k_proj(hidden_states)
        """)
    ctx = make_ctx()
    run_rule(rule, code, ctx)
    assert ctx.findings == []


def test_a_removed_parameter_rebound_in_a_tuple_target_stays_a_name(run_rule):
    # BertGeneration: `attention_mask, encoder_attention_mask = self._create_attention_masks(...)`.
    code = dedent("""\
        def forward(self, x, attention_mask=None):
            attention_mask, other = self.masks(x)
            return x + attention_mask + other
        """)
    out = run_rule(rule, code)
    assert "attention_mask, other = self.masks(x)" in out
    assert "return x + attention_mask + other" in out
    assert run_rule(rule, out) == out


def test_a_literal_every_branch_agrees_on_is_known_after_the_if(run_rule):
    # BertGeneration: `use_cache` is False on both sides of `if self.config.is_decoder`, so the cache is
    # never built and its length is 0.
    code = dedent("""\
        def forward(self, x, cache=None, use_cache=None):
            if self.config.is_decoder:
                use_cache = use_cache if use_cache is not None else self.config.use_cache
            else:
                use_cache = False
            if use_cache and cache is None:
                cache = DynamicCache()
            if self.config.tie:
                flag = 1
            else:
                flag = 2
            return self.embed(x, cache.get_seq_length() if cache is not None else 0) + flag
        """)
    out = run_rule(rule, code)
    assert out.split("\n", 1)[1] == indent(
        dedent("""\
            use_cache = False
            if self.config.tie:
                flag = 1
            else:
                flag = 2
            return self.embed(x, 0) + flag
            """),
        "    ",
    )
    assert run_rule(rule, out) == out


def test_identical_branches_binding_a_name_in_their_test_stay(run_rule):
    code = dedent("""\
        def forward(self, x, use_cache=None):
            if (flag := self.flag):
                use_cache = False
            else:
                use_cache = False
            return x + flag
        """)
    assert "if (flag := self.flag):" in run_rule(rule, code)


# Gemma4TextModel (v5): a helper method called with the embeddings its caller has just computed.
PER_LAYER_INPUTS = dedent("""\
    class Gemma4TextModel(nn.Module):
        def forward(self, input_ids=None, inputs_embeds=None, use_cache=None, **kwargs):
            inputs_embeds = self.embed_tokens(input_ids)
            per_layer_inputs = self.get_per_layer_inputs(input_ids, inputs_embeds)
            return self.project(inputs_embeds, per_layer_inputs, use_cache)

        def get_per_layer_inputs(self, input_ids, inputs_embeds=None):
            if input_ids is None:
                input_ids = self.reverse(inputs_embeds)
            return self.embed_tokens_per_layer(input_ids)

        def project(self, inputs_embeds, per_layer_inputs, use_cache=None):
            if use_cache:
                return per_layer_inputs
            return inputs_embeds + per_layer_inputs
    """)


def test_a_helper_called_with_a_computed_value_keeps_that_parameter(run_rule):
    out = run_rule(rule, PER_LAYER_INPUTS)
    assert "def get_per_layer_inputs(self, input_ids, inputs_embeds=None):" in out
    assert "per_layer_inputs = self.get_per_layer_inputs(input_ids, inputs_embeds)" in out
    assert "input_ids = self.reverse(inputs_embeds)" in out  # not folded to None
    assert run_rule(rule, out) == out


def test_a_helper_called_with_a_folded_parameter_loses_it_with_its_arguments(run_rule):
    out = run_rule(rule, PER_LAYER_INPUTS)
    assert "def forward(self, input_ids=None, **kwargs):" in out
    assert "return self.project(inputs_embeds, per_layer_inputs)" in out
    assert "def project(self, inputs_embeds, per_layer_inputs):" in out  # inputs_embeds is not HF-only here
    assert "return inputs_embeds + per_layer_inputs" in out and "if use_cache" not in out


def test_state_kept_through_the_cache_s_own_methods_is_refused_too(run_rule, make_ctx):
    # ZAYA's CCA projection keeps a convolution window and the previous token's values in the cache.
    code = dedent("""\
        class ZayaCCAProjection(nn.Module):
            def forward(self, hidden_states, cache):
                if cache is not None:
                    cached = cache.get_conv_state(self.layer_idx, state_idx=0)
                    cache.update_conv_state(hidden_states[:, -2:], self.layer_idx)
                    cache.update_recurrent_state(hidden_states[:, -1], self.layer_idx)
                    keys, values = cache.update(hidden_states, hidden_states, self.layer_idx)
                return self.proj(hidden_states)
        """)
    ctx = make_ctx()
    run_rule(rule, code, ctx)
    assert [f.what.split(";")[0] for f in ctx.findings] == [
        "state kept in the cache besides keys and values (`update_conv_state`, `update_recurrent_state`)"
    ]


@pytest.mark.parametrize("positions", ["", ", position_ids=position_ids"])
def test_a_past_length_feeding_a_module_without_positions_is_refused(run_rule, make_ctx, positions):
    # TrOCR's decoder hands its positional embedding the cache's length, which folds to 0 under the runtime.
    code = dedent(f"""\
        class Decoder(nn.Module):
            def forward(self, input_ids, position_ids, cache=None):
                cache_length = cache.get_seq_length() if cache is not None else 0
                return self.embed_tokens(input_ids) + self.embed_positions(input_ids, cache_length{positions})
        """)
    ctx = make_ctx()
    run_rule(rule, code, ctx)
    refused = [f.what for f in ctx.findings]
    if positions:
        assert refused == []
    else:
        assert refused[0].startswith("the past length `cache_length` read from the cache feeds a module")


def test_a_past_length_building_what_nothing_reads_once_folded_is_not_refused(run_rule, make_ctx):
    # Remote code builds its causal mask from the cache's length; the layers' mask parameter folds away, so the
    # mask is dead code (MG012 removes it), not positions restarting at 0.
    code = dedent("""\
        class Layer(nn.Module):
            def forward(self, hidden_states, attention_mask=None):
                return self.mlp(hidden_states)


        class Model(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.layer = Layer(config)

            def forward(self, input_ids, cache=None):
                past = cache.get_seq_length() if cache is not None else 0
                causal = self._causal_mask(input_ids.shape[1], past)
                return self.layer(self.embed_tokens(input_ids), causal)
        """)
    ctx = make_ctx()
    run_rule(rule, code, ctx)
    assert ctx.findings == []
    read = code.replace(
        "self.layer(self.embed_tokens(input_ids), causal)", "self.embed_tokens(input_ids) + causal"
    )
    run_rule(rule, read, ctx)
    assert ctx.findings[0].what.startswith("the past length `past` read from the cache feeds a module")


POSITIONS_FROM_LENGTH = dedent("""\
    class LearnedPositions(nn.Embedding):
        def forward(self, input_ids, past_length=0, position_ids=None):
            if position_ids is None:
                position_ids = torch.arange(past_length, past_length + input_ids.shape[1])[None]
            else:
                position_ids = position_ids.unsqueeze(0)
            return super().forward(position_ids + 2)


    class CountedPositions(nn.Module):
        def forward(self, input_ids, past_length=0):
            return self.table[(input_ids != 1).cumsum(1) + past_length]


    class Decoder(PreTrainedModel):
        def __init__(self, config: TrOCRConfig):
            super().__init__(config)
            if config.use_learned_position_embeddings:
                self.embed_positions = LearnedPositions(config.max_position_embeddings, config.hidden_size)
            else:
                self.embed_positions = CountedPositions(config.max_position_embeddings, config.hidden_size)

        def forward(self, input_ids, cache=None, **kwargs):
            past_length = cache.get_seq_length() if cache is not None else 0
            if self.config.use_learned_position_embeddings:
                positions = self.embed_positions(input_ids, past_length=past_length)
            else:
                positions = self.embed_positions(input_ids, past_length)
            return self.layers(self.embed_tokens(input_ids) + positions, **kwargs)
    """)


GUARD = "'migrated for a checkpoint where `{}config.use_learned_position_embeddings` is true; '"
POSITIONS_GIVEN = POSITIONS_FROM_LENGTH[: POSITIONS_FROM_LENGTH.index("class Decoder")].replace(
    """        if position_ids is None:
            position_ids = torch.arange(past_length, past_length + input_ids.shape[1])[None]
        else:
            position_ids = position_ids.unsqueeze(0)
""",
    "        position_ids = position_ids.unsqueeze(0)\n",  # every call gives them now
) + dedent(f"""\
    class Decoder(PreTrainedModel):
        def __init__(self, config: TrOCRConfig):
            super().__init__(config)
            if not config.use_learned_position_embeddings:
                raise NotImplementedError({GUARD.format("")}
                    'run `skill migrate` on this checkpoint')
            self.embed_positions = LearnedPositions(config.max_position_embeddings, config.hidden_size)

        def forward(self, input_ids, position_ids=None, **kwargs):
            past_length = 0
            if not self.config.use_learned_position_embeddings:
                raise NotImplementedError({GUARD.format("self.")}
                    'run `skill migrate` on this checkpoint')
            positions = self.embed_positions(input_ids, position_ids=position_ids[0])
            return self.layers(self.embed_tokens(input_ids) + positions, **kwargs)
    """)


def test_a_past_length_feeding_a_module_that_takes_positions_becomes_them(make_ctx):
    # TrOCR's learned embedding computes arange(past, past + n) only when it is given no positions; the runtime
    # gives each token's. Its sinusoidal one counts non-pad tokens: the branch building it, untaken by this
    # checkpoint, becomes a guard, and the positions go to the embedding the checkpoint has (one row: it adds
    # the batch dimension itself).
    learned = partial(make_ctx, checkpoint_config=TrOCRConfig(use_learned_position_embeddings=True))
    assert_codemod(rule, POSITIONS_FROM_LENGTH, POSITIONS_GIVEN, learned)


def test_a_checkpoint_whose_module_computes_positions_otherwise_is_refused(make_ctx):
    ctx = make_ctx(checkpoint_config=TrOCRConfig(use_learned_position_embeddings=False))
    run_codemod(rule, POSITIONS_FROM_LENGTH, ctx)
    assert [f.what.split(";")[0] for f in ctx.findings] == [
        (
            "the past length `past_length` read from the cache feeds a module (positions computed from it) "
            "that does not take `position_ids`, which the runtime passes instead"
        )
    ]


def test_a_module_reading_the_past_length_beside_given_positions_keeps_the_refusal(make_ctx):
    # the length is read whether or not positions are given: they cannot stand in for it
    code = POSITIONS_FROM_LENGTH.replace("position_ids + 2", "position_ids + 2 + past_length")
    ctx = make_ctx(checkpoint_config=TrOCRConfig(use_learned_position_embeddings=True))
    out = run_codemod(rule, code, ctx)
    assert "position_ids=position_ids" not in out and len(ctx.findings) == 1


SLICED_TABLE = dedent("""\
    class Transformer(nn.Module):
        def forward(self, tokens, cache=None):
            seqlen = tokens.shape[1]
            start_pos = cache.get_seq_length() if cache is not None else 0
            freqs_cis = self.freqs_cis[start_pos : start_pos + seqlen]
            return self.layers(self.tok_embeddings(tokens), freqs_cis)


    class MetaLM(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.model = Transformer(config)
    """)


def test_a_table_sliced_from_the_past_length_reads_the_rows_of_the_given_positions(make_ctx):
    entry = partial(make_ctx, entry_class="MetaLM")  # whose inner model the runtime's positions enter
    # Meta's reference Llama: the rotary table's rows [start_pos, start_pos + seqlen) are the current tokens'
    # positions, which the runtime gives (one row of [1, T])
    after = dedent("""\
        class Transformer(nn.Module):
            def forward(self, tokens, position_ids=None):
                seqlen = tokens.shape[1]
                start_pos = 0
                freqs_cis = self.freqs_cis[position_ids[0]]
                return self.layers(self.tok_embeddings(tokens), freqs_cis)


        class MetaLM(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.model = Transformer(config)
        """)
    assert_codemod(rule, SLICED_TABLE, after, entry)
    # a module the entry does not call is not given positions: nothing to read the rows with
    assert "position_ids" not in run_codemod(rule, SLICED_TABLE, make_ctx())
    for other in ("[start_pos : seqlen]", "[start_pos : start_pos + seqlen : 2]", "[0 : start_pos + seqlen]"):
        kept = SLICED_TABLE.replace("[start_pos : start_pos + seqlen]", other)  # not the current tokens' rows
        assert "position_ids" not in run_codemod(rule, kept, entry())
    own_row = SLICED_TABLE.replace(  # given one row, to which it adds the batch dimension: `[0]` would cut it
        "def forward(self, tokens, cache=None):\n",
        "def forward(self, tokens, position_ids, cache=None):\n        position_ids = position_ids.unsqueeze(0)\n",
    )
    assert "self.freqs_cis[position_ids[0]]" not in run_codemod(rule, own_row, entry())


ARANGED = dedent("""\
    class Model(nn.Module):
        def forward(self, input_ids, past_key_values=None):
            if past_key_values is None:
                past_length = 0
            else:
                past_length = past_key_values[0][0].size(-2)
            position_ids = torch.arange(past_length, input_ids.shape[-1] + past_length, device=input_ids.device)
            return self.h(self.wte(input_ids) + self.wpe(position_ids.unsqueeze(0)))


    class LM(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.transformer = Model(config)
    """)


@pytest.mark.parametrize("read", ["past_key_values[0][0].size(-2)", "past_key_values[0][0].shape[2]"])
def test_positions_ranged_from_a_tuple_cache_s_length_are_the_given_ones(make_ctx, read):
    # GPT-2 of transformers 4.2x without a position_ids parameter: arange(past, n + past) off the first keys
    code = ARANGED.replace("past_key_values[0][0].size(-2)", read)
    after = dedent("""\
        class Model(nn.Module):
            def forward(self, input_ids, position_ids=None):
                past_length = 0
                position_ids = position_ids[0]
                return self.h(self.wte(input_ids) + self.wpe(position_ids.unsqueeze(0)))


        class LM(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.transformer = Model(config)
        """)
    entry = partial(make_ctx, entry_class="LM")
    assert_codemod(rule, code, after, entry)
    for step in ("2)", "step=2)"):  # every other position: not the tokens'
        stepped = code.replace("device=input_ids.device)", step)
        assert "position_ids[0]" not in run_codemod(rule, stepped, entry())


def test_return_dict_folds_to_the_hidden_states_form(run_rule):
    """The runtime reads hidden states, never HF's tuple form: `return_dict` is True (Falcon, BLOOM, MPT)."""
    before = dedent("""\
        class FalconModel(nn.Module):
            def forward(self, input_ids, return_dict: bool | None = None):
                return_dict = return_dict if return_dict is not None else self.config.return_dict
                hidden_states = self.h(input_ids)
                if not return_dict:
                    return tuple(v for v in [hidden_states, None] if v is not None)
                return hidden_states
        """)
    after = dedent("""\
        class FalconModel(nn.Module):
            def forward(self, input_ids):
                return_dict = True
                hidden_states = self.h(input_ids)
                return hidden_states
        """)
    assert run_rule(rule, before) == after
    assert run_rule(rule, after) == after


# XGLM's attention and decoder layer, shortened: cross-attention reads an encoder's states.
CROSS_ATTENTION = dedent("""\
    class XGLMAttention(nn.Module):
        def forward(self, hidden_states, key_value_states: torch.Tensor | None = None, **kwargs):
            is_cross_attention = key_value_states is not None
            current_states = key_value_states if is_cross_attention else hidden_states
            return self.o_proj(self.k_proj(current_states))


    class XGLMDecoderLayer(nn.Module):
        def forward(self, hidden_states, encoder_hidden_states: torch.Tensor | None = None, **kwargs):
            hidden_states = hidden_states + self.self_attn(hidden_states, **kwargs)
            if encoder_hidden_states is not None:
                hidden_states = hidden_states + self.encoder_attn(
                    hidden_states, key_value_states=encoder_hidden_states, **kwargs
                )
            return hidden_states
    """)


def test_encoder_states_are_none_for_a_decoder_only_runtime(run_rule):
    """No encoder runs beside a causal LM: cross-attention inputs are None, and a flag tested on them is False."""
    after = dedent("""\
        class XGLMAttention(nn.Module):
            def forward(self, hidden_states, **kwargs):
                is_cross_attention = False
                current_states = hidden_states
                return self.o_proj(self.k_proj(current_states))


        class XGLMDecoderLayer(nn.Module):
            def forward(self, hidden_states, **kwargs):
                hidden_states = hidden_states + self.self_attn(hidden_states, **kwargs)
                return hidden_states
        """)
    assert run_rule(rule, CROSS_ATTENTION) == after
    assert run_rule(rule, after) == after


def test_a_flag_tested_on_a_value_known_only_at_run_time_stays(run_rule):
    code = CROSS_ATTENTION.replace("key_value_states is not None", "hidden_states is not None")
    assert "is_cross_attention = hidden_states is not None" in run_rule(rule, code)


def test_a_cross_attention_class_of_its_own_keeps_the_encoder_states_it_computes_on(run_rule):
    # BERT's BertCrossAttention: the model no longer calls it, and None.shape would be no code to leave behind.
    code = dedent("""\
        class BertCrossAttention(nn.Module):
            def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
                kv_shape = (*encoder_hidden_states.shape[:-1], -1, self.head_size)
                key = self.key(encoder_hidden_states).view(kv_shape)
                return self.attn(self.query(hidden_states), key, attention_mask)
        """)
    expected = code.replace(", attention_mask=None, **kwargs)", ", **kwargs)").replace(
        "key, attention_mask)", "key, None)"
    )
    assert run_rule(rule, code) == expected


def test_a_parameter_the_body_rebinds_still_leaves_the_signature(run_rule):
    code = dedent("""\
        class Embeddings(nn.Module):
            def forward(self, input_ids, inputs_embeds=None):
                if inputs_embeds is None:
                    inputs_embeds = self.word_embeddings(input_ids)
                return inputs_embeds
        """)
    assert "def forward(self, input_ids):" in run_rule(rule, code)


def test_a_conditional_whose_sides_fold_to_the_same_value_is_that_value(run_rule):
    code = dedent("""\
        class BertAttention(nn.Module):
            def forward(self, hidden_states, encoder_attention_mask=None):
                mask = None if not self.is_cross_attention else encoder_attention_mask
                return self.self(hidden_states, mask)
        """)
    assert "        mask = None\n" in run_rule(rule, code)


HIERARCHICAL = dedent("""\
    class GlobalTransformer(nn.Module):
        def forward(self, input_ids=None, inputs_embeds=None, attention_mask=None, position_ids=None):
            if inputs_embeds is None:
                inputs_embeds = self.embed(input_ids)
            return self.layers(inputs_embeds, position_ids)

    class LlamaModel(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.global_transformer = GlobalTransformer(config)

        def forward(self, input_ids, position_ids=None, inputs_embeds=None, attention_mask=None):
            patches = self.encoder(input_ids)
            return self.global_transformer(inputs_embeds=patches, attention_mask=attention_mask, position_ids=position_ids)

    class LlamaForCausalLM(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.model = LlamaModel(config)

        def forward(self, input_ids, inputs_embeds=None):
            return self.model(input_ids=input_ids, inputs_embeds=inputs_embeds)
    """)


def test_embeddings_computed_for_a_module_are_refused_not_folded_away(run_rule, make_ctx):
    # BLT feeds its global transformer the local encoder's patch states as `inputs_embeds`: folding the parameter
    # away would leave it nothing to compute on
    assert _findings(run_rule, make_ctx, HIERARCHICAL) == [
        (
            "GlobalTransformer",
            (
                "its forward is passed `inputs_embeds=patches`, computed at run time; the runtime feeds a causal LM "
                "token ids only and folds `inputs_embeds` away, which would lose that input"
            ),
        )
    ]


def test_embeddings_forwarded_from_the_callers_own_parameter_fold_away(run_rule, make_ctx):
    # the caller's own `inputs_embeds` (None under the runtime contract) is what a causal LM passes down
    code = HIERARCHICAL.replace("inputs_embeds=patches", "inputs_embeds=inputs_embeds")
    ctx = make_ctx()
    out = run_rule(rule, code, ctx)
    assert ctx.findings == []
    assert "return self.global_transformer(position_ids=position_ids)" in out
    assert run_rule(rule, out) == out


def test_embeddings_computed_in_a_class_the_entry_does_not_reach_are_not_a_finding(run_rule, make_ctx):
    # a vision head in the same file (Aria's projector) is pruned later; only the entry's classes count
    assert _findings(run_rule, make_ctx, HIERARCHICAL, entry_class="GlobalTransformer") == []


def test_a_module_built_only_under_a_condition_loses_the_arguments_of_removed_parameters(run_rule):
    # GLM-5's attention builds its indexer only on some layers and calls it under `if self.indexer is not None:`
    code = dedent("""\
        class Indexer(nn.Module):
            def forward(self, hidden_states, attention_mask, position_ids):
                return hidden_states


        class Attention(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.indexer = None if config.shared else Indexer(config)

            def forward(self, hidden_states, attention_mask, position_ids):
                if self.indexer is not None:
                    hidden_states = self.indexer(hidden_states, attention_mask[:, 0], position_ids)
                return hidden_states
        """)
    out = run_rule(rule, code)
    assert "def forward(self, hidden_states, position_ids):" in out
    assert "hidden_states = self.indexer(hidden_states, position_ids)" in out


def test_a_module_level_helper_loses_the_folded_parameter_and_its_arguments(run_rule):
    # LFM2's short convolution zeroes padding through a function of the module, handed the attention mask.
    code = dedent("""\
        def apply_mask_to_padding_states(hidden_states, attention_mask):
            if attention_mask is not None:
                hidden_states = hidden_states * attention_mask[:, :, None]
            return hidden_states


        class ShortConv(nn.Module):
            def forward(self, hidden_states, attention_mask=None):
                return apply_mask_to_padding_states(hidden_states, attention_mask)
        """)
    out = run_rule(rule, code)
    assert "def apply_mask_to_padding_states(hidden_states):" in out
    assert "return apply_mask_to_padding_states(hidden_states)" in out
    assert run_rule(rule, out) == out


MIXED_LAYERS = dedent("""\
    class HybridLayer(nn.Module):
        def forward(self, hidden_states, layer_idx=None, attention_mask=None, causal_mask=None, cache=None):
            return hidden_states


    class MambaLayer(nn.Module):
        def forward(self, hidden_states, layer_idx=None, attention_mask=None, causal_mask=None, cache=None):
            return hidden_states


    class Model(nn.Module):
        def __init__(self, config):
            super().__init__()
            layers = []
            for i, kind in enumerate(config.kinds):
                mamba = MambaLayer(config)
                layers.append(HybridLayer(config) if kind == "hybrid" else mamba)
                layers.append(mamba)
            self.layers = nn.ModuleList(layers)

        def forward(self, hidden_states, cache=None):
            for i, layer in enumerate(self.layers):
                hidden_states = layer(hidden_states, i, None, None, cache=cache)
            return hidden_states
    """)


def test_a_list_of_several_classes_loses_the_arguments_all_of_them_fold(run_rule):
    # ZambaModel (v5) appends hybrid layers and Mamba layers (built into a local first) to one list, and passes
    # each the masks positionally.
    code = MIXED_LAYERS.replace(
        'layers.append(HybridLayer(config) if kind == "hybrid" else mamba)',
        "layers.append(HybridLayer(config))",
    )
    out = run_rule(rule, code)
    assert out.count("def forward(self, hidden_states, layer_idx=None, causal_mask=None):") == 2
    assert "hidden_states = layer(hidden_states, i, None)" in out
    assert run_rule(rule, out) == out


def test_a_positional_argument_the_classes_bind_differently_is_refused(run_rule, make_ctx):
    # the Mamba layer takes a mask of its own where the hybrid layer folds `attention_mask`: no call fits both
    code = MIXED_LAYERS.replace(
        'layers.append(HybridLayer(config) if kind == "hybrid" else mamba)',
        "layers.append(HybridLayer(config))",
    ).replace(
        "class MambaLayer(nn.Module):\n    def forward(self, hidden_states, layer_idx=None, attention_mask=None,",
        "class MambaLayer(nn.Module):\n    def forward(self, hidden_states, layer_idx=None, mask=None,",
    )
    (scope, what), *more = _findings(run_rule, make_ctx, code)
    assert (scope, more) == ("LlamaForCausalLM", [])
    assert what == (
        "the layers of one list (HybridLayer, MambaLayer) are called with argument `None`, which some of them "
        "take as an HF-only parameter (folded away) and others keep: give them the same signature"
    )


def test_a_mixed_list_a_builder_method_returns_counts_too(run_rule):
    # Zamba2Model (v5) builds the same list in `get_layers`, which `__init__` calls
    code = MIXED_LAYERS.replace(
        "        layers = []\n",
        "        self.layers = self.get_layers(config)\n\n    def get_layers(self, config):\n        layers = []\n",
    ).replace("        self.layers = nn.ModuleList(layers)\n", "        return nn.ModuleList(layers)\n")
    assert "def get_layers" in code and "return nn.ModuleList(layers)" in code
    out = run_rule(rule, code)
    assert out.count("def forward(self, hidden_states, layer_idx=None, causal_mask=None):") == 2
    assert "hidden_states = layer(hidden_states, i, None)" in out
    assert run_rule(rule, out) == out


UNCACHED = dedent("""\
    class Model(nn.Module):
        def forward(self, idx):
            b, t = idx.size()
            assert t <= self.config.block_size, f"Cannot forward sequence of length {t}"
            pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
            return self.h(self.wte(idx) + self.wpe(pos))


    class LM(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.transformer = Model(config)

        def forward(self, input_ids):
            return self.lm_head(self.transformer(input_ids))
    """)


def test_positions_ranged_over_the_tokens_of_a_model_without_a_cache_are_the_given_ones(make_ctx):
    # nanoGPT: no cache, every step reads the whole sequence again, so arange(0, t) are the tokens' positions; the
    # assert on t would count every request's tokens, packed in one row, and goes
    after = UNCACHED.replace(
        "    def forward(self, idx):\n", "    def forward(self, idx, position_ids=None):\n", 1
    ).replace(
        """        assert t <= self.config.block_size, f"Cannot forward sequence of length {t}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
""",
        "        pos = position_ids[0]\n",
    )
    assert after != UNCACHED
    entry = partial(make_ctx, entry_class="LM")
    assert_codemod(rule, UNCACHED, after, entry)
    for count in ("idx.shape[1]", "idx.size(-1)"):
        direct = UNCACHED.replace("torch.arange(0, t,", f"torch.arange({count},")
        assert "pos = position_ids[0]" in run_codemod(rule, direct, entry())
    # an arange over anything else (a width), or an entry that takes a cache, keeps its values
    for change in (
        ("torch.arange(0, t,", "torch.arange(0, self.width,"),
        ("def forward(self, input_ids):", "def forward(self, input_ids, past_key_values=None):"),
    ):
        kept = run_codemod(rule, UNCACHED.replace(*change), entry())
        assert "position_ids[0]" not in kept and "torch.arange(0, " in kept
