"""Checkpoint loading paths: safetensors (elsewhere), .bin through weights_only, dummy weights."""

import shutil

import pytest
import torch
from model_dirs import make_model_dir, prefill_logits
from safetensors.torch import load_file

from runtime.engine.loader import iterate_weights
from runtime.errors import UserError


def test_bin_checkpoint_loads_like_safetensors(tmp_path, tiny_llama_dir):
    ckpt = tmp_path / "bin_ckpt"
    shutil.copytree(tiny_llama_dir, ckpt)
    torch.save(load_file(ckpt / "model.safetensors"), ckpt / "pytorch_model.bin")
    (ckpt / "model.safetensors").unlink()
    ids = [[5, 6, 7, 8], [9, 10]]
    expected = prefill_logits(make_model_dir(tmp_path / "a", tiny_llama_dir), ids)
    got = prefill_logits(make_model_dir(tmp_path / "b", ckpt), ids)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


class _Payload:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_bin_with_arbitrary_pickle_is_refused(tmp_path):
    torch.save({"w": _Payload()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(UserError, match="safetensors"):
        list(iterate_weights(tmp_path))


def test_dummy_weights_run_without_a_checkpoint_file(tmp_path, tiny_llama_dir):
    ckpt = tmp_path / "no_weights"
    shutil.copytree(tiny_llama_dir, ckpt, ignore=shutil.ignore_patterns("*.safetensors"))
    import yaml

    model_dir = make_model_dir(tmp_path, ckpt)
    yaml_path = model_dir / "config" / "contract_llama.yaml"
    doc = yaml.safe_load(yaml_path.read_text())
    doc["model_config"]["with_ckpt"] = False
    yaml_path.write_text(yaml.safe_dump(doc))
    first = prefill_logits(model_dir, [[1, 2, 3]])
    assert torch.isfinite(first).all()
    torch.testing.assert_close(prefill_logits(model_dir, [[1, 2, 3]]), first)  # same seed on every run


class _Router(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4, 2))
        self.e_score_correction_bias = torch.nn.Buffer(torch.zeros(4))  # persistent: checkpoints carry it
        self.inv_freq = torch.nn.Buffer(torch.ones(2), persistent=False)


def test_persistent_buffers_load_like_parameters_and_missing_ones_keep_their_values(caplog):
    from runtime.layers.weights import load_named_weights, missing_weights

    router = _Router()
    loaded = load_named_weights(
        router, [("weight", torch.ones(4, 2)), ("e_score_correction_bias", torch.arange(4.0))]
    )
    assert torch.equal(router.e_score_correction_bias, torch.arange(4.0)) and not missing_weights(
        router, loaded
    )
    with pytest.raises(UserError, match="'inv_freq' matches no parameter"):
        load_named_weights(router, [("inv_freq", torch.zeros(2))])  # a non-persistent buffer is not a weight
    assert missing_weights(_Router(), {"weight"}) == []
    assert "no values for buffers ['e_score_correction_bias']" in caplog.text


def test_zero_dim_weights_load_from_safetensors(tmp_path):
    # XIELU activations (apertus) keep 0-dim `beta` / `eps` buffers in the checkpoint.
    from safetensors.torch import save_file

    from runtime.layers.weights import load_named_weights

    class Act(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.beta = torch.nn.Buffer(torch.tensor(0.0))

    save_file({"beta": torch.tensor(0.5)}, tmp_path / "model.safetensors")
    act = Act()
    assert load_named_weights(act, iterate_weights(tmp_path)) == {"beta"} and act.beta.item() == 0.5


class _Layers(torch.nn.Module):
    """One decoder layer whose config says its checkpoint also ships a multi-token-prediction layer."""

    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"num_hidden_layers": 1, "num_nextn_predict_layers": 1})()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2, bias=False)])


def test_mtp_layers_and_ignored_names_are_skipped_with_a_warning_and_others_refused(caplog):
    from runtime.layers.weights import load_named_weights

    model = _Layers()
    checkpoint = [
        ("layers.0.weight", torch.ones(2, 2)),
        ("layers.1.weight", torch.ones(2, 2)),  # the MTP layer past the model's own
        ("layers.1.eh_proj.weight", torch.ones(4, 2)),
        ("rotary.inv_freq", torch.ones(1)),
    ]
    with caplog.at_level("WARNING"):
        assert load_named_weights(model, checkpoint, ignored=[r"inv_freq"]) == {"layers.0.weight"}
    text = caplog.text
    assert (
        "skipped 2 checkpoint tensors, multi-token-prediction layers" in text and "layers.1.eh_proj" in text
    )
    assert "skipped 1 checkpoint tensors, ignored by the model" in text
    with pytest.raises(UserError, match="'rotary.inv_freq' matches no parameter"):
        load_named_weights(model, checkpoint)


class _FusedOnDisk(torch.nn.Module):
    """Parameter names of transformers' sarvam_moe (q/k/v of unequal sizes) and hrm_text (gate/up)."""

    def __init__(self, model_type: str):
        super().__init__()
        self.config = type("Config", (), {"model_type": model_type})()
        attn = torch.nn.Module()
        attn.q_proj, attn.k_proj, attn.v_proj = (torch.nn.Linear(4, n, bias=False) for n in (4, 2, 2))
        mlp = torch.nn.Module()
        mlp.gate_proj, mlp.up_proj = torch.nn.Linear(4, 3, bias=False), torch.nn.Linear(4, 3, bias=False)
        self.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.layers[0].self_attn, self.layers[0].mlp = attn, mlp


class _HalfShard:
    tp_size = 2

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        raise AssertionError("a fused tensor is split before it reaches a sharded loader")


def test_tensors_fused_on_disk_are_split_as_transformers_converts_them():
    from runtime.layers.weights import load_named_weights

    qkv = torch.arange(32.0).view(8, 4)  # rows [q | k | v], sized like the parameters
    model = _FusedOnDisk("sarvam_moe")
    assert load_named_weights(model, [("layers.0.attention.query_key_value.weight", qkv)]) == {
        f"layers.0.self_attn.{p}_proj.weight" for p in "qkv"
    }
    attn = model.layers[0].self_attn
    assert torch.equal(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), qkv)
    assert attn.k_proj.weight.shape == (2, 4)

    gate_up = torch.arange(24.0).view(6, 4)  # equal chunks
    model = _FusedOnDisk("hrm_text")
    load_named_weights(model, [("layers.0.mlp.gate_up_proj.weight", gate_up)])
    assert torch.equal(model.layers[0].mlp.up_proj.weight, gate_up[3:])

    with pytest.raises(UserError, match=r"has 9 rows; .* need \[4, 2, 2\]"):
        load_named_weights(
            _FusedOnDisk("sarvam_moe"), [("layers.0.attention.query_key_value.weight", torch.zeros(9, 4))]
        )

    # a target sharded by tensor parallelism cannot be sized from its shard
    sharded = _FusedOnDisk("sarvam_moe")
    sharded.layers[0].self_attn.k_proj.weight.weight_loader = _HalfShard().weight_loader
    with pytest.raises(UserError, match="holds .*q_proj.weight, .*k_proj.weight, .*v_proj.weight fused"):
        load_named_weights(sharded, [("layers.0.attention.query_key_value.weight", qkv)])


def test_tensors_apart_on_disk_are_joined_into_the_parameter_that_concatenates_them():
    """OLMo-Hybrid's checkpoint keeps q / k / v convolutions apart (`linear_attn.{q,k,v}_conv1d`); the model, as
    transformers converts it, one `conv1d` of their rows, in whatever order the tensors come."""
    from runtime.layers.weights import load_named_weights

    model = torch.nn.Module()
    model.config = type("Config", (), {"model_type": "olmo_hybrid"})()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].linear_attn = torch.nn.Module()
    model.layers[0].linear_attn.conv1d = torch.nn.Conv1d(10, 10, 4, groups=10, bias=False)
    parts = {p: torch.full((n, 1, 4), float(i)) for i, (p, n) in enumerate([("q", 3), ("k", 3), ("v", 4)])}
    weights = [(f"layers.0.linear_attn.{p}_conv1d.weight", parts[p]) for p in "vqk"]
    assert load_named_weights(model, weights) == {"layers.0.linear_attn.conv1d.weight"}
    assert torch.equal(model.layers[0].linear_attn.conv1d.weight, torch.cat([parts[p] for p in "qkv"]))
    with pytest.raises(UserError, match="only some of the tensors that layers.0.linear_attn.conv1d.weight"):
        load_named_weights(model, weights[:2])


def test_renames_with_their_own_logic_and_conversions_of_one_tensor_are_transformers_own():
    """Inkling2's checkpoint: `attn_res.attn_queries.{i}` belongs to layer i + 1 (a renaming that shifts the index)
    and the experts' gate / up rows are interleaved on disk (`Interleave`); the loader applies transformers' own
    rules, so the parameters hold what transformers loads."""
    from transformers.core_model_loading import Interleave

    from runtime.layers.weights import load_named_weights

    model = torch.nn.Module()
    model.config = type("Config", (), {"model_type": "inkling2_text"})()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(2)])
    model.model.layers[1].attention_input = torch.nn.Module()
    model.model.layers[1].attention_input.query = torch.nn.Parameter(torch.zeros(3, 4))
    model.model.layers[0].mlp = torch.nn.Module()
    model.model.layers[0].mlp.experts = torch.nn.Module()
    model.model.layers[0].mlp.experts.gate_up_proj = torch.nn.Parameter(torch.zeros(2, 6, 4))
    query, w13 = torch.randn(3, 4), torch.arange(48.0).view(2, 6, 4)
    weights = [
        ("model.llm.attn_res.attn_queries.0", query),
        ("model.llm.layers.0.mlp.experts.w13_weight", w13),
    ]
    assert load_named_weights(model, weights) == {
        "model.layers.1.attention_input.query",
        "model.layers.0.mlp.experts.gate_up_proj",
    }
    assert torch.equal(model.model.layers[1].attention_input.query, query)
    expected = Interleave(dim=1).convert({"w13": w13}, [], ["gate_up"])["gate_up"]
    assert torch.equal(model.model.layers[0].mlp.experts.gate_up_proj, expected) and not torch.equal(
        expected, w13
    )


def test_tensors_one_parameter_is_made_of_are_merged_by_transformers_own_op():
    """Inkling2-Loop's checkpoint keeps each loop layer's four message queries in two tables ([query, mlp] and
    [key, value] rows), which transformers' `Inkling2LoopMergeMessageQueries` interleaves into one parameter; its
    experts pass through their dequantization unchanged when the checkpoint is not quantized."""
    from transformers.core_model_loading import Inkling2LoopMergeMessageQueries

    from runtime.layers.weights import load_named_weights

    model = torch.nn.Module()
    model.config = type("Config", (), {"model_type": "inkling2_loop_text"})()
    model.model = torch.nn.Module()
    model.model.message_input = torch.nn.Module()
    model.model.message_input.query = torch.nn.Parameter(torch.zeros(2, 4, 3))
    model.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.model.layers[0].mlp = torch.nn.Module()
    model.model.layers[0].mlp.experts = torch.nn.Module()
    model.model.layers[0].mlp.experts.down_proj = torch.nn.Parameter(torch.zeros(2, 4, 3))
    queries, kv_queries, w2 = torch.randn(4, 3), torch.randn(4, 3), torch.randn(2, 4, 3)
    weights = [
        ("model.llm.middle_cycle_cross_pass_kv_queries", kv_queries),
        ("model.llm.layers.0.mlp.experts.w2_weight", w2),
        ("model.llm.middle_cycle_cross_pass_queries", queries),
    ]
    assert load_named_weights(model, weights) == {
        "model.message_input.query",
        "model.layers.0.mlp.experts.down_proj",
    }
    sources = ["queries", "kv_queries"]
    parts = {"queries": queries, "kv_queries": kv_queries}
    merged = Inkling2LoopMergeMessageQueries().convert(parts, sources, ["query"])["query"]
    assert torch.equal(model.model.message_input.query, merged)
    assert torch.equal(merged[:, 1:3], kv_queries.view(2, 2, 3)) and torch.equal(merged[:, 3], queries[1::2])
    assert torch.equal(model.model.layers[0].mlp.experts.down_proj, w2)


def test_buffers_a_module_names_as_skipped_are_not_loaded_and_others_still_refused():
    """minGPT's checkpoint holds each attention's causal buffer (`h.0.attn.bias`), which the migrated attention
    no longer has and names in `_skipped_checkpoint_buffers`: skipped. A tensor no module names stays an error."""
    from runtime.layers.weights import SKIPPED_BUFFERS, load_named_weights

    attn = torch.nn.Module()
    attn.c_proj = torch.nn.Linear(4, 4, bias=False)
    setattr(attn, SKIPPED_BUFFERS, ("bias",))
    model = torch.nn.Module()
    model.h = torch.nn.ModuleList([torch.nn.Module()])
    model.h[0].attn = attn
    weights = [("h.0.attn.bias", torch.ones(1, 1, 8, 8)), ("h.0.attn.c_proj.weight", torch.ones(4, 4))]
    assert load_named_weights(model, weights) == {"h.0.attn.c_proj.weight"}
    with pytest.raises(UserError, match="'h.0.attn.masked_bias' matches no parameter"):
        load_named_weights(model, [("h.0.attn.masked_bias", torch.ones(1))])


def test_a_checkpoint_of_a_flat_trunk_loads_under_the_base_model_prefix():
    """A flat minGPT's checkpoint names its trunk at the top (`wte.weight`); the migrated entry holds it in
    `model` and names that its `base_model_prefix`: those names load there, the head's where they are."""
    from runtime.layers.weights import load_named_weights

    model = torch.nn.Module()
    model.base_model_prefix = "model"
    model.model = torch.nn.Module()
    model.model.wte = torch.nn.Embedding(8, 4)
    model.lm_head = torch.nn.Linear(4, 8, bias=False)
    wte, head = torch.randn(8, 4), torch.randn(8, 4)
    assert load_named_weights(model, [("wte.weight", wte), ("lm_head.weight", head)]) == {
        "model.wte.weight",
        "lm_head.weight",
    }
    assert torch.equal(model.model.wte.weight, wte) and torch.equal(model.lm_head.weight, head)
    assert load_named_weights(model, [("model.wte.weight", head)]) == {"model.wte.weight"}


def test_names_transformers_renames_reach_a_fused_parameter():
    """Exaone's checkpoint names (`transformer.h.0.attn.attention.k_proj`) are llama's after transformers'
    renaming for the type (`model.layers.0.self_attn.k_proj`), which the migrated code holds fused in qkv_proj."""
    from runtime.layers.linear import QKVParallelLinear
    from runtime.layers.weights import load_named_weights

    model = torch.nn.Module()
    model.config = type("Config", (), {"model_type": "exaone"})()
    attn = torch.nn.Module()
    attn.qkv_proj = QKVParallelLinear(4, 2, 2, 1)
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.model.layers[0].self_attn = attn
    parts = {"q": torch.ones(4, 4), "k": 2 * torch.ones(2, 4), "v": 3 * torch.ones(2, 4)}
    mapping = [(".qkv_proj", f".{p}_proj", p) for p in "qkv"]
    weights = [(f"transformer.h.0.attn.attention.{p}_proj.weight", w) for p, w in parts.items()]
    assert load_named_weights(model, weights, mapping) == {"model.layers.0.self_attn.qkv_proj.weight"}
    assert torch.equal(attn.qkv_proj.weight, torch.cat(list(parts.values())))


def test_a_tensor_fused_on_disk_splits_into_the_blocks_of_a_fused_layer():
    """Sarvam-MoE's `query_key_value` (q, k, v of unequal sizes) into the migrated code's qkv_proj: each part is
    sized by its block of the fused layer."""
    from runtime.layers.linear import QKVParallelLinear
    from runtime.layers.weights import load_named_weights

    model = _FusedOnDisk("sarvam_moe")
    model.layers[0].self_attn = attn = torch.nn.Module()
    attn.qkv_proj = QKVParallelLinear(4, 2, 2, 1)
    qkv = torch.arange(32.0).view(8, 4)
    mapping = [(".qkv_proj", f".{p}_proj", p) for p in "qkv"]
    loaded = load_named_weights(model, [("layers.0.attention.query_key_value.weight", qkv)], mapping)
    assert "layers.0.self_attn.qkv_proj.weight" in loaded
    assert torch.equal(attn.qkv_proj.weight, qkv)


def test_a_parameter_named_like_a_fused_part_loads_as_itself():
    """AFMoE's attention has its own `gate_proj` beside the MLP's, which the migrated code fuses into
    gate_up_proj: the attention's tensor loads into its own parameter, the MLP's into its block."""
    from runtime.layers.linear import MergedColumnParallelLinear
    from runtime.layers.weights import load_named_weights

    model = torch.nn.Module()
    model.self_attn, model.mlp = torch.nn.Module(), torch.nn.Module()
    model.self_attn.gate_proj = torch.nn.Linear(4, 2, bias=False)
    model.mlp.gate_up_proj = MergedColumnParallelLinear(4, [3, 3])
    mapping = [(".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]
    gate, mlp_gate, mlp_up = torch.ones(2, 4), torch.full((3, 4), 2.0), torch.full((3, 4), 3.0)
    weights = [
        ("self_attn.gate_proj.weight", gate),
        ("mlp.gate_proj.weight", mlp_gate),
        ("mlp.up_proj.weight", mlp_up),
    ]
    loaded = load_named_weights(model, weights, mapping)
    assert loaded == {"self_attn.gate_proj.weight", "mlp.gate_up_proj.weight"}
    assert torch.equal(model.self_attn.gate_proj.weight, gate)
    assert torch.equal(model.mlp.gate_up_proj.weight, torch.cat([mlp_gate, mlp_up]))


def test_rules_transformers_registers_for_an_inner_model_class_apply():
    """Dots3's per-expert tensors stack by the rules registered for its text model's class, not its own."""
    from runtime.layers.checkpoint_layout import CheckpointLayout

    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    assert CheckpointLayout("dots3_note_text", "Dots3NoteForCausalLM").resolve(name)[1] is None
    layout = CheckpointLayout("dots3_note_text", "Dots3NoteForCausalLM", ["Dots3NoteTextModel", "Linear"])
    target, part = layout.resolve(name)
    assert target == "model.layers.1.mlp.experts.down_proj" and (part.expert, part.part) == (2, 0)


class _Shared(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(2, 2, bias=False)


class _Tying(torch.nn.Module):
    """Zamba's pattern: every hybrid layer holds a copy of one shared block, tied by regex to the first."""

    def __init__(self, tie: bool, pattern: str = r"layers.(?!0\.)\d+.shared"):
        super().__init__()
        self.config = type("Config", (), {"tie_word_embeddings": tie})()
        self.layers = torch.nn.ModuleList(torch.nn.ModuleDict({"shared": _Shared()}) for _ in range(3))
        self._tied_weights_keys = {pattern: "layers.0.shared"}


def test_parameters_a_module_ties_by_pattern_are_shared_and_loaded_once():
    from runtime.layers.weights import load_named_weights, missing_weights, tie_declared_weights

    model = _Tying(tie=True)
    assert tie_declared_weights(model) == 2
    assert tie_declared_weights(model) == 0  # already shared
    weight = torch.arange(4.0).view(2, 2)
    loaded = load_named_weights(model, [("layers.0.shared.proj.weight", weight)])
    assert missing_weights(model, loaded) == []
    for layer in model.layers:
        assert torch.equal(layer["shared"].proj.weight, weight)


def test_weights_are_tied_only_when_the_config_ties_them():
    from runtime.layers.weights import tie_declared_weights

    model = _Tying(tie=False)  # transformers' switch for every tie: the checkpoint then holds each copy
    assert tie_declared_weights(model) == 0
    assert model.layers[1]["shared"].proj.weight is not model.layers[0]["shared"].proj.weight


def test_a_tie_pattern_that_matches_no_parameter_is_a_user_error():
    from runtime.layers.weights import tie_declared_weights

    with pytest.raises(UserError, match="ties 'nothing' to 'layers.0.shared'.*fix the pattern"):
        tie_declared_weights(_Tying(tie=True, pattern="nothing"))


def test_a_tie_between_parameters_of_different_shapes_is_a_user_error():
    from runtime.layers.weights import tie_declared_weights

    model = _Tying(tie=True)
    model.layers[2]["shared"].proj = torch.nn.Linear(2, 3, bias=False)
    with pytest.raises(UserError, match=r"ties 'layers.2.shared.proj.weight' \[3, 2\].*shapes differ"):
        tie_declared_weights(model)
