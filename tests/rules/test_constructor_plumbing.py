"""constructor_plumbing: constructors take `(config, ..., infer_config, comm_manager, prefix)` and pass them
down to every in-file module holding weights, `prefix` naming the child's path."""

import ast
from textwrap import dedent

import pytest

from skills.migrator.rules.constructor_plumbing import ConstructorPlumbing as rule

# The llama module tree (RMSNorm / rotary: no weighted children -> not plumbed; MLP / attention:
# nn.Linear / runtime Attention -> plumbed; the decoder and model: plumbed children), plus an MoE-style
# generator expression.
BEFORE = dedent("""\
    class LlamaRMSNorm(nn.Module):
        def __init__(self, hidden_size, eps=1e-6):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden_size))


    class LlamaRotaryEmbedding(nn.Module):
        def __init__(self, config, device=None):
            super().__init__()
            self.config = config


    class LlamaMLP(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)


    class LlamaAttention(nn.Module):
        def __init__(self, config, layer_idx: int):
            super().__init__()
            self.attn = Attention(num_heads=config.num_attention_heads, head_dim=config.head_dim)


    class LlamaDecoderLayer(nn.Module):
        def __init__(self, config, layer_idx: int):
            super().__init__()
            self.self_attn = LlamaAttention(config=config, layer_idx=layer_idx)
            self.mlp = LlamaMLP(config)
            self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


    class LlamaModel(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(
                [LlamaDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
            )
            self.experts = nn.ModuleList(LlamaMLP(config) for e in range(4))
            self.rotary_emb = LlamaRotaryEmbedding(config=config)


    class LlamaForCausalLM(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.model = LlamaModel(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    """)

AFTER = dedent("""\
    from runtime.config import InferenceConfig
    from runtime.config.comm_manager import CommManager
    from runtime.layers.prefix import join_prefix

    class LlamaRMSNorm(nn.Module):
        def __init__(self, hidden_size, eps=1e-6):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden_size))


    class LlamaRotaryEmbedding(nn.Module):
        def __init__(self, config, device=None):
            super().__init__()
            self.config = config


    class LlamaMLP(nn.Module):
        def __init__(self, config, infer_config: InferenceConfig, comm_manager: CommManager | None = None, prefix: str = ""):
            super().__init__()
            self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)


    class LlamaAttention(nn.Module):
        def __init__(self, config, layer_idx: int, infer_config: InferenceConfig, comm_manager: CommManager | None = None, prefix: str = ""):
            super().__init__()
            self.attn = Attention(num_heads=config.num_attention_heads, head_dim=config.head_dim)


    class LlamaDecoderLayer(nn.Module):
        def __init__(self, config, layer_idx: int, infer_config: InferenceConfig, comm_manager: CommManager | None = None, prefix: str = ""):
            super().__init__()
            self.self_attn = LlamaAttention(config=config, layer_idx=layer_idx, infer_config=infer_config, comm_manager=comm_manager, prefix=join_prefix(prefix, "self_attn"))
            self.mlp = LlamaMLP(config, infer_config=infer_config, comm_manager=comm_manager, prefix=join_prefix(prefix, "mlp"))
            self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


    class LlamaModel(nn.Module):
        def __init__(self, config, infer_config: InferenceConfig, comm_manager: CommManager | None = None, prefix: str = ""):
            super().__init__()
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(
                [LlamaDecoderLayer(config, layer_idx, infer_config=infer_config, comm_manager=comm_manager, prefix=join_prefix(prefix, f"layers.{layer_idx}")) for layer_idx in range(config.num_hidden_layers)]
            )
            self.experts = nn.ModuleList(LlamaMLP(config, infer_config=infer_config, comm_manager=comm_manager, prefix=join_prefix(prefix, f"experts.{e}")) for e in range(4))
            self.rotary_emb = LlamaRotaryEmbedding(config=config)


    class LlamaForCausalLM(nn.Module):
        def __init__(self, config, infer_config: InferenceConfig, comm_manager: CommManager | None = None, prefix: str = ""):
            super().__init__()
            self.model = LlamaModel(config, infer_config=infer_config, comm_manager=comm_manager, prefix=join_prefix(prefix, "model"))
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    """)


def test_plumbing_and_prefix_paths(run_rule):
    # Comprehension loop variables become f-string parts of the prefix: layers.{layer_idx}, experts.{e}.
    assert run_rule(rule, BEFORE) == AFTER


def test_plumbed_classes():
    import libcst as cst

    from skills.migrator.rules.constructor_plumbing import plumbed_classes

    assert plumbed_classes(cst.parse_module(BEFORE), "LlamaForCausalLM") == {
        "LlamaForCausalLM",
        "LlamaModel",
        "LlamaDecoderLayer",
        "LlamaAttention",
        "LlamaMLP",
    }


def test_idempotent(run_rule):
    assert run_rule(rule, AFTER) == AFTER


def test_defaulted_parameters_keep_infer_config_optional(run_rule):
    code = dedent("""\
        class Qwen3MLP(nn.Module):
            def __init__(self, config, intermediate_size=None):
                super().__init__()
                self.up_proj = nn.Linear(config.hidden_size, intermediate_size or config.intermediate_size)


        class Qwen3ForCausalLM(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.mlp = Qwen3MLP(config, intermediate_size=8)
        """)
    mlp, entry = [
        s
        for s in ast.parse(run_rule(rule, code, entry_class="Qwen3ForCausalLM")).body
        if isinstance(s, ast.ClassDef)
    ]
    mlp_init = mlp.body[0]
    assert [a.arg for a in mlp_init.args.args] == [
        "self",
        "config",
        "intermediate_size",
        "infer_config",
        "comm_manager",
        "prefix",
    ]
    assert [ast.unparse(d) for d in mlp_init.args.defaults] == ["None", "None", "None", "''"]
    entry_init = entry.body[0]
    assert [ast.unparse(d) for d in entry_init.args.defaults] == ["None", "''"]


@pytest.mark.parametrize("entry", ["LlamaForCausalLM", "MissingForCausalLM"])
def test_untouched_without_weighted_modules_or_entry(run_rule, entry):
    # An entry class already in contract form (infer_config present) is not re-plumbed, and its
    # weight-free RMSNorm never is; a file without the entry class is left alone entirely.
    code = dedent("""\
        class LlamaRMSNorm(nn.Module):
            def __init__(self, hidden_size, eps=1e-6):
                super().__init__()
                self.weight = nn.Parameter(torch.ones(hidden_size))


        class LlamaForCausalLM(nn.Module):
            def __init__(self, config, infer_config, comm_manager=None, prefix=""):
                super().__init__()
                self.norm = LlamaRMSNorm(config.hidden_size)
        """)
    assert run_rule(rule, code, entry_class=entry) == code


# BltGlobalTransformer (BltForCausalLM) builds its layers in a for loop with `.append`.
BLT = dedent("""\
    class BltTransformerLayer(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.mlp = nn.Linear(config.hidden_size, config.hidden_size)


    class BltGlobalTransformer(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.layers = nn.ModuleList()
            for layer_idx in range(config.num_hidden_layers):
                self.layers.append(BltTransformerLayer(config, layer_idx))


    class BltForCausalLM(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.model = BltGlobalTransformer(config)
    """)


def test_for_loop_append_prefix(run_rule):
    out = run_rule(rule, BLT, entry_class="BltForCausalLM")
    assert 'prefix=join_prefix(prefix, f"layers.{layer_idx}")' in out


def _between_layer_and_entry(model: str) -> str:
    """A `Model` class's code between a weighted `Layer` it builds and the entry class that builds it."""
    layer = dedent("""\
        class Layer(nn.Module):
            def __init__(self, config, layer_idx):
                super().__init__()
                self.mlp = nn.Linear(config.hidden_size, config.hidden_size)
        """)
    entry = dedent("""\
        class ModelForCausalLM(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.model = Model(config)
        """)
    return "\n\n".join([layer, dedent(model), entry])


def test_layers_gathered_in_a_local_list_get_their_list_prefix(run_rule):
    # ZambaModel (v5): layers built into a local, appended to a list, which a ModuleList then holds
    code = _between_layer_and_entry("""\
        class Model(nn.Module):
            def __init__(self, config):
                super().__init__()
                layers = []
                for layer_id, kind in enumerate(config.kinds):
                    layer = Layer(config, layer_id)
                    layers.append(Layer(config, layer_id) if kind else layer)
                self.layers = nn.ModuleList(layers)
                self.norm = Layer(config, 0)
        """)
    out = run_rule(rule, code, entry_class="ModelForCausalLM")
    assert out.count('prefix=join_prefix(prefix, f"layers.{layer_id}")') == 2
    assert 'prefix=join_prefix(prefix, "norm")' in out
    assert run_rule(rule, out, entry_class="ModelForCausalLM") == out


def test_a_builder_method_init_calls_takes_the_contract_and_passes_it_down(run_rule):
    # Zamba2Model (v5): `self.layers = self.get_layers()`, a method that appends the layers to a list
    code = _between_layer_and_entry("""\
        class Model(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.config = config
                self.layers = self.get_layers()

            def get_layers(self):
                layers = []
                for layer_id in range(self.config.num_hidden_layers):
                    layers.append(Layer(self.config, layer_id))
                return nn.ModuleList(layers)
        """)
    out = run_rule(rule, code, entry_class="ModelForCausalLM")
    assert (
        "self.layers = self.get_layers(infer_config=infer_config, comm_manager=comm_manager, prefix=prefix)"
        in out
    )
    assert (
        "def get_layers(self, infer_config: InferenceConfig, comm_manager: CommManager | None = None" in out
    )
    assert 'prefix=join_prefix(prefix, f"layers.{layer_id}")' in out
    assert run_rule(rule, out, entry_class="ModelForCausalLM") == out
    # a builder with a defaulted parameter takes the contract defaulted too (still valid Python)
    defaulted = code.replace("self.get_layers()", "self.get_layers(2)").replace(
        "def get_layers(self):", "def get_layers(self, count=None):"
    )
    out = run_rule(rule, defaulted, entry_class="ModelForCausalLM")
    assert "def get_layers(self, count=None, infer_config: InferenceConfig = None" in out
    compile(out, "modeling.py", "exec")
    # a method that builds no module keeps its signature
    plain = code.replace(
        "        self.layers = self.get_layers()\n",
        "        self.layers = self.get_layers()\n        self.reset()\n\n    def reset(self):\n        self.count = 0\n",
    )
    assert "def reset(self):" in plain
    out = run_rule(rule, plain, entry_class="ModelForCausalLM")
    assert "def reset(self):" in out and "        self.reset()\n" in out


def test_stacked_expert_parameters_count_as_weights():
    """An experts module holding `[num_experts, ...]` parameters is plumbed, and so is the MoE block building it;
    a module of 2-D parameters only (a router) is not."""
    import libcst as cst

    from skills.migrator.rules.constructor_plumbing import plumbed_classes

    code = dedent("""\
        class MoeExperts(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.num_experts = config.num_experts
                self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * config.moe_dim, config.hidden))
                self.down_proj = nn.Parameter(torch.empty((self.num_experts, config.hidden, config.moe_dim)))


        class MoeRouter(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden))


        class MoeBlock(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.experts = MoeExperts(config)
                self.gate = MoeRouter(config)


        class MoeForCausalLM(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.mlp = MoeBlock(config)
        """)
    assert plumbed_classes(cst.parse_module(code), "MoeForCausalLM") == {
        "MoeForCausalLM",
        "MoeBlock",
        "MoeExperts",
    }


def test_a_class_built_through_an_alias_is_a_finding(run_rule, make_ctx):
    # RoBERTa-style layers pick their attention class first (`cls = A if c else B`), DeepSeek-V4 from a dict.
    code = dedent("""\
        class SelfAttention(nn.Module):
            def __init__(self, config):
                self.q = nn.Linear(config.hidden_size, config.hidden_size)


        class CrossAttention(SelfAttention):
            pass


        KINDS = {"self": SelfAttention}


        class LlamaForCausalLM(nn.Module):
            def __init__(self, config):
                attention_class = CrossAttention if config.cross else SelfAttention
                self.attn = attention_class(config)
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)
        """)
    ctx = make_ctx()
    run_rule(rule, code, ctx)
    assert [(f.scope, f.what.split(" is ")[0]) for f in ctx.findings] == [
        ("LlamaForCausalLM", "`SelfAttention`"),
        ("<module>", "`SelfAttention`"),
    ]


def test_a_choice_between_plumbed_classes_is_plumbed_like_a_direct_call(run_rule, make_ctx):
    # BERT-style attention picks its class by a constructor flag; both hold weights, so both take the contract.
    code = dedent("""\
        class SelfAttention(nn.Module):
            def __init__(self, config, is_causal=False):
                self.q = nn.Linear(config.hidden_size, config.hidden_size)


        class CrossAttention(nn.Module):
            def __init__(self, config, is_causal=False):
                self.q = nn.Linear(config.hidden_size, config.hidden_size)


        class LlamaForCausalLM(nn.Module):
            def __init__(self, config, is_cross_attention=False):
                attention_class = CrossAttention if is_cross_attention else SelfAttention
                self.self = attention_class(config, is_causal=True)
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)
        """)
    ctx = make_ctx()
    out = run_rule(rule, code, ctx)
    assert not ctx.findings
    assert (
        "self.self = attention_class(config, is_causal=True, infer_config=infer_config, "
        'comm_manager=comm_manager, prefix=join_prefix(prefix, "self"))' in out
    )
    assert run_rule(rule, out) == out


def test_a_module_built_from_plain_sizes_is_plumbed_too(run_rule):
    # XGLM's `XGLMAttention(embed_dim, num_heads, bias=True)` takes no config; parallelize needs its comm_manager
    code = dedent("""\
        class XGLMAttention(nn.Module):
            def __init__(self, embed_dim, num_heads, bias=True):
                super().__init__()
                self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)


        class XGLMForCausalLM(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.self_attn = XGLMAttention(embed_dim=config.d_model, num_heads=config.attention_heads)
        """)
    out = run_rule(rule, code, entry_class="XGLMForCausalLM")
    assert (
        "def __init__(self, embed_dim, num_heads, bias=True, infer_config: InferenceConfig = None, "
        'comm_manager: CommManager | None = None, prefix: str = ""):'
    ) in out
    assert (
        "XGLMAttention(embed_dim=config.d_model, num_heads=config.attention_heads, infer_config=infer_config, "
        'comm_manager=comm_manager, prefix=join_prefix(prefix, "self_attn"))'
    ) in out
    assert run_rule(rule, out, entry_class="XGLMForCausalLM") == out


def test_classes_picked_from_a_constructor_s_own_table_are_plumbed(run_rule, make_ctx):
    # Inkling2-Loop picks each layer's class from a table local to its model's constructor
    model = """\
        class Model(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.layers = nn.ModuleList()
                layer_classes = {(False, False): Layer, (True, False): LoopLayer}
                for layer_idx in range(config.num_hidden_layers):
                    layer_class = layer_classes[(False, layer_idx in config.loop)]
                    self.layers.append(layer_class(config, layer_idx))
        """
    code = _between_layer_and_entry(model).replace(
        "class Model(nn.Module):",
        dedent("""\
            class LoopLayer(nn.Module):
                def __init__(self, config, layer_idx):
                    super().__init__()
                    self.gate = nn.Linear(config.hidden_size, config.hidden_size)


            class Model(nn.Module):"""),
    )
    ctx = make_ctx(entry_class="ModelForCausalLM")
    out = run_rule(rule, code, ctx)
    assert not ctx.findings
    assert (
        "self.layers.append(layer_class(config, layer_idx, infer_config=infer_config, comm_manager=comm_manager, "
        'prefix=join_prefix(prefix, f"layers.{layer_idx}")))'
    ) in out
    assert out.count("def __init__(self, config, layer_idx, infer_config: InferenceConfig") == 2
    assert run_rule(rule, out, entry_class="ModelForCausalLM") == out
    # a table also read otherwise holds the classes beyond the calls the rule plumbs: refused by name
    ctx = make_ctx(entry_class="ModelForCausalLM")
    escaped = code.replace(
        "        for layer_idx", "        self.kinds = list(layer_classes)\n        for layer_idx"
    )
    run_rule(rule, escaped, ctx)
    assert [f.what.split(" is ")[0] for f in ctx.findings] == ["`Layer`", "`LoopLayer`"]
