"""runtime_attention: the HF attention-interface call becomes the runtime's `Attention` layer."""

import ast
from textwrap import dedent

import pytest

from skills.migrator.rules.runtime_attention import RuntimeAttention as rule

HEADER = dedent("""\
    from collections.abc import Callable

    import torch
    from torch import nn

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    """)

RUNTIME_IMPORTS = dedent("""\
    from runtime.engine.forward_metadata import ForwardMetaData
    from runtime.layers.attention import Attention
    """)

# A decoder layer calling the attention, and the entry class reaching it (only attention the entry
# class uses is converted).
CALLERS = dedent("""\


    class LlamaDecoderLayer(nn.Module):
        def __init__(self, config, layer_idx: int):
            super().__init__()
            self.self_attn = LlamaAttention(config=config, layer_idx=layer_idx)

        def forward(self, hidden_states, position_embeddings=None, **kwargs):
            residual = hidden_states
            hidden_states, _ = self.self_attn(
                hidden_states=hidden_states,
                position_embeddings=position_embeddings,
                **kwargs,
            )
            return residual + hidden_states


    class LlamaForCausalLM(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
    """)

CALLERS_AFTER = CALLERS.replace("hidden_states, _ = self.self_attn(", "hidden_states = self.self_attn(")


ATTENTION = dedent("""\


    class LlamaAttention(nn.Module):
        def __init__(self, config: LlamaConfig, layer_idx: int):
            super().__init__()
            self.config = config
            self.head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
            self.scaling = self.head_dim**-0.5
            self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim)
            self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim)
    @INIT@

        def forward(
            self,
            hidden_states: torch.Tensor,
            position_embeddings: tuple[torch.Tensor, torch.Tensor],
            **kwargs,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            query_states = self.q_proj(hidden_states)
            key_states = self.k_proj(hidden_states)
            value_states = self.v_proj(hidden_states)

            attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention_forward
            )

            attn_output, attn_weights = attention_interface(
                self,
                query_states,
                key_states,
                value_states,
                None,
                dropout=0.0,
    @KWARGS@
                **kwargs,
            )
            attn_output = self.o_proj(attn_output)
            return attn_output, attn_weights
    """)


def attention(
    init_extra: tuple[str, ...] = (), call_kwargs: tuple[str, ...] = ("scaling=self.scaling,",)
) -> str:
    """LlamaAttention (transformers v5, cache update already folded away) with extra `__init__` lines and
    keyword arguments of the attention-interface call."""
    init = "".join(f"        {line}\n" for line in init_extra)
    kwargs = "".join(f"            {line}\n" for line in call_kwargs)
    return ATTENTION.replace("@INIT@\n", init).replace("@KWARGS@\n", kwargs)


LLAMA = HEADER + attention() + CALLERS

LLAMA_AFTER = (
    HEADER
    + RUNTIME_IMPORTS
    + dedent("""\


    class LlamaAttention(nn.Module):
        def __init__(self, config: LlamaConfig, layer_idx: int):
            super().__init__()
            self.config = config
            self.head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
            self.scaling = self.head_dim**-0.5
            self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim)
            self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim)
            self.attn = Attention(num_heads=config.num_attention_heads, head_dim=self.head_dim, num_kv_heads=config.num_key_value_heads, scale=self.scaling)

        def forward(
            self,
            hidden_states: torch.Tensor,
            position_embeddings: tuple[torch.Tensor, torch.Tensor],
            *, forward_metadata: ForwardMetaData, **kwargs,
        ):
            query_states = self.q_proj(hidden_states)
            key_states = self.k_proj(hidden_states)
            value_states = self.v_proj(hidden_states)

            attn_output = self.attn(query_states, key_states, value_states, forward_metadata)
            attn_output = self.o_proj(attn_output)
            return attn_output
    """)
    + CALLERS_AFTER
)


def ctor_line(code: str) -> str:
    (line,) = [x.strip() for x in code.splitlines() if x.strip().startswith("self.attn = Attention(")]
    return line


def test_llama_attention(run_rule, make_ctx):
    ctx = make_ctx()
    assert run_rule(rule, LLAMA, ctx) == LLAMA_AFTER
    assert ctx.findings == []


def test_idempotent(run_rule):
    assert run_rule(rule, LLAMA_AFTER) == LLAMA_AFTER


@pytest.mark.parametrize(
    "chosen",
    [
        # Bailing-Hybrid: attention on full-attention layers, a linear attention elsewhere
        "self.self_attn = (LlamaAttention(config=config, layer_idx=layer_idx) if full else Linear(config))",
        # Nemotron-H: the mixer class picked from a module-level table by the layer's kind
        "self.self_attn = MIXERS[kind](config=config, layer_idx=layer_idx)",
    ],
)
def test_an_attention_built_through_a_conditional_or_a_table_has_its_callers_narrowed(run_rule, chosen):
    built = "self.self_attn = LlamaAttention(config=config, layer_idx=layer_idx)"
    table = 'MIXERS = {"attention": LlamaAttention}\n\n\nclass LlamaDecoderLayer'

    def edit(code: str) -> str:
        return code.replace(built, chosen).replace("class LlamaDecoderLayer", table)

    assert run_rule(rule, edit(LLAMA)) == edit(LLAMA_AFTER)


def test_legacy_kv_layout(run_rule):
    assert ctor_line(run_rule(rule, LLAMA, kv_layout="legacy")) == (
        "self.attn = Attention(num_heads=config.num_attention_heads, head_dim=self.head_dim, "
        "num_kv_heads=config.num_key_value_heads, scale=self.scaling, legacy=True)"
    )


def test_gemma3_sliding_window_and_softcap(run_rule, make_ctx):
    # Gemma3Attention passes scaling and sliding_window; Gemma2 also passes softcap.
    code = (
        HEADER
        + attention(
            init_extra=(
                "self.attn_logit_softcapping = self.config.attn_logit_softcapping",
                'self.sliding_window = config.sliding_window if self.layer_type == "sliding_attention" else None',
            ),
            call_kwargs=(
                "scaling=self.scaling,",
                "sliding_window=self.sliding_window,",
                "softcap=self.attn_logit_softcapping,",
            ),
        )
        + CALLERS
    )
    ctx = make_ctx()
    out = run_rule(rule, code, ctx)
    assert ctx.findings == []
    assert ctor_line(out) == (
        "self.attn = Attention(num_heads=config.num_attention_heads, head_dim=self.head_dim, "
        "num_kv_heads=config.num_key_value_heads, scale=self.scaling, sliding_window=self.sliding_window, "
        "soft_cap=self.attn_logit_softcapping)"
    )


def test_default_scale_without_scaling_kwarg(run_rule):
    code = HEADER + attention(call_kwargs=("is_causal=True,",)) + CALLERS
    assert ctor_line(run_rule(rule, code)).endswith(", scale=self.head_dim**-0.5)")


def test_unsupported_kwarg_is_a_finding(run_rule, make_ctx):
    # an attention implementation's own option (a flash kernel's dropout seed) the runtime has no equivalent of
    code = HEADER + attention(call_kwargs=("scaling=self.scaling,", "rng_seed=self.seed,")) + CALLERS
    ctx = make_ctx()
    run_rule(rule, code, ctx)
    assert [(f.scope, f.what) for f in ctx.findings] == [
        ("LlamaAttention", "attention argument `rng_seed=` has no equivalent in the runtime Attention")
    ]


def test_attention_sinks_are_passed_on_every_call(run_rule, make_ctx):
    # GptOssAttention: its per-head sink logits stay its own parameter and go to the runtime Attention.
    code = (
        HEADER
        + attention(
            init_extra=("self.sinks = nn.Parameter(torch.empty(config.num_attention_heads))",),
            call_kwargs=("scaling=self.scaling,", "s_aux=self.sinks,  # diff with Llama"),
        )
        + CALLERS
    )
    ctx = make_ctx()
    out = run_rule(rule, code, ctx)
    assert ctx.findings == []
    assert ctor_line(out).endswith("num_kv_heads=config.num_key_value_heads, scale=self.scaling)")
    assert (
        "attn_output = self.attn(query_states, key_states, value_states, forward_metadata, sinks=self.sinks)"
        in out
    )
    assert run_rule(rule, out) == out


def test_forward_time_argument_is_a_finding(run_rule, make_ctx):
    code = (
        HEADER
        + attention(call_kwargs=("scaling=self.scaling,", "sliding_window=hidden_states.shape[1],"))
        + CALLERS
    )
    ctx = make_ctx()
    run_rule(rule, code, ctx)
    assert [f.what for f in ctx.findings] == [
        "attention argument `sliding_window=hidden_states.shape[1]` depends on forward-time values"
    ]


def test_caller_without_kwargs_gets_them(run_rule, make_ctx):
    # forward_metadata travels in **kwargs: a caller that does not pass them on is given them.
    callers = CALLERS.replace("position_embeddings=None, **kwargs):", "position_embeddings=None):")
    callers = "".join(line for line in callers.splitlines(keepends=True) if line.strip() != "**kwargs,")
    assert "kwargs" not in callers
    ctx = make_ctx()
    out = run_rule(rule, HEADER + attention() + callers, ctx)
    assert ctx.findings == []
    layer = ast.parse(out).body[-2]
    assert layer.name == "LlamaDecoderLayer"
    fwd = layer.body[1]
    assert fwd.args.kwarg.arg == "kwargs"
    call = fwd.body[1].value
    assert ast.unparse(fwd.body[1].targets[0]) == "hidden_states"
    assert ast.unparse(call) == (
        "self.self_attn(hidden_states=hidden_states, position_embeddings=position_embeddings, **kwargs)"
    )
    assert run_rule(rule, out) == out


def test_caller_with_a_double_star_parameter_of_another_name_passes_that_one_on(run_rule, make_ctx):
    callers = CALLERS.replace("position_embeddings=None, **kwargs):", "position_embeddings=None, **extra):")
    callers = "".join(line for line in callers.splitlines(keepends=True) if line.strip() != "**kwargs,")
    ctx = make_ctx()
    out = run_rule(rule, HEADER + attention() + callers, ctx)
    assert ctx.findings == []
    fwd = ast.parse(out).body[-2].body[1]
    assert fwd.args.kwarg.arg == "extra"
    assert ast.unparse(fwd.body[1].value).endswith("position_embeddings=position_embeddings, **extra)")


def test_a_call_in_a_nested_function_passes_the_enclosing_functions_kwargs(run_rule, make_ctx):
    """A closure reads its enclosing forward's `**kwargs`: the nested def's own callers pass none."""
    call = """\
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            position_embeddings=position_embeddings,
            **kwargs,
        )
"""
    nested = """\

        def attend(h):
            return self.self_attn(hidden_states=h, position_embeddings=position_embeddings)[0]

        hidden_states = attend(hidden_states)
"""
    assert call in CALLERS
    ctx = make_ctx()
    out = run_rule(rule, HEADER + attention() + CALLERS.replace(call, nested), ctx)
    assert ctx.findings == []
    assert "        def attend(h):\n" in out
    assert "self.self_attn(hidden_states=h, position_embeddings=position_embeddings, **kwargs)" in out


@pytest.mark.parametrize("entry", ["LlamaForCausalLM", "SomethingElse"])
def test_attention_not_used_by_the_entry_class_untouched(run_rule, make_ctx, entry):
    # A vision tower's attention (or a file without the entry class): nothing is converted, no imports added.
    code = (
        HEADER
        + attention().replace("LlamaAttention", "SiglipAttention")
        + dedent("""\


        class LlamaForCausalLM(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)
        """)
    )
    ctx = make_ctx(entry_class=entry)
    assert run_rule(rule, code, ctx) == code
    # the entry uses no standard attention, so there is no KV cache to give it: that is reported, not guessed
    assert [f.what.split(";")[0] for f in ctx.findings] == [
        "no attention class calls ALL_ATTENTION_FUNCTIONS / eager_attention_forward"
    ]


def test_each_attention_call_gets_its_own_layer_and_cache(run_rule):
    # DiffLlamaAttention (v5) attends twice with the same queries and keys over two halves of the values.
    second = (
        "        attn_output2, _ = attention_interface(\n"
        "            self, query_states, key_states, value_states, None, scaling=self.scaling, **kwargs\n"
        "        )\n"
        "        attn_output = self.o_proj(attn_output + attn_output2)\n"
    )
    code = HEADER + attention().replace("        attn_output = self.o_proj(attn_output)\n", second) + CALLERS
    out = run_rule(rule, code)
    assert "attn_output = self.attn(query_states, key_states, value_states, forward_metadata)" in out
    assert "attn_output2 = self.attn_2(query_states, key_states, value_states, forward_metadata)" in out
    ctors = [line.strip().split(" = ")[0] for line in out.splitlines() if "= Attention(" in line]
    assert ctors == ["self.attn", "self.attn_2"]
    assert run_rule(rule, out) == out


def test_mla_key_and_value_head_sizes(run_rule, make_ctx):
    # DeepseekV3Attention: keys and queries of qk_head_dim, values of v_head_dim.
    code = (
        HEADER
        + attention(
            init_extra=(
                "self.v_head_dim = config.v_head_dim",
                "self.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim",
            )
        )
        + CALLERS
    )
    ctx = make_ctx()
    assert ctor_line(run_rule(rule, code, ctx)) == (
        "self.attn = Attention(num_heads=config.num_attention_heads, head_dim=self.qk_head_dim, "
        "v_head_dim=self.v_head_dim, num_kv_heads=config.num_key_value_heads, scale=self.scaling)"
    )
    assert ctx.findings == []


def test_callers_of_a_list_of_attention_modules_drop_the_weights(run_rule):
    # LongcatFlash: two attention modules per layer, `self.self_attn = nn.ModuleList([...])`, called by index.
    callers = CALLERS.replace(
        "self.self_attn = LlamaAttention(config=config, layer_idx=layer_idx)",
        "self.self_attn = nn.ModuleList([LlamaAttention(config=config, layer_idx=2 * layer_idx + i) for i in range(2)])",
    ).replace("hidden_states, _ = self.self_attn(", "hidden_states, _ = self.self_attn[0](")
    out = run_rule(rule, HEADER + attention() + callers)
    assert "        hidden_states = self.self_attn[0](\n" in out
    assert run_rule(rule, out) == out


def test_callers_keep_what_the_attention_returns_besides_its_weights(run_rule):
    # JetMoE's attention returns (output, weights, router logits).
    code = HEADER + attention() + CALLERS
    code = code.replace("return attn_output, attn_weights", "return attn_output, attn_weights, router_logits")
    code = code.replace("hidden_states, _ = self.self_attn(", "hidden_states, _, logits = self.self_attn(")
    out = run_rule(rule, code)
    assert "return attn_output, router_logits" in out
    assert "        hidden_states, logits = self.self_attn(\n" in out
    assert run_rule(rule, out) == out


def test_kv_heads_computed_in_a_local_are_cached(run_rule):
    # MiMo-V2-Flash: sliding layers have twice the kv heads, computed in a local of __init__.
    code = HEADER + attention(init_extra=("num_key_value_heads = config.num_key_value_heads * 2",)) + CALLERS
    assert "num_kv_heads=num_key_value_heads, scale=self.scaling)" in ctor_line(run_rule(rule, code))


def test_head_counts_a_layer_sets_itself_otherwise_than_the_config_are_its_own(run_rule):
    # Inkling's sliding layers have more query and key heads than its full-attention ones.
    swa = (
        "self.num_heads = config.swa_num_attention_heads if self.is_sliding else config.num_attention_heads",
        "self.num_key_value_heads = config.swa_num_key_value_heads if self.is_sliding else config.num_key_value_heads",
    )
    ctor = ctor_line(run_rule(rule, HEADER + attention(init_extra=swa) + CALLERS))
    assert "num_heads=self.num_heads," in ctor and "num_kv_heads=self.num_key_value_heads," in ctor
    same = (
        "self.num_heads = config.num_attention_heads",
        "self.num_key_value_heads = config.num_key_value_heads",
    )
    ctor = ctor_line(run_rule(rule, HEADER + attention(init_extra=same) + CALLERS))
    assert (
        "num_heads=config.num_attention_heads," in ctor and "num_kv_heads=config.num_key_value_heads," in ctor
    )


def test_a_wrapper_passing_the_weights_on_stops_and_its_callers_drop_them(run_rule):
    # BertGenerationAttention (v5) picks its attention class by a flag and returns the weights it got.
    wrapper = dedent("""\


        class BertAttention(nn.Module):
            def __init__(self, config, layer_idx, is_cross_attention=False):
                super().__init__()
                attention_class = LlamaAttention if is_cross_attention else LlamaAttention
                self.self = attention_class(config, layer_idx=layer_idx)

            def forward(self, hidden_states, **kwargs):
                attention_output, attn_weights = self.self(hidden_states, **kwargs)
                return self.output(attention_output), attn_weights
        """)
    callers = CALLERS.replace(
        "LlamaAttention(config=config, layer_idx=layer_idx)", "BertAttention(config, layer_idx)"
    )
    out = run_rule(rule, HEADER + attention() + wrapper + callers)
    assert (
        "attention_output = self.self(hidden_states, **kwargs)\n        return self.output(attention_output)\n"
        in out
    )
    assert "        hidden_states = self.self_attn(\n" in out
    assert run_rule(rule, out) == out


def test_layers_called_in_a_loop_get_kwargs_and_their_narrowed_outputs_unwrapped(run_rule):
    # GPT-NeoX-Japanese: the model calls each layer without **kwargs and takes `outputs[0]` of a layer that
    # returned `(hidden, attn_weights)`; once the weights are gone the layer returns the hidden states alone.
    layer = dedent("""\


        class LlamaDecoderLayer(nn.Module):
            def __init__(self, config, layer_idx: int):
                super().__init__()
                self.self_attn = LlamaAttention(config=config, layer_idx=layer_idx)

            def forward(self, hidden_states, **kwargs):
                attn_output, attn_weights = self.self_attn(hidden_states, **kwargs)
                return hidden_states + attn_output, attn_weights


        class LlamaForCausalLM(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])

            def forward(self, hidden_states):
                for i, layer in enumerate(self.layers):
                    outputs = layer(hidden_states)
                    hidden_states = outputs[0]
                return hidden_states[0]
        """)
    out = run_rule(rule, HEADER + attention() + layer)
    assert "return hidden_states + attn_output\n" in out
    model = out[out.index("class LlamaForCausalLM") :]
    assert "def forward(self, hidden_states, **kwargs):" in model
    assert "outputs = layer(hidden_states, **kwargs)\n            hidden_states = outputs\n" in model
    assert "return hidden_states[0]" in model  # not a layer's output: left alone
    assert run_rule(rule, out) == out


def test_hand_written_attention_calls_the_heads_first_layout(run_rule):
    hand_written = attention().replace("= attention_interface(", "= heads_first_attention(")
    out = run_rule(rule, HEADER + hand_written + CALLERS)
    assert (
        "attn_output = self.attn.forward_heads_first(query_states, key_states, value_states, forward_metadata)"
        in out
    )


def test_an_alibi_bias_becomes_the_layer_s_slopes(run_rule):
    hand_written = attention(call_kwargs=("scaling=self.scaling,", "alibi=self.scaling,")).replace(
        "= attention_interface(", "= heads_first_attention("
    )
    out = run_rule(rule, HEADER + hand_written + CALLERS)
    assert "alibi_slopes=alibi_slopes(config.num_attention_heads, scale=self.scaling)" in ctor_line(out)
    assert "from runtime.layers.attention import Attention, alibi_slopes" in out


def test_a_head_size_read_at_run_time_is_the_layer_s_head_dim(run_rule):
    scaled = attention(call_kwargs=("scaling=1 / math.sqrt(attention_head_dim),",)).replace(
        "= attention_interface(", "= heads_first_attention("
    )
    assert "scale=1 / math.sqrt((self.head_dim))" in ctor_line(run_rule(rule, HEADER + scaled + CALLERS))


def test_a_class_named_attention_makes_way_for_the_runtime_s(run_rule):
    own = attention().replace("LlamaAttention", "Attention")
    out = run_rule(rule, HEADER + own + CALLERS.replace("LlamaAttention", "Attention"))
    assert "class LlamaAttention(nn.Module):" in out and "self.self_attn = LlamaAttention(" in out
    assert "self.attn = Attention(" in out and "from runtime.layers.attention import Attention" in out


FALCON_PATHS = dedent("""\


    class LlamaAttention(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.head_dim = config.hidden_size // config.num_attention_heads
            self.num_kv_heads = config.num_kv_heads

        def forward(self, q, k, v, **kwargs):
            num_kv_heads = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
            k = k.reshape(1, num_kv_heads, -1, self.head_dim)
            if not self.use_alibi:
                out, scores = heads_first_attention(self, q, k, v, scaling=0.5)
                return self.dense(out), scores
            else:
                out, probs = heads_first_attention(self, q, k, v, scaling=0.5, alibi=0.5, shares_cache=True)
                return self.dense(out), probs
    """)


def test_two_paths_a_forward_picks_between_share_one_cache(run_rule):
    """Falcon after MG021: rotary or ALiBi, each returning its own weights, on one cache whose key heads the
    forward computes (Falcon-40B broadcasts its keys to every query head)."""
    out = run_rule(rule, HEADER + FALCON_PATHS + CALLERS)
    heads = "num_kv_heads=self.num_heads if self.new_decoder_architecture else self.num_kv_heads"
    ctors = [x.strip() for x in out.splitlines() if "= Attention(" in x]
    assert ctors == [
        f"self.attn = Attention(num_heads=config.num_attention_heads, head_dim=self.head_dim, {heads}, scale=0.5)",
        (
            f"self.attn_2 = Attention(num_heads=config.num_attention_heads, head_dim=self.head_dim, {heads}, "
            "scale=0.5, alibi_slopes=alibi_slopes(config.num_attention_heads, scale=0.5), cache_of=self.attn)"
        ),
    ]
    assert "out = self.attn_2.forward_heads_first(q, k, v, forward_metadata)" in out
    assert out.count("return self.dense(out)\n") == 2
    assert run_rule(rule, out) == out


@pytest.mark.parametrize(
    "given, passed",
    [
        # MG023's key of a looped layer (HRM-Text) selects which of the runtime Attention's caches a pass uses
        ("cache_key=cycle_offset,", "cache_key=cycle_offset"),
        # MG032's hand-over of a sparse-attention indexer's picks (DeepSeek-V3.2): the runtime reads only those
        ("indices=sparse_indices,", "selected=sparse_indices"),
    ],
    ids=["cache_key", "indexer_picks"],
)
def test_per_call_arguments_are_passed_on(run_rule, make_ctx, given, passed):
    code = HEADER + attention(call_kwargs=("scaling=self.scaling,", given)) + CALLERS
    ctx = make_ctx(applied=["MG032"])  # the indexer's key cache is built
    out = run_rule(rule, code, ctx)
    assert ctx.findings == []
    assert f"self.attn(query_states, key_states, value_states, forward_metadata, {passed})" in out


def test_indexer_picks_without_the_indexer_s_key_cache_are_a_finding(run_rule, make_ctx):
    code = HEADER + attention(call_kwargs=("scaling=self.scaling,", "indices=sparse_indices,")) + CALLERS
    ctx = make_ctx()
    run_rule(rule, code, ctx)
    assert len(ctx.findings) == 1 and "without the indexer key cache MG032 builds" in ctx.findings[0].what


def test_picks_of_blocks_build_the_layer_with_their_size(run_rule, make_ctx):
    """MG032's hand-over of picks that number blocks of keys (MiniMax-M3): their size is the layer's."""
    kwargs = ("scaling=self.scaling,", "indices=block_indices,", "index_block=config.index_block_size,")
    ctx = make_ctx(applied=["MG032"])
    out = run_rule(rule, HEADER + attention(call_kwargs=kwargs) + CALLERS, ctx)
    assert ctx.findings == []
    assert "scale=self.scaling, select_block=config.index_block_size)" in out
    assert (
        "self.attn(query_states, key_states, value_states, forward_metadata, selected=block_indices)" in out
    )


def test_calls_handing_on_the_double_star_parameter_keep_forward_metadata():
    """Once forward_metadata is a parameter of its own it is no longer in `**kwargs`: the attention's own layers
    that got it there (ZAYA's projection, which runs per request) get it by name; other calls stay as they are."""
    import libcst as cst

    from skills.migrator.cst_utils import with_forward_metadata

    fn = cst.parse_module(
        dedent("""\
            def forward(self, hidden_states, **kwargs):
                q, k, v = self.qkv_proj(hidden_states, **kwargs)
                return eager_attention_forward(self, q, k, v, **kwargs)
            """)
    ).body[0]
    assert cst.Module([with_forward_metadata(fn)]).code == dedent("""\
        def forward(self, hidden_states, *, forward_metadata: ForwardMetaData, **kwargs):
            q, k, v = self.qkv_proj(hidden_states, forward_metadata=forward_metadata, **kwargs)
            return eager_attention_forward(self, q, k, v, **kwargs)
        """)


def test_layers_appended_to_a_list_a_module_list_then_holds_are_found():
    # Bamba builds its decoder layers in a loop, appended to a list that `nn.ModuleList` then holds.
    import libcst as cst

    from skills.migrator.rules.runtime_attention import _attention_attrs

    cls = cst.parse_module(
        dedent("""\
            class Model(nn.Module):
                def __init__(self, config):
                    layers = []
                    for i in range(config.num_hidden_layers):
                        layers.append(DecoderLayer(config, i))
                    self.layers = nn.ModuleList(layers)
                    self.norm = Norm(config)
            """)
    ).body[0]
    assert _attention_attrs(cls, {"DecoderLayer"}, {}) == {"layers": False}


GLM_ATTENTION = dedent("""\


    class LlamaAttention(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.heads = config.num_attention_heads
            self.groups = config.multi_query_group_num
            self.size_per_head = config.kv_channels

        def forward(self, hidden_states, **kwargs):
            q, k, v = self.query_key_value(hidden_states).split(self.sizes, dim=-1)
            q = q.view(q.size()[:-1] + (self.heads, self.size_per_head))
            k = k.view(k.size()[:-1] + (self.groups, self.size_per_head))
            v = v.view(v.size()[:-1] + (self.groups, self.size_per_head))
            out = heads_first_attention(self, q.transpose(1, 2), k, v)
            return self.dense(out)
    """)


def test_key_heads_and_head_size_named_otherwise_are_read_from_how_forward_views_them(run_rule):
    """ChatGLM's `multi_query_group_num` key heads of `kv_channels` each: none of the names the layer knows."""
    out = run_rule(rule, HEADER + GLM_ATTENTION + CALLERS)
    ctor = ctor_line(out)
    assert "head_dim=self.size_per_head" in ctor and "num_kv_heads=self.groups" in ctor
    same = GLM_ATTENTION.replace("(self.groups, self.size_per_head)", "(self.heads, self.size_per_head)")
    assert "num_kv_heads" not in ctor_line(run_rule(rule, HEADER + same + CALLERS))  # as many as the queries


def test_a_view_by_whatever_is_left_is_no_head_count(run_rule):
    minus_one = GLM_ATTENTION.replace("(self.groups, self.size_per_head)", "(-1, self.size_per_head)")
    assert "num_kv_heads" not in ctor_line(run_rule(rule, HEADER + minus_one + CALLERS))


def test_query_heads_named_otherwise_are_read_from_how_forward_views_the_queries(run_rule, make_ctx):
    """Meta's reference Llama: `__init__(self, args, layer_id)`, no `config` and no `self.num_heads`; forward
    views the queries by `self.n_local_heads`, which the layer is built with."""
    meta = (
        GLM_ATTENTION.replace("def __init__(self, config, layer_idx):", "def __init__(self, args, layer_id):")
        .replace("config.", "args.")
        .replace("self.heads", "self.n_local_heads")
    )
    ctor = ctor_line(run_rule(rule, HEADER + meta + CALLERS))
    assert "num_heads=self.n_local_heads" in ctor and "num_kv_heads=self.groups" in ctor
    assert run_rule(rule, HEADER + meta + CALLERS, make_ctx()).count("self.attn = Attention(") == 1
    # queries viewed by a size computed at run time: no head count the layer can be built with
    unsized = meta.replace(
        "(self.n_local_heads, self.size_per_head)", "(q.shape[-1] // 8, self.size_per_head)"
    )
    ctx = make_ctx()
    assert "self.attn = Attention(" not in run_rule(rule, HEADER + unsized + CALLERS, ctx)
    (finding,) = ctx.findings
    assert "queries viewed by a head count it holds" in finding.what and finding.scope == "LlamaAttention"


def test_layers_appended_to_the_module_list_attribute_itself_are_found():
    # Meta's reference Llama: `self.layers = torch.nn.ModuleList()`, then `self.layers.append(Block(...))`
    import libcst as cst

    from skills.migrator.call_sites import instance_attrs
    from skills.migrator.rules.runtime_attention import _attention_attrs

    cls = cst.parse_module(
        dedent("""\
            class Model(nn.Module):
                def __init__(self, params):
                    self.layers = torch.nn.ModuleList()
                    for layer_id in range(params.n_layers):
                        self.layers.append(TransformerBlock(layer_id, params))
                    self.norm = Norm(params)
            """)
    ).body[0]
    assert _attention_attrs(cls, {"TransformerBlock"}, {}) == {"layers": False}
    init = cls.body.body[0]
    assert instance_attrs(init, {"TransformerBlock", "Norm"}) == {
        "layers": ("TransformerBlock", True),
        "norm": ("Norm", False),
    }
    # a list that starts with other modules, or grows otherwise than by append, holds what the file cannot tell
    mixed = dedent("""\
        def __init__(self, params):
            layers = [Dense(params) for _ in range(2)]
            layers.append(TransformerBlock(0, params))
            self.layers = nn.ModuleList(layers)
            self.blocks = nn.ModuleList()
            self.blocks.append(TransformerBlock(1, params))
            self.blocks.extend(others)
        """)
    assert instance_attrs(cst.parse_module(mixed).body[0], {"TransformerBlock", "Dense"}) == {}


NANO_ATTENTION = dedent("""\


    class LlamaAttention(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
            self.n_head = config.n_head
            self.n_embd = config.n_embd

        def forward(self, hidden_states, **kwargs):
            B, T, C = hidden_states.size()
            q, k, v = self.c_attn(hidden_states).split(self.n_embd, dim=2)
            q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            out = heads_first_attention(self, q, k, v)
            return self.c_proj(out.transpose(1, 2).reshape(B, T, C))
    """)


def test_a_head_size_from_the_input_width_is_the_width_its_projection_takes(run_rule):
    """nanoGPT: `B, T, C = x.size()`, queries viewed by `C // self.n_head` after `self.c_attn(x)`: C is what
    c_attn takes, `config.n_embd`, which __init__ can build the layer with."""
    assert "head_dim=config.n_embd // self.n_head," in ctor_line(
        run_rule(rule, HEADER + NANO_ATTENTION + CALLERS)
    )
    # a width read off a tensor no projection of __init__ takes gives no head size to build the layer with
    unsized = NANO_ATTENTION.replace("self.c_attn(hidden_states)", "self.c_attn(hidden_states * 2)")
    assert "head_dim=config.n_embd" not in ctor_line(run_rule(rule, HEADER + unsized + CALLERS))


def test_torch_s_own_attention_modules_are_refused_by_name(run_rule, make_ctx):
    """A block built on nn.MultiheadAttention (its packed in_proj_weight, masks given per call) is named in the
    refusal with its construction, not only as an entry without a standard attention call; a class of the file's
    own that shares a name with one (Meta's `Transformer`) is not taken for torch's."""
    code = dedent("""\
        class Block(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.attn = nn.MultiheadAttention(config.n_embd, config.n_head, batch_first=True)


        class Transformer(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.h = nn.ModuleList([Block(config) for _ in range(2)])


        class LlamaForCausalLM(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.model = Transformer(config)
                self.lm_head = nn.Linear(config.n_embd, config.vocab_size)
        """)
    ctx = make_ctx()
    assert run_rule(rule, code, ctx) == code
    (finding,) = ctx.findings
    assert finding.scope == "Block" and finding.what.startswith(
        "`nn.MultiheadAttention(config.n_embd, config.n_head, batch_first=True)` is torch's own attention module"
    )
