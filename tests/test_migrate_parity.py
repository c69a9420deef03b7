"""`skill migrate` on tiny random checkpoints of several architectures: the converted model reproduces
transformers' greedy tokens (framework + standalone modes, paged + legacy KV) and prefill logits."""

import json
from pathlib import Path

import pytest
import torch
from hf_reference import (
    NEW_TOKENS,
    build_reference,
    migrate,
    parallel_yaml,
    parallelize,
    prompts_args,
    run_json,
)
from model_dirs import prefill_logits, prefilled
from skill_process import skill_json
from tiny_checkpoint import PARITY_PROMPTS
from transformers import AutoModelForCausalLM

# mistral is llama's layout (its sliding window is longer than the fixtures) and qwen2 is qwen3's without the
# q/k norms: both `-m slow`, for `make test`'s 30 min
ARCHS = [
    "llama",
    pytest.param("mistral", marks=pytest.mark.slow),
    pytest.param("qwen2", marks=pytest.mark.slow),
    "qwen3",
    "gemma3_text",
]
# the legacy layout goes through the same attention code as the paged one: llama and gemma3_text (sliding
# window) check it in `make test`, the others with `-m slow`
LEGACY_ARCHS = [
    "llama",
    "gemma3_text",
    *(pytest.param(a, marks=pytest.mark.slow) for a in ("qwen2", "qwen3")),
]
# framework + paged only: MoE blocks keep their own routing and expert math
MOE_ARCHS = ["qwen3_moe", "mixtral"]


@pytest.fixture(scope="module", params=ARCHS)
def arch(request, tmp_path_factory):
    return build_reference(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=MOE_ARCHS)
def moe_arch(request, tmp_path_factory):
    return build_reference(request.param, tmp_path_factory)


def assert_framework_run_matches(reference: dict, model_dir: Path, *flags: str) -> None:
    out = skill_json(
        "run", model_dir, *flags, "--json", "--raw", "--max-new-tokens", NEW_TOKENS, *prompts_args()
    )
    assert [o["prompt_token_ids"] for o in out["outputs"]] == reference["ids"]
    assert [o["token_ids"] for o in out["outputs"]] == reference["tokens"]


@pytest.fixture(scope="module")
def framework_dir(arch, tmp_path_factory) -> Path:
    """The default migration (framework mode, paged KV), shared by the tests that only read it."""
    return migrate(arch, tmp_path_factory.mktemp("framework"), "--kv", "paged", "--mode", "framework")


def test_framework_mode_matches_transformers(arch, framework_dir):
    assert_framework_run_matches(arch, framework_dir)


@pytest.mark.parametrize("arch", LEGACY_ARCHS, indirect=True)
def test_framework_mode_on_legacy_kv_matches_transformers(arch, tmp_path):
    assert_framework_run_matches(arch, migrate(arch, tmp_path, "--kv", "legacy", "--mode", "framework"))


def test_moe_checkpoints_load_and_match_transformers(moe_arch, tmp_path):
    """Per-expert tensors on disk, stacked 3-D expert parameters in memory."""
    assert_framework_run_matches(moe_arch, migrate(moe_arch, tmp_path))


def test_falcon_with_alibi_matches_transformers(tmp_path_factory, tmp_path):
    """Falcon's attention computes with ALiBi or with rotary positions, picked by `config.alibi`: the ALiBi
    path runs on the cache of the rotary one (`Attention(cache_of=...)`), the switch read from the config."""
    falcon = build_reference("falcon", tmp_path_factory, alibi=True, multi_query=False)
    model_dir = migrate(falcon, tmp_path, "--mode", "framework")
    code = (model_dir / "models" / "modeling_falcon.py").read_text()
    assert "cache_of=self.attn" in code and "self.use_alibi = config.alibi" in code
    assert_framework_run_matches(falcon, model_dir)


def test_a_checkpoint_with_cross_attention_weights_loads_without_them_and_matches_transformers(
    tmp_path_factory, tmp_path
):
    """GPT-2 saved with `add_cross_attention`: the block a causal LM never runs is not built (MG024), its tensors
    are skipped on load, and `is_cross_attention` folds (MG025)."""
    gpt2 = build_reference("gpt2", tmp_path_factory, add_cross_attention=True)
    model_dir = migrate(gpt2, tmp_path, "--mode", "framework")
    code = (model_dir / "models" / "modeling_gpt2.py").read_text()
    assert "crossattention =" not in code and "is_cross_attention" not in code
    assert r'r"(^|\.)crossattention\."' in code
    assert_framework_run_matches(gpt2, model_dir)


def test_a_looped_model_keeps_a_cache_per_loop_and_matches_transformers(tmp_path_factory, tmp_path):
    """Dory applies its recurrent layers once per loop, each loop on a cache layer of its own (`self.layer_idx +
    cache_offset`): the offset becomes the runtime layer's `cache_key`, which keeps a cache per key."""
    dory = build_reference("dory", tmp_path_factory)
    model_dir = migrate(dory, tmp_path, "--mode", "framework")
    assert "cache_key=cache_offset" in (model_dir / "models" / "modeling_dory.py").read_text()
    assert_framework_run_matches(dory, model_dir)


# the standalone runner drives the same attention layer on both layouts; legacy runs with `-m slow`
@pytest.mark.parametrize("kv", ["paged", pytest.param("legacy", marks=pytest.mark.slow)])
def test_standalone_mode_matches_transformers(arch, tmp_path, kv):
    model_dir = migrate(arch, tmp_path, "--kv", kv, "--mode", "standalone")
    assert (model_dir / f"runner_{model_dir.name}.py").is_file()
    out = run_json(
        [
            "bash",
            str(model_dir / "infer.sh"),
            "--json",
            "--raw",
            "--max_new_tokens",
            str(NEW_TOKENS),
            *[a for p in PARITY_PROMPTS for a in ("--prompt", p)],
        ]
    )
    assert [o["token_ids"] for o in out["outputs"]] == arch["tokens"]


def test_prefill_logits_match_transformers(arch, framework_dir):
    logits = prefill_logits(framework_dir, arch["ids"])
    torch.testing.assert_close(logits, arch["logits"], atol=1e-4, rtol=0)


def _set_exe_mode(model_dir: Path, mode: str) -> None:
    yaml_file = model_dir / "config" / f"{model_dir.name}.yaml"
    text = yaml_file.read_text()
    assert 'exe_mode: "eager"' in text
    yaml_file.write_text(text.replace('exe_mode: "eager"', f'exe_mode: "{mode}"'))


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(a, marks=() if a == "llama" else pytest.mark.slow)
        for a in ("llama", "qwen3", "gemma3_text")
    ],
)
def test_compile_mode_matches_transformers(name, tmp_path_factory, tmp_path):
    """exe_mode: compile (torch.compile of the decode step, compiled during warm-up) keeps greedy parity."""
    reference = build_reference(name, tmp_path_factory)
    model_dir = migrate(reference, tmp_path)
    _set_exe_mode(model_dir, "compile")
    assert_framework_run_matches(reference, model_dir)


@pytest.fixture(params=["host-kernels", "portable"])
def host_kernels(request, monkeypatch):
    """``portable``: no host kernels, so the path every accelerator takes (gather + SDPA, ``F.linear``)."""
    from runtime import kernels
    from runtime.layers import host_linear

    def forget() -> None:
        for cached in (
            kernels.host_decode_attention,
            kernels.host_linear_kernel,
            host_linear._kernel_dtype,
            host_linear.kernel_beats_library,
        ):
            cached.cache_clear()

    if request.param == "portable":
        monkeypatch.setenv("SKILL_HOST_KERNELS", "0")
        monkeypatch.delitem(kernels.BUILT, "paged_decode_attention", raising=False)
        forget()
        request.addfinalizer(forget)  # later tests load the built kernels again
    return request.param


def _eager_and_compiled(config, model_dir, prompts, params) -> dict:
    """Each mode's greedy tokens and engine; the counters are those of the compiled run."""
    from torch._dynamo.utils import counters

    from runtime.offline import OfflineInference

    runs = {}
    for mode in ("eager", "compile"):
        config.model_config.exe_mode = mode
        counters.clear()
        llm = OfflineInference(config, model_dir)
        runs[mode] = ([o.token_ids for o in llm.generate_ids(prompts, params)], llm.engine)
    return runs


def test_compiled_bfloat16_decode_equals_eager_and_is_traced_only_at_warm_up(
    host_kernels, tmp_path_factory, tmp_path
):
    """In bfloat16 the compiled decode step gives eager's tokens, and the two graphs warm-up traces (one row, and
    more) serve batches that shrink as requests finish and block tables that widen, without a graph break or
    another trace: with the host kernels (oneDNN-packed fused linears and the paged-attention kernel, operators
    the graph calls as they are) and on the portable path (which once traced again at every block-table width,
    through a per-step cache keyed by it)."""
    from torch._dynamo.utils import counters

    from runtime.config import InferenceConfig
    from runtime.engine.request import SamplingParams

    model_dir = migrate(build_reference("llama", tmp_path_factory), tmp_path)
    config = InferenceConfig.from_yaml(model_dir / "config" / f"{model_dir.name}.yaml")
    config.model_config.dtype, config.scheduler_config.block_size = "bfloat16", 4
    prompts = [[5 + i] * n for i, n in enumerate((3, 9, 14, 6, 1))]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (12, 4, 9, 16, 7)]
    runs = _eager_and_compiled(config, model_dir, prompts, params)
    assert runs["compile"][0] == runs["eager"][0]
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 2  # one row, and more (warm_up)


def test_small_batches_run_the_host_kernel_compiled_and_eager_alike(monkeypatch, tmp_path_factory, tmp_path):
    """Where the host kernel's one-row products beat oneDNN's prepacked ones, an engine whose decode steps have at
    most SMALL_BATCH rows keeps its bf16 weights as they are and runs them through the kernel, an operator in the
    compiled decode step: eager's tokens, no graph break, no trace after warm-up."""
    from torch._dynamo.utils import counters

    from runtime.config import InferenceConfig
    from runtime.engine.request import SamplingParams
    from runtime.kernels import host_linear_kernel
    from runtime.layers import host_linear

    if not host_linear.onednn_packs(torch.bfloat16) or host_linear_kernel() is None:
        pytest.skip("the choice exists where oneDNN prepacks bf16 and the host kernel builds")
    monkeypatch.setattr(host_linear, "kernel_beats_library", lambda dtype: True)  # whichever is faster here
    model_dir = migrate(build_reference("llama", tmp_path_factory), tmp_path)
    config = InferenceConfig.from_yaml(model_dir / "config" / f"{model_dir.name}.yaml")
    config.model_config.dtype, config.scheduler_config.block_size = "bfloat16", 4
    config.scheduler_config.batch_size = host_linear.SMALL_BATCH
    prompts = [[5 + i] * n for i, n in enumerate((3, 9, 14))]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (12, 4, 9)]
    runs = _eager_and_compiled(config, model_dir, prompts, params)
    assert runs["compile"][0] == runs["eager"][0]
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 2
    for _, engine in runs.values():
        modules = list(engine.worker.model.modules())
        assert any(getattr(m, "host_kernel", False) for m in modules)
        assert not any(hasattr(m, "packed_weight") for m in modules)


@pytest.mark.parametrize("kv", ["paged", pytest.param("legacy", marks=pytest.mark.slow)])
def test_latent_attention_caches_latents_and_matches_transformers(kv, tmp_path_factory, tmp_path):
    """DeepSeek-V3 (multi-head latent attention, MoE from its second layer): the migrated model caches latents
    (MG019) and gives transformers' greedy tokens and prefill logits."""
    reference = build_reference("deepseek_v3", tmp_path_factory)
    model_dir = migrate(reference, tmp_path, "--kv", kv)
    assert "forward_latent(" in (model_dir / "models" / "modeling_deepseek_v3.py").read_text()
    assert_framework_run_matches(reference, model_dir)
    logits = prefill_logits(model_dir, reference["ids"])
    torch.testing.assert_close(logits, reference["logits"], atol=1e-4, rtol=0)


def assert_sparse_attention_matches(reference: dict, tmp_path: Path, kv: str, **every_key) -> str:
    """The migrated sparse-attention model caches its indexer's keys and gives transformers' greedy tokens and prefill
    logits, which the same weights reading every key (every_key: the config that picks them all) do not give; its
    modeling code."""
    dense = AutoModelForCausalLM.from_pretrained(reference["ckpt"], **every_key).eval()
    with torch.no_grad():
        every = torch.stack([dense(torch.tensor([x])).logits[0, -1] for x in reference["ids"]])
    assert (every - reference["logits"]).abs().max() > 1e-2
    model_dir = migrate(reference, tmp_path, "--kv", kv)
    (modeling,) = (model_dir / "models").glob("modeling_*.py")
    code = modeling.read_text()
    assert "IndexKeyCache(" in code
    assert_framework_run_matches(reference, model_dir)
    logits = prefill_logits(model_dir, reference["ids"])
    torch.testing.assert_close(logits, reference["logits"], atol=1e-4, rtol=0)
    return code


@pytest.mark.parametrize("kv", ["paged", pytest.param("legacy", marks=pytest.mark.slow)])
def test_sparse_attention_reads_the_tokens_its_indexer_picks_and_matches_transformers(
    kv, tmp_path_factory, tmp_path
):
    """DeepSeek-V3.2 (DSA, with MLA): each query reads the 4 tokens its indexer picks (the prompts run to 42). The
    migrated model caches the indexer's keys (MG032), picks in each request's own context and gives transformers'
    greedy tokens and prefill logits, which attention over every token does not give."""
    reference = build_reference("deepseek_v32", tmp_path_factory)
    code = assert_sparse_attention_matches(reference, tmp_path, kv, index_topk=2048)
    assert "selected=" in code and "forward_latent(" in code


@pytest.mark.slow  # 45 s a layout: `make test` keeps to 30 min; the rule and the runtime's block picks are in it
@pytest.mark.parametrize("kv", ["paged", "legacy"])
def test_block_sparse_attention_per_key_head_matches_transformers(kv, tmp_path_factory, tmp_path):
    """MiniMax-M3's sparse layers: an indexer keeps one key per token in a cache layer of its own, masks the future
    by position, and picks per key head the 2 blocks of 4 keys (its own among them) each query reads (the prompts
    run to 42). The migrated model caches those keys (MG032), picks in each request's own context and gives
    transformers' greedy tokens and prefill logits, which attention over every block does not give."""
    sparse = ["minimax_m3_sparse"] * 2  # the catalogue's fixture has a dense layer first
    reference = build_reference("minimax_m3_vl_text", tmp_path_factory, layer_types=sparse)
    code = assert_sparse_attention_matches(reference, tmp_path, kv, index_topk_blocks=64)
    assert "select_block=config.index_block_size" in code


@pytest.mark.parametrize("kv", ["paged", pytest.param("legacy", marks=pytest.mark.slow)])
def test_a_score_bias_per_key_and_a_window_of_the_largest_match_transformers(kv, tmp_path_factory, tmp_path):
    """Doge's dynamic mask: a bias per key token and key head, computed from its values, joins every score of the
    key. The migrated model caches it with the keys (MG033) and gives transformers' greedy tokens and prefill
    logits, which the same weights without the bias do not give. Past `keep_window_size` keys each query reads only
    those of the largest bias: with a window of 6, prefill logits match again (prompts of distinct tokens: a token
    repeated has one bias twice in the first layer, and which of equal biases transformers keeps is not defined,
    its own decode and prefill differ)."""

    def spread_bias(model):  # the random init leaves the bias's scale A near 0: every key's bias near 1
        for layer in model.model.layers:
            layer.self_attn.A.copy_(torch.linspace(-2.0, 1.0, layer.self_attn.A.numel()))

    reference = build_reference("doge", tmp_path_factory, edit=spread_bias)
    model_dir = migrate(reference, tmp_path, "--kv", kv)
    code = (model_dir / "models" / "modeling_doge.py").read_text()
    assert "key_bias=True" in code and "keep_keys=" in code and "key_bias=dt_states" in code
    assert_framework_run_matches(reference, model_dir)
    logits = prefill_logits(model_dir, reference["ids"])
    torch.testing.assert_close(logits, reference["logits"], atol=1e-4, rtol=0)

    def last_logits(prompts_ids, bias=True):
        model = AutoModelForCausalLM.from_pretrained(reference["ckpt"]).eval()
        with torch.no_grad():
            for layer in model.model.layers if not bias else ():
                layer.self_attn.A.zero_()  # every key's bias 1
            return torch.stack([model(torch.tensor([x])).logits[0, -1] for x in prompts_ids])

    assert (last_logits(reference["ids"], bias=False) - reference["logits"]).abs().max() > 1e-2
    distinct = [list(range(3, 3 + n)) for n in (5, 17, 30)]
    every = last_logits(distinct)
    config = reference["ckpt"] / "config.json"  # the migrated model reads it at start
    config.write_text(json.dumps({**json.loads(config.read_text()), "keep_window_size": 6}))
    kept = last_logits(distinct)
    assert (every - kept).abs().max() > 1e-2
    torch.testing.assert_close(prefill_logits(model_dir, distinct), kept, atol=1e-4, rtol=0)


def test_longrope_picks_its_factors_per_request_and_matches_transformers(tmp_path_factory, tmp_path):
    """Phi-3's LongRoPE (the 128k models): the long factors past `original_max_position_embeddings` (16 here; the
    prompts run to 42 tokens, the shortest crosses 16 at its 14th new token). transformers reads the longest
    position of a forward; the migrated model's `dynamic_rope_update` is the runtime's (MG034), which reads each
    request's own length, so the packed batch gives each prompt the tokens and log-probabilities transformers gives
    it alone, step by step on its cache (`skill verify`). (transformers' `generate` differs once a request crosses
    16: Phi-3's generation hook drops the cache there and recomputes every key with the long factors.)"""
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [2.0 + i for i in range(8)],
        "original_max_position_embeddings": 16,
    }
    phi3 = build_reference(
        "phi3",
        tmp_path_factory,
        rope_parameters=rope,
        max_position_embeddings=64,
        original_max_position_embeddings=16,
    )
    model_dir = migrate(phi3, tmp_path)
    code = (model_dir / "models" / "modeling_phi3.py").read_text()
    assert "from runtime.layers.rotary import dynamic_rope_update" in code
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PARITY_PROMPTS))
    verified = skill_json("verify", model_dir, "--prompts-file", prompts, "--json")
    assert verified["status"] == "identical" and verified["tokens_compared"] == 16 * len(PARITY_PROMPTS)


@pytest.mark.parametrize(
    "name", ["lfm2", *(pytest.param(a, marks=pytest.mark.slow) for a in ("falcon_h1", "zamba", "zamba2"))]
)
def test_hybrid_layers_keep_their_states_per_request_and_match_transformers(name, tmp_path_factory, tmp_path):
    """LFM2 (a short convolution, then attention), Falcon-H1 (Mamba-2 beside attention in every layer; `-m slow`)
    and Zamba / Zamba2 (Mamba layers, and shared attention blocks tied across the hybrid ones, built in a method for
    Zamba2; `-m slow`) keep their conv / recurrent states in the cache: the migrated layers run per request of the
    packed step with the runtime's states (MG035), four prompts of different lengths prefilled and decoded
    together. A parallel layout that splits a step's tokens across ranks is refused before any rank starts; Zamba
    at TP 2 matches too."""
    reference = build_reference(name, tmp_path_factory)
    model_dir = migrate(reference, tmp_path, "--mode", "framework")
    assert '@per_request(states="states")' in (model_dir / "models" / f"modeling_{name}.py").read_text()
    assert_framework_run_matches(reference, model_dir)
    engine, logits = prefilled(model_dir, reference["ids"])
    torch.testing.assert_close(logits, reference["logits"], atol=1e-4, rtol=0)
    # the memory set aside beside the KV pool: as many requests' states as the scheduler holds, each the size
    # a prefilled request's states have (the start-up probe's one token measured them)
    sizes = set(engine.states.nbytes().values())
    assert (
        len(sizes) == 1
        and engine.worker.state_bytes == sizes.pop() * engine.config.batch_size_per_dp_rank > 0
    )
    split = parallelize(model_dir, parallel_yaml(tmp_path / "dp.yaml", 2, 1, 2, 2, 2))
    assert split.returncode == 2 and "keep state per request" in split.stderr, split.stderr[-2000:]
    if name == "zamba":  # its tied shared blocks sharded at TP 2, every rank sharing them as it loads
        tp = parallelize(model_dir, parallel_yaml(tmp_path / "tp.yaml", 2, 2, 2, 2, 2))
        assert tp.returncode == 0, tp.stderr[-2000:]
        assert_framework_run_matches(
            reference, model_dir, "--yaml", str(model_dir / "config" / "zamba_rank_2_2tp.yaml")
        )


def test_a_relative_position_bias_by_distance_and_log_scaled_queries_match_transformers(
    tmp_path_factory, tmp_path
):
    """Inkling: each query mixes a bank of bias-by-distance profiles into one bias per backward distance (zero
    from `rel_extent` on; a sliding layer's extent is its window), and its full-attention layers scale the queries
    and that bias by log(position). The migrated model hands the table to the runtime's attention
    (`distance_bias=`, MG038) and reads the positions the runtime gives (MG039): with an extent of 5 and a window
    of 4 against prompts of up to 42 tokens, `skill verify` finds transformers' tokens and log-probabilities, which
    the same weights without the bias do not give."""
    overrides = {
        "rel_extent": 5,
        "sliding_window_size": 4,
        "log_scaling_n_floor": 2,
        "log_scaling_alpha": 1.0,
    }
    reference = build_reference("inkling_text", tmp_path_factory, **overrides)
    model_dir = migrate(reference, tmp_path)
    code = (model_dir / "models" / "modeling_inkling_text.py").read_text()
    assert "*distance_positions(forward_metadata))" in code and "distance_bias=position_bias" in code
    assert "q_positions = forward_metadata.positions" in code
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PARITY_PROMPTS))
    verified = skill_json("verify", model_dir, "--prompts-file", prompts, "--json")
    assert verified["status"] == "identical" and verified["tokens_compared"] == 16 * len(PARITY_PROMPTS)
    model = AutoModelForCausalLM.from_pretrained(reference["ckpt"]).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.rel_logits_proj.proj.zero_()
        unbiased = torch.stack([model(torch.tensor([x])).logits[0, -1] for x in reference["ids"]])
    assert (unbiased - reference["logits"]).abs().max() > 1e-2
    torch.testing.assert_close(
        prefill_logits(model_dir, reference["ids"]), reference["logits"], atol=1e-4, rtol=0
    )


def test_inkling2_s_bias_by_distance_query_sinks_and_attention_over_earlier_blocks_match_transformers(
    tmp_path_factory, tmp_path
):
    """Inkling2 on top of Inkling: the model computes the distances once and each bias module gathers its table at
    them (MG038 gives them the runtime's), each query token gets its own sink logit, and every layer mixes the
    outputs of earlier blocks by attention over that stack, per token (MG040's `stack_attention`); its checkpoint
    renames with an index offset and interleaves the experts' gate / up rows (transformers' own rules, applied by
    the loader). Three layers, a block per layer, an extent of 5 and a window of 4 against prompts of up to 42
    tokens, with log scaling: `skill verify` finds transformers' tokens and log-probabilities."""
    overrides = {
        "rel_extent": 5,
        "sliding_window_size": 4,
        "log_scaling_n_floor": 2,
        "log_scaling_alpha": 1.0,
        "n_layers_per_attn_res_block": 1,
        "num_hidden_layers": 3,
        "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding"],
    }
    reference = build_reference("inkling2_text", tmp_path_factory, **overrides)
    model_dir = migrate(reference, tmp_path)
    code = (model_dir / "models" / "modeling_inkling2_text.py").read_text()
    assert (
        "distance_columns(forward_metadata)" in code and "stack_attention(" in code and "sinks=sinks" in code
    )
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PARITY_PROMPTS))
    verified = skill_json("verify", model_dir, "--prompts-file", prompts, "--json")
    assert verified["status"] == "identical" and verified["tokens_compared"] == 16 * len(PARITY_PROMPTS)


def test_inkling2_loop_s_second_pass_over_its_loop_layers_matches_transformers_in_float64(
    tmp_path_factory, tmp_path
):
    """Inkling2-Loop runs its loop layers (1 and 2 of 4, the catalogue's fixture) a second time, from the states
    before them, each layer mixing into its inputs messages its attention over the first pass's blocks reads; each
    pass keeps its own caches (`cache_key=cache_offset`, MG023 through the name the offset is bound to), the
    layers come from a table local to the model's constructor (MG009) and the checkpoint keeps the message
    queries in two tables that transformers' own op merges (the loader applies it). Random weights saturate the
    message gates, so float32 runs drift (transformers' own float32 run is as far from its float64 one);
    `skill verify` finds the tokens identical and, in float64, the log-probabilities within 1e-6. One pass on the
    same weights gives other logits: the second pass is what is compared."""
    overrides = {
        "rel_extent": 5,
        "sliding_window_size": 4,
        "log_scaling_n_floor": 2,
        "log_scaling_alpha": 1.0,
    }
    reference = build_reference("inkling2_loop_text", tmp_path_factory, **overrides)
    model_dir = migrate(reference, tmp_path)
    code = (model_dir / "models" / "modeling_inkling2_loop_text.py").read_text()
    assert "cache_key=cache_offset" in code and code.count("forward_metadata=forward_metadata,") >= 4
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PARITY_PROMPTS))
    verified = skill_json("verify", model_dir, "--prompts-file", prompts, "--json")
    assert verified["status"] == "identical" and verified["tokens_compared"] == 16 * len(PARITY_PROMPTS)
    model = AutoModelForCausalLM.from_pretrained(reference["ckpt"], loop_num_passes=1).eval()
    with torch.no_grad():
        once = torch.stack([model(torch.tensor([x])).logits[0, -1] for x in reference["ids"]])
    assert (once - reference["logits"]).abs().max() > 1e-2
