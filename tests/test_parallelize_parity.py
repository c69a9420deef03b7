"""`skill parallelize` on migrated tiny checkpoints: every scenario's multi-rank run (torchrun, gloo) gives the
greedy tokens of the single-rank run and of transformers, and every rank holds the parameter bytes the plan says."""

import json
from pathlib import Path

import pytest
import yaml
from hf_reference import (
    NEW_TOKENS,
    build_reference,
    migrate,
    parallel_yaml,
    parallelize,
    prompts_args,
)
from skill_process import skill_json

# mistral is llama's layout: its multi-rank scenarios run with `-m slow`, to keep `make test` under 30 minutes
ARCHS = ["llama", "qwen3", pytest.param("mistral", marks=pytest.mark.slow)]
# qwen3 (llama's layout plus q/k norms) runs the TP+DP pattern in `make test`, llama TP 2 from converted
# shards (and test_parallelize_cli); every other scenario x architecture runs with `-m slow`
SCENARIO_ARCHS = [
    pytest.param("llama", marks=pytest.mark.slow),
    "qwen3",
    pytest.param("mistral", marks=pytest.mark.slow),
]
# (architecture, scenario): qkv bias (qwen2); sliding-window layers with a scaled embedding the rules leave
# replicated, tied to the head (gemma3); attention sinks split by query heads, alternating sliding / full layers
# tied to the head, MoE experts left whole (gpt_oss); q/k/v and gate/up fused on disk (phi3); q / k norms over
# all heads, run on every head (olmo2); q, k and v interleaved per head in one tensor on disk, split by whole heads
# (gpt_neox, whose output projection is `dense`; bloom views it per head in a helper that reads `self.num_heads`,
# which becomes a rank's share, passes ALiBi slopes, cut to a rank's heads, and adds the residual inside attention
# and the MLP, after their sums); per-head q / k norms built only under `use_qk_norm`, which the checkpoint turns
# off (cohere: the branch becomes a guard, and migrate's fused file is overwritten without --force). `make test`
# runs one scenario of each new layout; `-m slow` the rest (qwen2's TP+DP run is llama's plus biases, gemma3's ties
# and windows are gpt_oss's under TP 2, gpt_neox's layout is bloom's).
OTHER_ARCHS = [
    pytest.param("qwen2", "tp2_dp2_dense_tp4", marks=pytest.mark.slow),
    pytest.param("gemma3_text", "tp2_dp2_dense_tp4", marks=pytest.mark.slow),
    ("gpt_oss", "tp2"),
    ("phi3", "tp2_dp2_dense_tp4"),
    pytest.param("phi3", "tp2", marks=pytest.mark.slow),
    ("olmo2", "tp2"),
    pytest.param("olmo2", "tp2_dp2_dense_tp4", marks=pytest.mark.slow),
    pytest.param("gpt_neox", "tp2", marks=pytest.mark.slow),
    ("bloom", "tp2"),
    ("cohere", "tp2"),
    ("beam", "tp2"),  # an output gate per head channel and a gate bias per head
    # k / v built only in layers that do not reuse another layer's keys (82 s: `-m slow`, for `make test`'s 30 min;
    # test_tp_attention checks the rewrite of projections built in some layers only)
    pytest.param("gemma3n_text", "tp2", marks=pytest.mark.slow),
    # Conv1D weights stored [in, out], q/k/v fused on disk cut by .split(n), learned positions under attention DP
    ("gpt2", "tp2_dp2_dense_tp4"),
    pytest.param("gpt2", "tp2", marks=pytest.mark.slow),
    # attention built from plain sizes, reshaped to `self.embed_dim` for its output projection; a sinusoidal
    # position table added to the embeddings under attention DP (53 s: `-m slow`, for `make test`'s 30 min; gpt2's
    # learned table under attention DP is in it)
    pytest.param("xglm", "tp2_dp2_dense_tp4", marks=pytest.mark.slow),
    # attention whose q / k / v inputs are one (MG027), a sinusoidal position buffer indexed by the positions
    pytest.param("ctrl", "tp2_dp2_dense_tp4", marks=pytest.mark.slow),
    # multi-query [q; k; v] given a head axis before its split, the per-head layout's `else:` guarded
    pytest.param("gpt_bigcode", "tp2", marks=pytest.mark.slow),
    # q, v and k in blocks of a quarter of the heads each (mp_num 4), a block width from the whole model's width
    pytest.param("codegen", "tp2", marks=pytest.mark.slow),
    pytest.param("laguna", "tp2", marks=pytest.mark.slow),  # a gate per head sized through a local
    # BART-style attention (k / v widths through locals, output reshaped to the input's width), a learned position
    # table given the runtime's positions by MG004, cross-attention built by transformers but not migrated
    pytest.param("trocr", "tp2_dp2_dense_tp4", marks=pytest.mark.slow),
    # multi-query [q heads; k; v] viewed in a helper whose other layouts are guarded, rotary and ALiBi Attention
    # layers on one cache, FalconLinear migrated to nn.Linear (MG028)
    pytest.param("falcon", "tp2_dp2_dense_tp4", marks=pytest.mark.slow),
    pytest.param(
        "modernbert-decoder", "tp2_dp2_dense_tp4", marks=pytest.mark.slow
    ),  # the output projection `Wo`
    # BERT-style attention and MLP, each split over two modules (the output projections in the siblings their
    # outputs are handed to, which add the residual and normalise), the LM head inside a module of its own, its
    # weight tied to the embedding and its bias to the module's
    ("bert-generation", "tp2_dp2_dense_tp4"),
    # two softmaxes over one q / k whose outputs pair head h with h + H/2: a rank's share of each half of the
    # heads (and its key head of each half replicated: one per half, two ranks)
    ("diffllama", "tp2"),
    pytest.param("diffllama", "tp2_dp2_dense_tp4", marks=pytest.mark.slow),
    # keys tiled over the query heads, from a mixture of attention experts: run whole on every rank
    # (REPLICATE_ATTENTION), between sharded embeddings and LM head, tokens gathered and this rank's kept under TP+DP
    ("jetmoe", "tp2_dp2_dense_tp4"),
    pytest.param("jetmoe", "tp2", marks=pytest.mark.slow),
    # a sparse layer's indexer (its own q_proj / k_proj, a key cache) whole on every rank, its block picks per key
    # head cut to each rank's heads; shared experts with gate and up fused on disk, split over dense_tp_group
    pytest.param("minimax_m3_vl_text", "tp2_dp2_dense_tp4", marks=pytest.mark.slow),
    # an LM head subclassing nn.Linear with a logit scale per vocabulary entry, tied to the embedding; its
    # attention (per-channel query scales, keys shared across a loop) run whole on every rank
    pytest.param("dory", "tp2", marks=pytest.mark.slow),
    # attention with a relative position bias per query, convolved keys and values and float32 pins, run whole on
    # every rank; routed experts over moe_ep_group, its stacked shared experts whole (Inkling)
    ("inkling_text", "tp2"),
]
# architectures parallelized with --replicate-attention
REPLICATE_ATTENTION = {"jetmoe", "dory", "inkling_text"}
# (world_size, attn_tp, dense_tp, embed_tp, lmhead_tp): the scenarios
SCENARIOS = {
    "tp2": (2, 2, 2, 2, 2),
    "tp4_kv_replicated": (4, 4, 4, 4, 4),  # 2 kv heads over 4 ranks
    "dp2_dense_tp2": (2, 1, 2, 2, 2),
    "tp2_dp2_dense_tp4": (4, 2, 4, 4, 4),  # the TP+DP pattern
}


# MoE: routed experts split over moe_ep_group (moe_ep_size = world_size / moe_tp_size) and their intermediate
# size over moe_tp_group; each scenario's (world, attn, dense, embed, lmhead) sizes and extra keys. Tokens
# replicated over the group (attention DP 1) sum partial outputs with all_reduce; the TP+DP layout dispatches
# (token, expert) pairs with all_to_all, or all_gathers rows.
MOE_SCENARIOS = {
    "ep2": ((2, 2, 2, 2, 2), {}),
    "ep4": ((4, 4, 4, 4, 4), {}),
    "moe_tp2": ((2, 2, 2, 2, 2), {"moe_tp_size": 2}),
    "tp2_ep4": ((4, 2, 4, 4, 4), {}),
    "tp2_ep4_all_gather": ((4, 2, 4, 4, 4), {"moe_dispatch": "all_gather"}),
    "tp2_moe_tp2_ep2": ((4, 2, 4, 4, 4), {"moe_tp_size": 2}),
}
# gpt_oss EP 2 runs in OTHER_ARCHS (its tp2 scenario splits the experts); `make test` runs deepseek_v3's TP+DP
# pattern (multi-head latent attention split by heads over attention TP 2, its sigmoid group-limited router, shared
# experts) with all_to_all over EP 2 and expert TP 2; `-m slow` every other pair
MOE_FAST = {("deepseek_v3", "tp2_moe_tp2_ep2")}
MOE_RUNS = [
    pytest.param(arch, name, marks=() if (arch, name) in MOE_FAST else pytest.mark.slow)
    for arch in ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")
    for name in MOE_SCENARIOS
]


def run(model_dir: Path, yaml_path: Path | None = None, *flags: str) -> dict:
    yaml_args = ["--yaml", yaml_path] if yaml_path else []
    return skill_json(
        "run",
        model_dir,
        "--json",
        "--raw",
        "--max-new-tokens",
        NEW_TOKENS,
        *prompts_args(),
        *yaml_args,
        *flags,
    )


def check_converted_shards(model_dir: Path, config: Path, out: Path, reference: dict) -> None:
    """`skill convert-weights` writes every rank's shards to `out`; the run from them gives transformers' tokens
    with the bytes convert-weights reports for each rank."""
    done = skill_json("convert-weights", model_dir, "--config", config, "-o", out, "--json")
    result = run(model_dir, Path(done["yaml"]))
    assert [o["token_ids"] for o in result["outputs"]] == reference["tokens"]
    assert result["param_bytes_per_rank"] == done["ranks"]


@pytest.fixture(scope="module", params=ARCHS)
def migrated(request, tmp_path_factory):
    reference = build_reference(request.param, tmp_path_factory)
    return reference, migrate(reference, tmp_path_factory.mktemp(f"{request.param}_model"))


@pytest.mark.parametrize("migrated", SCENARIO_ARCHS, indirect=True)
@pytest.mark.parametrize(
    "scenario",
    # TP 2 alone runs in test_tp2_from_convert_weights_output, attention DP with dense TP inside the TP+DP
    # pattern; kv-head replication is unit-tested (test_parallel_layers): their own runs here are `-m slow`
    [pytest.param(n, marks=pytest.mark.slow) if n != "tp2_dp2_dense_tp4" else n for n in SCENARIOS],
)
def test_scenarios_match_single_rank_and_transformers(migrated, scenario, tmp_path):
    reference, model_dir = migrated
    sizes = SCENARIOS[scenario]
    proc = parallelize(model_dir, parallel_yaml(tmp_path / f"{scenario}.yaml", *sizes), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = json.loads(proc.stdout)
    assert done["world_size"] == sizes[0] and Path(done["yaml"]).parent == model_dir / "config"
    config = yaml.safe_load(Path(done["yaml"]).read_text())
    assert config["world_size"] == config["parallel_config"]["world_size"] == sizes[0]
    out = run(model_dir, Path(done["yaml"]))
    assert [o["token_ids"] for o in out["outputs"]] == reference["tokens"]
    assert out["param_bytes_per_rank"] == [done["per_rank_param_bytes"]] * sizes[0]
    # the base YAML (world_size 1) now runs the parallel code unsharded: the single-rank run
    assert [o["token_ids"] for o in run(model_dir)["outputs"]] == reference["tokens"]


@pytest.mark.parametrize(
    "migrated", ["llama", pytest.param("qwen3", marks=pytest.mark.slow), ARCHS[2]], indirect=True
)
def test_tp2_from_convert_weights_output(migrated, tmp_path):
    reference, model_dir = migrated
    config = parallel_yaml(tmp_path / "tp2.yaml", *SCENARIOS["tp2"])
    assert parallelize(model_dir, config).returncode == 0
    check_converted_shards(model_dir, config, tmp_path / "shards", reference)


def _quantized_yaml(source: Path, target: Path, quant_method: str) -> Path:
    doc = yaml.safe_load(source.read_text())
    doc["model_config"]["quant_method"] = quant_method
    target.write_text(yaml.safe_dump(doc, sort_keys=False))
    return target


@pytest.mark.parametrize(
    ("quant_mode", "quant_method"),
    [
        ("w8a16", "int8_weight_only"),
        pytest.param("fp8", "fp8", marks=pytest.mark.slow),
        pytest.param("w8a8", "w8a8_dynamic", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("migrated", ["llama"], indirect=True)
def test_quantized_tp2_at_load_and_from_quantized_shards_match_the_single_rank(
    migrated, quant_mode, quant_method, tmp_path
):
    """TP 2 quantizing at load (row-parallel weight scales and per-token activation scales reduced over the
    group) and TP 2 from `convert-weights --quant-mode` shards give the single-rank quantized run's tokens."""
    _, model_dir = migrated
    base = model_dir / "config" / f"{model_dir.name}.yaml"
    single = run(model_dir, _quantized_yaml(base, tmp_path / "single.yaml", quant_method))
    tokens = [o["token_ids"] for o in single["outputs"]]
    config = parallel_yaml(tmp_path / "tp2.yaml", *SCENARIOS["tp2"])
    proc = parallelize(model_dir, config, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    tp2_yaml = _quantized_yaml(Path(json.loads(proc.stdout)["yaml"]), tmp_path / "tp2_q.yaml", quant_method)
    tp2 = run(model_dir, tp2_yaml)
    assert [o["token_ids"] for o in tp2["outputs"]] == tokens
    shards_dir = tmp_path / "shards"
    done = skill_json(
        "convert-weights",
        model_dir,
        "--config",
        config,
        "-o",
        shards_dir,
        "--quant-mode",
        quant_mode,
        "--json",
    )
    assert yaml.safe_load(Path(done["yaml"]).read_text())["model_config"]["quant_method"] == quant_method
    shards = run(model_dir, Path(done["yaml"]))
    assert [o["token_ids"] for o in shards["outputs"]] == tokens
    assert shards["param_bytes_per_rank"] == done["ranks"] == tp2["param_bytes_per_rank"]


@pytest.mark.parametrize(("arch", "scenario"), OTHER_ARCHS)
def test_other_architectures(arch, scenario, tmp_path_factory, tmp_path):
    reference = build_reference(arch, tmp_path_factory)
    model_dir = migrate(reference, tmp_path / "models")
    sizes = SCENARIOS[scenario]
    flags = ["--replicate-attention"] * (arch in REPLICATE_ATTENTION)
    proc = parallelize(model_dir, parallel_yaml(tmp_path / "p.yaml", *sizes), "--json", *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = json.loads(proc.stdout)
    out = run(model_dir, Path(done["yaml"]))
    assert [o["token_ids"] for o in out["outputs"]] == reference["tokens"]
    assert out["param_bytes_per_rank"] == [done["per_rank_param_bytes"]] * sizes[0]


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """Architecture -> (transformers reference, migrated directory), built once per module."""
    built = {}

    def get(arch: str):
        if arch not in built:
            reference = build_reference(arch, tmp_path_factory)
            built[arch] = reference, migrate(reference, tmp_path_factory.mktemp(f"{arch}_model"))
        return built[arch]

    return get


@pytest.mark.parametrize(("arch", "scenario"), MOE_RUNS)
def test_moe_expert_parallel(moe_models, arch, scenario, tmp_path):
    reference, model_dir = moe_models(arch)
    sizes, extra = MOE_SCENARIOS[scenario]
    config = parallel_yaml(tmp_path / "p.yaml", *sizes, **extra)
    proc = parallelize(model_dir, config, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = json.loads(proc.stdout)
    out = run(model_dir, Path(done["yaml"]))
    assert [o["token_ids"] for o in out["outputs"]] == reference["tokens"]
    assert out["param_bytes_per_rank"] == [done["per_rank_param_bytes"]] * sizes[0]
    whole = parallelize(
        model_dir, config, "--plan", "--json", "--disable", "PR007"
    )  # every expert everywhere
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert done["per_rank_param_bytes"] < json.loads(whole.stdout)["per_rank_param_bytes"]


@pytest.mark.slow
def test_moe_from_convert_weights_output(moe_models, tmp_path):
    """Per-rank shards of each rank's experts and intermediate share (EP 2 x expert TP 2) load and match."""
    reference, model_dir = moe_models("qwen3_moe")
    sizes, extra = MOE_SCENARIOS["tp2_moe_tp2_ep2"]
    config = parallel_yaml(tmp_path / "p.yaml", *sizes, **extra)
    assert parallelize(model_dir, config).returncode == 0
    check_converted_shards(model_dir, config, tmp_path / "shards", reference)


@pytest.mark.parametrize(
    ("sizes", "oproj"),
    [
        ((2, 1, 2, 2, 2), 2),
        pytest.param((4, 1, 2, 4, 4), 2, marks=pytest.mark.slow),
        ((4, 2, 4, 4, 4), 4),  # attention TP 2 x DP 2: o_proj gathers both attention TP groups' outputs
    ],
    ids=["w2_dp2_oproj_tp2", "w4_dp4_oproj_tp2", "w4_attn_tp2_dp2_oproj_tp4"],
)
def test_latent_attention_with_o_proj_in_its_own_group(moe_models, sizes, oproj, tmp_path):
    """DeepSeek-V3 with attention DP and an o_proj TP size of its own (oproj_tp_group): transformers' tokens, each
    rank holding its share of every o_proj, fewer bytes than with o_proj in attn_tp_group; its KV cache holds the
    latents (kv_lora_rank 32 + qk_rope_head_dim 16 per token and layer), not 4 heads of keys (32) and values
    (16)."""
    reference, model_dir = moe_models("deepseek_v3")
    config = parallel_yaml(tmp_path / "p.yaml", *sizes, o_proj_tp_size=oproj)
    proc = parallelize(model_dir, config, "--json", "--force")
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = json.loads(proc.stdout)
    assert {
        "name": "oproj_tp_group",
        "group_num": sizes[0] // oproj,
        "group_size": oproj,
        "stride": 1,
    } in done["groups"]
    out = run(model_dir, Path(done["yaml"]))
    assert [o["token_ids"] for o in out["outputs"]] == reference["tokens"]
    assert out["param_bytes_per_rank"] == [done["per_rank_param_bytes"]] * sizes[0]
    whole = parallelize(model_dir, parallel_yaml(tmp_path / "whole.yaml", *sizes), "--plan", "--json")
    assert done["per_rank_param_bytes"] < json.loads(whole.stdout)["per_rank_param_bytes"]
    layers, fp32 = 2, 4
    assert done["kv_bytes_per_token"] == json.loads(whole.stdout)["kv_bytes_per_token"] == layers * 48 * fp32
    assert done["kv_bytes_per_token"] < layers * 4 * (32 + 16) * fp32
