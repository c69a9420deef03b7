"""causal_lm_entry: the *ForCausalLM class takes the runtime contract (forward on packed inputs returning
last-position logits, weight tying, load_weights, get_cache_info when paged, EntryClass)."""

import ast
from textwrap import dedent

import pytest

from skills.migrator.rules.causal_lm_entry import CausalLMEntry as rule

# Gemma3ForCausalLM as causal_lm_entry sees it in the pipeline (HF-only parameters already folded).
BEFORE = dedent("""\
    import torch
    from torch import nn


    class Gemma3TextModel(Gemma3PreTrainedModel):
        def __init__(self, config: Gemma3TextConfig):
            super().__init__(config)
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)


    class Gemma3ForCausalLM(Gemma3PreTrainedModel, GenerationMixin):
        _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
        _tp_plan = {"lm_head": "colwise_gather_output"}

        def __init__(self, config: Gemma3TextConfig):
            super().__init__(config)
            self.model = Gemma3TextModel(config)
            self.vocab_size = config.vocab_size
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

        def forward(
            self,
            input_ids: torch.LongTensor | None = None,
            position_ids: torch.LongTensor | None = None,
            **kwargs,
        ):
            # decoder outputs consists of (dec_features, layer_state, dec_hidden, dec_attn)
            outputs: BaseModelOutputWithPast = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                **kwargs,
            )

            hidden_states = outputs.last_hidden_state
            hidden_states = slice_logits_to_keep(hidden_states, 0)
            logits = self.lm_head(hidden_states)
            if self.config.final_logit_softcapping is not None:
                logits = logits / self.config.final_logit_softcapping
                logits = torch.tanh(logits)
                logits = logits * self.config.final_logit_softcapping

            loss = None

            return CausalLMOutputWithPast(
                loss=loss,
                logits=logits,
                cache=outputs.cache,
                hidden_states=outputs.hidden_states,
                attentions=outputs.attentions,
            )
    """)

AFTER = dedent("""\
    import torch
    from torch import nn
    from collections.abc import Iterable
    from runtime.engine.forward_metadata import ForwardMetaData
    from runtime.kv_cache import ModelCacheInfo
    from runtime.layers.attention import cache_info_of
    from runtime.layers.weights import load_named_weights


    class Gemma3TextModel(Gemma3PreTrainedModel):
        def __init__(self, config: Gemma3TextConfig):
            super().__init__(config)
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)


    class Gemma3ForCausalLM(Gemma3PreTrainedModel, GenerationMixin):
        _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
        _tp_plan = {"lm_head": "colwise_gather_output"}

        def __init__(self, config: Gemma3TextConfig):
            super().__init__(config)
            self.model = Gemma3TextModel(config)
            self.vocab_size = config.vocab_size
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            if config.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight

        def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, forward_metadata: ForwardMetaData,
                    **kwargs) -> torch.Tensor:
            hidden_states = self.model(input_ids=input_ids[None], position_ids=position_ids[None],
                                        forward_metadata=forward_metadata, **kwargs)
            hidden_states = hidden_states[0, forward_metadata.last_token_indices]
            logits = self.lm_head(hidden_states)
            if self.config.final_logit_softcapping is not None:
                logits = logits / self.config.final_logit_softcapping
                logits = torch.tanh(logits)
                logits = logits * self.config.final_logit_softcapping
            return logits[:, None, :]

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            return load_named_weights(self, weights)

        def get_cache_info(self) -> ModelCacheInfo:
            return cache_info_of(self, next(self.parameters()).dtype)


    EntryClass = Gemma3ForCausalLM
    """)

GEMMA3 = {"entry_class": "Gemma3ForCausalLM"}


def entry_methods(code: str, entry: str) -> dict[str, ast.FunctionDef]:
    (cls,) = [s for s in ast.parse(code).body if isinstance(s, ast.ClassDef) and s.name == entry]
    return {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}


def test_paged_entry(run_rule, make_ctx):
    ctx = make_ctx(**GEMMA3)
    assert run_rule(rule, BEFORE, ctx) == AFTER
    assert ctx.findings == []


def test_legacy_entry_has_no_cache_info(run_rule):
    out = run_rule(rule, BEFORE, kv_layout="legacy", **GEMMA3)
    methods = entry_methods(out, "Gemma3ForCausalLM")
    assert list(methods) == ["__init__", "forward", "load_weights"]
    assert "ModelCacheInfo" not in out and "cache_info_of" not in out
    assert out.rstrip().endswith("EntryClass = Gemma3ForCausalLM")


def test_idempotent(run_rule):
    assert run_rule(rule, AFTER, **GEMMA3) == AFTER


def test_tying_follows_tied_weights_keys(run_rule):
    no_keys = BEFORE.replace('    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}\n', "")
    assert "tie_word_embeddings" not in run_rule(rule, no_keys, **GEMMA3)
    # An empty mapping: never tied, whatever the config says (Inkling's configs have no tie_word_embeddings).
    never = BEFORE.replace('{"lm_head.weight": "model.embed_tokens.weight"}', "{}")
    assert "tie_word_embeddings" not in run_rule(rule, never, **GEMMA3)
    # Older list form: the lm_head is tied to <inner>.embed_tokens.
    as_list = BEFORE.replace('{"lm_head.weight": "model.embed_tokens.weight"}', '["lm_head.weight"]')
    init = entry_methods(run_rule(rule, as_list, **GEMMA3), "Gemma3ForCausalLM")["__init__"]
    assert ast.unparse(init.body[-1]) == (
        "if config.tie_word_embeddings:\n    self.lm_head.weight = self.model.embed_tokens.weight"
    )

    # Every tie is honoured (BertGeneration ties its head's bias too); regex entries and indexed paths
    # (`heads.1.weight`, not an attribute path) are left to the checkpoint.
    two = BEFORE.replace(
        '{"lm_head.weight": "model.embed_tokens.weight"}',
        '{"lm_head.weight": "model.embed_tokens.weight", "lm_head.bias": "bias", r"layers\\.\\d+": "layers.0", "heads.1.weight": "heads.0.weight"}',
    )
    init = entry_methods(run_rule(rule, two, **GEMMA3), "Gemma3ForCausalLM")["__init__"]
    assert ast.unparse(init.body[-1]) == (
        "if config.tie_word_embeddings:\n"
        "    self.lm_head.weight = self.model.embed_tokens.weight\n"
        "    self.lm_head.bias = self.bias"
    )


def test_output_projection_not_named_lm_head(run_rule):
    # Remote code such as InternLM2 calls the vocab projection `self.output`.
    code = BEFORE.replace("self.lm_head", "self.output").replace(
        '_tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}', "_tied_weights_keys = []"
    )
    fwd = entry_methods(run_rule(rule, code, **GEMMA3), "Gemma3ForCausalLM")["forward"]
    assert "logits = self.output(hidden_states)" in ast.unparse(fwd)


@pytest.mark.parametrize(
    "entry,code,what",
    [
        ("Gemma3ForConditionalGeneration", BEFORE, "entry class not found in the modeling file"),
        (
            "Gemma3ForCausalLM",
            BEFORE.replace("logits = self.lm_head(hidden_states)", "logits = hidden_states @ self.w"),
            "expected `self.<model>(...)` followed by `self.lm_head(...)` in forward",
        ),
    ],
    ids=["missing-class", "no-lm-head-call"],
)
def test_unsupported_entry_is_a_finding(run_rule, make_ctx, entry, code, what):
    ctx = make_ctx(entry_class=entry)
    assert run_rule(rule, code, ctx) == code
    assert [f.what for f in ctx.findings] == [what]


def test_hand_written_contract_entry_untouched(run_rule, make_ctx):
    code = dedent("""\
        import torch
        from torch import nn


        class TinyForCausalLM(nn.Module):
            def __init__(self, config, infer_config, comm_manager=None, prefix=""):
                super().__init__()
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)

            def forward(self, input_ids, position_ids, forward_metadata, **kwargs):
                return self.lm_head(self.embed(input_ids))[forward_metadata.last_token_indices][:, None, :]
        """)
    ctx = make_ctx(entry_class="TinyForCausalLM")
    assert run_rule(rule, code, ctx) == code
    assert ctx.findings == []


# MixtralForCausalLM.forward as causal_lm_entry sees it: fold_hf_only_params turned
# `output_router_logits = output_router_logits if output_router_logits is not None else self.config...`
# into `output_router_logits = False`, which ends its constness, so the branch after lm_head survives.
MIXTRAL = dedent("""\
    import torch
    from torch import nn


    class MixtralModel(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)


    class MixtralForCausalLM(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.model = MixtralModel(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.num_experts = config.num_local_experts
            self.num_experts_per_tok = config.num_experts_per_tok

        def forward(self, input_ids=None, position_ids=None, **kwargs):
            output_router_logits = False

            # decoder outputs consists of (dec_features, layer_state, dec_hidden, dec_attn)
            outputs: MoeModelOutputWithPast = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                output_router_logits=output_router_logits,
                **kwargs,
            )

            hidden_states = outputs.last_hidden_state
            hidden_states = slice_logits_to_keep(hidden_states, 0)
            logits = self.lm_head(hidden_states)

            loss = None

            aux_loss = None
            if output_router_logits:
                aux_loss = load_balancing_loss_func(
                    outputs.router_logits,
                    self.num_experts,
                    self.num_experts_per_tok,
                    None,
                )

            return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=logits)
    """)


def test_tail_reads_only_names_the_new_forward_defines(run_rule, make_ctx):
    ctx = make_ctx(entry_class="MixtralForCausalLM")
    out = run_rule(rule, MIXTRAL, ctx)
    assert ctx.findings or not (
        {"output_router_logits", "outputs"}
        & {
            n.id
            for n in ast.walk(entry_methods(out, "MixtralForCausalLM")["forward"])
            if isinstance(n, ast.Name)
        }
    )


def test_hidden_states_scaled_before_the_head_stay(run_rule):
    # MiniCPM3 divides the hidden states before the LM head; dropping it would keep greedy tokens, not logits.
    scaled = "hidden_states = slice_logits_to_keep(hidden_states, 0)\n        hidden_states = hidden_states / self.config.logits_scaling\n"
    code = BEFORE.replace("hidden_states = slice_logits_to_keep(hidden_states, 0)\n", scaled)
    out = run_rule(rule, code, **GEMMA3)
    expected = AFTER.replace(
        "        logits = self.lm_head(hidden_states)\n",
        "        hidden_states = hidden_states / self.config.logits_scaling\n        logits = self.lm_head(hidden_states)\n",
    )
    assert out == expected
    assert run_rule(rule, out, **GEMMA3) == out


@pytest.mark.parametrize("read", ["outputs", "outputs.last_hidden_state", "outputs[0]"])
def test_hidden_states_scaled_as_they_are_read_off_the_model_output_stay(run_rule, read):
    """Inkling divides the model's output by a width multiplier as it reads it (MG006 has made `outputs` the states
    themselves): the division stays, on the states the runtime's forward picked."""
    code = BEFORE.replace(
        "hidden_states = outputs.last_hidden_state\n",
        f"hidden_states = {read} / self.config.logits_mup_width_multiplier\n",
    )
    out = run_rule(rule, code, **GEMMA3)
    expected = AFTER.replace(
        "        logits = self.lm_head(hidden_states)\n",
        "\n        hidden_states = hidden_states / self.config.logits_mup_width_multiplier\n"
        "        logits = self.lm_head(hidden_states)\n",
    )
    assert out == expected
    assert run_rule(rule, out, **GEMMA3) == out


def test_checkpoint_keys_transformers_ignores_are_ignored_by_load_weights(run_rule):
    """DeepSeek-V3's PreTrainedModel ignores the multi-token-prediction layer its checkpoints ship
    (`_keys_to_ignore_on_load_unexpected`); load_weights skips the same names, which the loader reports."""
    base = 'class Gemma3PreTrainedModel(nn.Module):\n    _keys_to_ignore_on_load_unexpected = [r"model\\.layers\\.61.*"]\n\n\n'
    load = entry_methods(run_rule(rule, base + BEFORE, **GEMMA3), "Gemma3ForCausalLM")["load_weights"]
    assert (
        ast.unparse(load.body[-1])
        == "return load_named_weights(self, weights, ignored=['model\\\\.layers\\\\.61.*'])"
    )
    load = entry_methods(run_rule(rule, BEFORE, **GEMMA3), "Gemma3ForCausalLM")["load_weights"]
    assert ast.unparse(load.body[-1]) == "return load_named_weights(self, weights)"


@pytest.mark.parametrize(
    ("call", "kept"),
    [
        # ModernBERT-decoder: a prediction head (dense, activation, norm) before the vocab projection
        (
            "self.lm_head(self.head_transform(hidden_states))",
            "self.lm_head(self.head_transform(hidden_states))",
        ),
        # the positions HF slices are the runtime's to pick: the slice goes, the hidden states stay
        ("self.lm_head(hidden_states[:, slice_indices, :])", "self.lm_head(hidden_states)"),
    ],
    ids=["prediction_head", "sliced_positions"],
)
def test_what_the_head_is_applied_to_stays_unless_it_reads_dropped_names(run_rule, call, kept):
    code = BEFORE.replace("logits = self.lm_head(hidden_states)", f"logits = {call}")
    out = run_rule(rule, code, **GEMMA3)
    assert f"        logits = {kept}\n" in out
    assert run_rule(rule, out, **GEMMA3) == out


# ChatGLM (remote code): the output layer lives in the inner model, whose states are [tokens, batch, hidden].
SEQ_FIRST = dedent("""\
    class GLMModel(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.output_layer = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)


    class GLMForConditionalGeneration(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.transformer = GLMModel(config)

        def forward(self, input_ids=None, position_ids=None, **kwargs):
            out = self.transformer(input_ids, position_ids=position_ids)
            logits = self.transformer.output_layer(out).transpose(0, 1).float()
            return CausalLMOutputWithPast(logits=logits)
    """)


@pytest.mark.parametrize("swap", [".transpose(0, 1)", ""], ids=["seq_first", "batch_first"])
def test_a_head_the_inner_model_builds_is_found_and_a_swapped_result_picks_along_the_first_dim(
    run_rule, make_ctx, swap
):
    ctx = make_ctx(entry_class="GLMForConditionalGeneration")
    out = run_rule(rule, SEQ_FIRST.replace(".transpose(0, 1)", swap), ctx)
    assert ctx.findings == []
    picked = "forward_metadata.last_token_indices, 0" if swap else "0, forward_metadata.last_token_indices"
    assert f"hidden_states = hidden_states[{picked}]" in out
    assert "logits = self.transformer.output_layer(hidden_states)\n        return logits[:, None, :]" in out
    assert run_rule(rule, out, make_ctx(entry_class="GLMForConditionalGeneration")) == out


def test_logits_swapped_back_on_a_line_of_their_own_keep_their_name_and_lose_the_swap(run_rule, make_ctx):
    """ChatGLM2/3 write the swap apart: `lm_logits = lm_logits.transpose(0, 1).contiguous()`."""
    two_lines = SEQ_FIRST.replace(
        "        logits = self.transformer.output_layer(out).transpose(0, 1).float()\n",
        "        lm_logits = self.transformer.output_layer(out)\n        lm_logits = lm_logits.transpose(0, 1).contiguous()\n",
    ).replace("logits=logits", "logits=lm_logits")
    assert "lm_logits.transpose(0, 1)" in two_lines
    out = run_rule(rule, two_lines, make_ctx(entry_class="GLMForConditionalGeneration"))
    assert "hidden_states = hidden_states[forward_metadata.last_token_indices, 0]" in out
    assert (
        "lm_logits = self.transformer.output_layer(hidden_states)\n        return lm_logits[:, None, :]"
        in out
    )


# Meta's reference Llama as remote code: the inner model takes `tokens` and applies its output layer itself.
APPLIED_INSIDE = dedent("""\
    class Transformer(nn.Module):
        def __init__(self, params):
            super().__init__()
            self.norm = RMSNorm(params.dim)
            self.output = nn.Linear(params.dim, params.vocab_size, bias=False)

        def forward(self, tokens, position_ids=None, **kwargs):
            h = self.layers(self.tok_embeddings(tokens), **kwargs)
            h = self.norm(h)
            return self.output(h).float()


    class MetaLMForCausalLM(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.model = Transformer(config)

        def forward(self, input_ids=None, **kwargs):
            logits = self.model(input_ids, **kwargs)
            return CausalLMOutputWithPast(logits=logits)
    """)


def test_an_output_layer_the_inner_model_applies_moves_to_the_entry(run_rule, make_ctx):
    ctx = make_ctx(entry_class="MetaLMForCausalLM")
    out = run_rule(rule, APPLIED_INSIDE, ctx)
    assert ctx.findings == []
    assert "h = self.norm(h)\n        return h\n" in out and "return self.output(" not in out
    assert "self.model(tokens=input_ids[None]," in out  # the inner model's own name for the ids
    assert "logits = self.model.output(hidden_states)\n        return logits[:, None, :]" in out
    assert run_rule(rule, out, make_ctx(entry_class="MetaLMForCausalLM")) == out
    # a return that does more than apply (and cast) the output layer is not the logits alone
    mixed = APPLIED_INSIDE.replace("return self.output(h).float()", "return self.output(h).float() + h.sum()")
    ctx = make_ctx(entry_class="MetaLMForCausalLM")
    assert run_rule(rule, mixed, ctx) == mixed
    assert ctx.findings[0].what.startswith("expected `self.<model>(...)` followed by")


TUPLE_RETURNED = dedent("""\
    class TupleLMModel(nn.Module):
        def forward(self, input_ids, position_ids, **kwargs):
            hidden_states = self.h(self.wte(input_ids), **kwargs)
            presents = None
            return self.ln_f(hidden_states), presents


    class TupleLMForCausalLM(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.transformer = TupleLMModel(config)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

        def forward(self, input_ids=None, position_ids=None, **kwargs):
            hidden_states, presents = self.transformer(input_ids, position_ids=position_ids)
            lm_logits = self.lm_head(hidden_states)
            return CausalLMOutputWithPast(logits=lm_logits, past_key_values=presents)
    """)


@pytest.mark.parametrize("read", ["unpacked", "first"])
def test_an_inner_model_returning_a_tuple_returns_the_hidden_states_the_entry_reads(run_rule, make_ctx, read):
    # older remote code returns (hidden states, per-layer cache); the entry reads the first
    code = TUPLE_RETURNED
    if read == "first":
        code = code.replace(
            "hidden_states, presents = self.transformer(input_ids, position_ids=position_ids)\n",
            "outputs = self.transformer(input_ids, position_ids=position_ids)\n        hidden_states = outputs[0]\n",
        ).replace("past_key_values=presents", "past_key_values=None")
    ctx = make_ctx(entry_class="TupleLMForCausalLM")
    out = run_rule(rule, code, ctx)
    assert ctx.findings == [] and "return self.ln_f(hidden_states)\n" in out
    assert run_rule(rule, out, make_ctx(entry_class="TupleLMForCausalLM")) == out
    # an entry reading more of the tuple than its first element keeps the inner model as it is
    more = code.replace(
        "lm_logits = self.lm_head(hidden_states)", "lm_logits = self.lm_head(hidden_states) + outputs[1]"
    )
    if read == "first":
        assert "return self.ln_f(hidden_states), presents" in run_rule(
            rule, more, make_ctx(entry_class="TupleLMForCausalLM")
        )
