"""Quantized linear layers: the int8 host kernel, the quant_method contract (int8 weight-only, int8 / fp8 W8A8),
per-token activation quantization against compressed-tensors' own, TP scales, a whole model against
transformers running the same quantized weights, and compressed-tensors checkpoints through `skill migrate`."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from dist_harness import distributed_tests
from model_dirs import make_model_dir, prefill_logits
from skill_process import skill
from test_parity_llama import NEW_TOKENS, reference, skill_run  # noqa: F401 - reference is a fixture
from torch import nn
from transformers import AutoModelForCausalLM

from runtime.config import InferenceConfig
from runtime.config.comm_manager import CommManager
from runtime.errors import ConfigError, UserError
from runtime.kernels import host_linear_kernel
from runtime.layers import ColumnParallelLinear, ParallelLMHead, ReplicatedLinear, RowParallelLinear
from runtime.layers.quantization import quantized_weights
from runtime.layers.quantization.formats import FP8, INT8, dequantize, quantize_rows, quantize_tokens
from runtime.layers.quantization.int8_weight_only import Int8WeightOnlyMethod
from runtime.layers.quantization.online import ONLINE_METHODS, process_weights_after_loading, quantize_online
from runtime.layers.quantization.quantized_weights import KERNEL_ROWS
from runtime.layers.quantization.w8a8 import (
    SCALED_MM_ROWS,
    Fp8Method,
    Int8DynamicMethod,
    int_mm_sums,
    integer_sums,
)
from skills.verify.compare import ACTIVATION_QUANT_LOGPROB_ATOL


def _dequantized(w: torch.Tensor, method_name: str = "int8_weight_only") -> torch.Tensor:
    """w quantized as a single-rank layer of the method quantizes it, and dequantized."""
    q, scale = quantize_rows(w, w.abs().amax(dim=1), ONLINE_METHODS[method_name].qtype)
    return dequantize(q, scale[:, None], torch.float32)


def test_quantize_rows_rounds_each_row_to_its_own_scale():
    w = torch.randn(6, 40) * torch.logspace(-3, 1, 6)[:, None]
    w[2] = 0  # an all-zero row quantizes to zeros, not NaN
    q, scale = quantize_rows(w, w.abs().amax(dim=1))
    assert (
        q.dtype == torch.int8
        and q.abs().max() == 127
        and torch.equal(q[2], torch.zeros(40, dtype=torch.int8))
    )
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all()


def _random_weight(n: int, k: int, qtype) -> torch.Tensor:
    """Every int8 value, or every finite fp8 byte (subnormals included) with random signs."""
    if qtype.is_int:
        return torch.randint(-128, 128, (n, k), dtype=torch.int8)
    q = torch.randint(0, 256, (n, k), dtype=torch.uint8).view(torch.float8_e4m3fn)
    return torch.where(q.float().isnan(), 0.0, q.float()).to(torch.float8_e4m3fn)


@pytest.mark.skipif(host_linear_kernel() is None, reason="no C++ compiler for the host kernel")
@pytest.mark.parametrize("qtype", [INT8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "n", "k", "groups"), [(1, 4, 8, 1), (3, 7, 13, 1), (5, 130, 576, 3), (KERNEL_ROWS, 9, 1536, 12)]
)
def test_host_kernel_matches_the_dequantized_product(qtype, dtype, rows, n, k, groups):
    """Tails (N not a multiple of 4, K not of 8), several rows, one scale per channel or per group of columns;
    the sums are float, so only their order differs from the float64 reference (bf16: plus output rounding)."""
    torch.manual_seed(0)
    q = _random_weight(n, k, qtype)
    scale, x, bias = torch.rand(n, groups) / 100, torch.randn(rows, k).to(dtype), torch.randn(n).to(dtype)
    out = getattr(host_linear_kernel(), f"{qtype.name}_linear")(x, q, scale, bias)
    weight = (q.double().unflatten(1, (groups, -1)) * scale.double()[:, :, None]).flatten(1)
    ref = x.double() @ weight.T + bias.double()
    assert out.dtype == dtype and out.shape == (rows, n)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("rows", [2, KERNEL_ROWS + 3])
def test_kernel_and_fallback_give_the_same_layer_output(monkeypatch, rows):
    torch.manual_seed(1)
    layer = ReplicatedLinear(24, 10, bias=True)
    layer.weight.data.normal_(), layer.bias.data.normal_()
    x = torch.randn(rows, 24)
    layer.quant_method = Int8WeightOnlyMethod()
    process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.shape == (10, 1)
    fast = layer(x)
    monkeypatch.setattr(quantized_weights, "host_linear_kernel", lambda: None)
    torch.testing.assert_close(fast, layer(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        fast,
        F.linear(x, layer.weight.float() * layer.weight_scale, layer.bias),
        atol=1e-5,
        rtol=1e-5,
    )


def _ct_fake_quantized(x: torch.Tensor, qtype) -> torch.Tensor:
    """compressed-tensors' own dynamic per-token quantize-dequantize of x [batch, tokens, hidden]."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = QuantizationArgs(
        num_bits=8, type="int" if qtype.is_int else "float", symmetric=True, strategy="token", dynamic=True
    )
    scale, zero_point = compute_dynamic_scales_and_zp(x, args, module=None)
    return fake_quantize(x, scale, zero_point, args)


@pytest.mark.parametrize("qtype", [INT8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_quantization_is_compressed_tensors_own(qtype, dtype):
    """Same scales, ties and clamps as the quantization W8A8 checkpoints were saved for (a zero token too)."""
    torch.manual_seed(5)
    x = (torch.randn(2, 7, 96) * torch.logspace(-2, 2, 7)[:, None]).to(dtype)
    x[1, 3] = 0
    q, scale = quantize_tokens(x, qtype)
    assert q.dtype == qtype.dtype and scale.shape == (2, 7, 1)
    assert torch.equal(q.to(dtype) * scale, _ct_fake_quantized(x, qtype))


def _w8a8_layer(method, out: int = 40, inp: int = 64) -> ReplicatedLinear:
    torch.manual_seed(6)
    layer = ReplicatedLinear(inp, out, bias=True)
    layer.weight.data.normal_(), layer.bias.data.normal_()
    layer.quant_method = method
    process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("method", [Int8DynamicMethod, Fp8Method])
@pytest.mark.parametrize("rows", [2, KERNEL_ROWS + 3, SCALED_MM_ROWS + 5])
def test_w8a8_layer_is_the_fake_quantized_product(method, rows):
    """Every kernel path a row count picks (host int8 kernel, dequantize + matmul, torch._scaled_mm) equals
    F.linear of the quantize-dequantized activations and weights."""
    layer = _w8a8_layer(method())
    qtype = layer.quant_method.qtype
    assert layer.weight.dtype == qtype.dtype and layer.weight_scale.shape == (40, 1)
    x = torch.randn(rows, 64)
    weight = dequantize(layer.weight, layer.weight_scale, torch.float32)
    ref = F.linear(_activations(x, layer.quant_method.name), weight, layer.bias)
    torch.testing.assert_close(layer(x), ref, atol=1e-4, rtol=1e-5)


def test_int8_sums_are_exact_on_every_path(monkeypatch):
    """Host kernel, F.linear on the integers and the CUDA path's torch._int_mm (checked on the host) all give
    the int32 sums exactly, so neither kernel choice nor batch shape changes a W8A8 layer's output."""
    torch.manual_seed(7)
    weight = torch.randint(-128, 128, (40, 1000), dtype=torch.int8)
    q = torch.randint(-128, 128, (KERNEL_ROWS + 8, 1000), dtype=torch.int8)
    exact = (q.long() @ weight.long().T).float()
    assert torch.equal(int_mm_sums(q, weight), exact)
    assert torch.equal(integer_sums(q, weight), exact)  # F.linear above KERNEL_ROWS
    assert torch.equal(integer_sums(q[:3], weight), exact[:3])  # the host kernel
    monkeypatch.setattr(quantized_weights, "host_linear_kernel", lambda: None)
    assert torch.equal(integer_sums(q[:3], weight), exact[:3])


def test_every_online_method_is_a_config_choice():
    from typing import get_args

    from runtime.config.inference_config import ModelConfig

    assert set(get_args(ModelConfig.model_fields["quant_method"].annotation)) == {"none", *ONLINE_METHODS}


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.proj(self.embed(ids)))


def _activations(x: torch.Tensor, method_name: str) -> torch.Tensor:
    """What a layer of the method multiplies: x itself (weight-only) or x quantize-dequantized per token."""
    if method_name == "int8_weight_only":
        return x
    q, scale = quantize_tokens(x, ONLINE_METHODS[method_name].qtype)
    return q.to(x.dtype) * scale


@pytest.mark.parametrize("name", ONLINE_METHODS)
def test_online_quantization_swaps_plain_linears_and_keeps_a_tied_embedding_float(name):
    torch.manual_seed(2)
    model = _Tied()
    embedding = model.embed.weight.detach().clone()
    assert quantize_online(model, name) == 2
    process_weights_after_loading(model)
    qtype = ONLINE_METHODS[name].qtype
    assert type(model.proj) is ReplicatedLinear and model.proj.weight.dtype == qtype.dtype
    assert model.head.weight.dtype == qtype.dtype and torch.equal(model.embed.weight, embedding)
    ids = torch.tensor([1, 5, 31])
    proj_w = dequantize(model.proj.weight, model.proj.weight_scale, torch.float32)
    head_w = dequantize(model.head.weight, model.head.weight_scale, torch.float32)
    hidden = F.linear(_activations(F.embedding(ids, embedding), name), proj_w, model.proj.bias)
    expected = F.linear(_activations(hidden, name), head_w)
    torch.testing.assert_close(model(ids), expected, atol=1e-5, rtol=1e-5)


def test_layers_a_checkpoint_holds_quantized_are_not_quantized_again():
    """A compressed-tensors checkpoint (or convert-weights source) run with quant_method int8_weight_only."""
    model = _Tied()
    assert quantize_online(model, "int8_weight_only", prequantized=True) == 2
    with pytest.raises(UserError, match=r'2 linear layers already hold quantized weights.*set it to "none"'):
        quantize_online(model, "int8_weight_only")


def test_unknown_quant_method_is_refused_naming_the_choices(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"model_config": {"quant_method": "int3"}}))
    with pytest.raises(ConfigError, match=r"(?s)model_config\.quant_method.*int8_weight_only"):
        InferenceConfig.from_yaml(path)


# --- TP: every rank's shard quantized with the scales of the whole layer ---

HIDDEN, INTER, VOCAB = 24, 40, 70


def _setup(rank: int, world_size: int) -> CommManager:
    cm = CommManager(world_size, rank)
    cm.register_group("dense_tp_group", 1, world_size)
    cm.register_group("lmhead_tp_group", 1, world_size)
    return cm


def _quantized(layer: nn.Module, method_name: str) -> nn.Module:
    layer.quant_method = ONLINE_METHODS[method_name]()
    process_weights_after_loading(layer)
    return layer


def _mlp_and_head(cm: CommManager | None, method_name: str, x: torch.Tensor, weights: list[torch.Tensor]):
    up, down, head = weights
    col = ColumnParallelLinear(HIDDEN, INTER, comm_manager=cm)
    row = RowParallelLinear(INTER, HIDDEN, comm_manager=cm)
    lm = ParallelLMHead(VOCAB, HIDDEN, comm_manager=cm, pad_to=8)
    for layer, w in ((col, up), (row, down), (lm, head)):
        layer.weight.weight_loader(layer.weight, w)
        _quantized(layer, method_name)
    return lm(row(F.silu(col(x))))


def check_column_row_and_head(cm: CommManager) -> None:
    """Every online method: each rank's weight scales are the whole row's, and a row-parallel layer quantizes
    each token's activations with the whole token's scale, so the TP result is the single-rank one; for int8
    W8A8, whose sums are exact and scaled after the reduction, bit for bit."""
    for name in ONLINE_METHODS:
        torch.manual_seed(3)
        weights = [torch.randn(INTER, HIDDEN), torch.randn(HIDDEN, INTER), torch.randn(VOCAB, HIDDEN)]
        x = torch.randn(3, HIDDEN)
        out = _mlp_and_head(cm, name, x, weights)
        up, down, head = (_dequantized(w, name) for w in weights)
        hidden = F.linear(_activations(F.silu(F.linear(_activations(x, name), up)), name), down)
        ref = F.linear(_activations(hidden, name), head)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4, msg=f"{name}: not the single-rank product")
        if name == "w8a8_dynamic":
            assert torch.equal(out, _mlp_and_head(None, name, x, weights))


def check_row_parallel_group_scales(cm: CommManager) -> None:
    """A checkpoint's scales per group of 8 input columns: each rank keeps the groups of its own columns."""
    torch.manual_seed(4)
    q, scale, x = (
        torch.randint(-8, 8, (HIDDEN, 64), dtype=torch.int8),
        torch.rand(HIDDEN, 8) / 10,
        torch.randn(3, 64),
    )
    row = RowParallelLinear(64, HIDDEN, input_is_parallel=False, comm_manager=cm)
    row.quant_method = Int8WeightOnlyMethod(prequantized=True)
    row.quant_method.prepare_for_quantized_weights(row, group_size=8)
    row.weight.weight_loader(row.weight, q)
    row.weight_scale.weight_loader(row.weight_scale, scale)
    assert row.weight_scale.shape == (HIDDEN, 8 // row.tp_size), (row.weight_scale.shape, row.tp_size)
    ref = F.linear(x, (q.float().unflatten(1, (8, 8)) * scale[:, :, None]).flatten(1))
    torch.testing.assert_close(row(x), ref, atol=1e-5, rtol=1e-5)


world_results, test_distributed = distributed_tests(
    _setup,
    {f.__name__: f for f in (check_column_row_and_head, check_row_parallel_group_scales)},
)


# --- a whole model: the runtime's int8 run equals transformers on the same int8 weights ---


@pytest.fixture(scope="module")
def int8_reference(tiny_llama_dir, reference):  # noqa: F811
    """transformers' greedy tokens and last prefill logits with every linear weight (the LM head too, untied
    from the embedding) replaced by its int8 dequantization."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight = nn.Parameter(_dequantized(module.weight.detach()), requires_grad=False)
        ids = reference["ids"]
        tokens = [
            model.generate(torch.tensor([x]), max_new_tokens=NEW_TOKENS, do_sample=False)[
                0, len(x) :
            ].tolist()
            for x in ids
        ]
        logits = torch.stack([model(torch.tensor([x])).logits[0, -1] for x in ids])
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    return {"ids": ids, "tokens": tokens, "logits": logits, "linears": linears}


def _int8_model_dir(tmp_path, checkpoint):
    model_dir = make_model_dir(tmp_path, checkpoint)
    path = model_dir / "config" / f"{model_dir.name}.yaml"
    config = yaml.safe_load(path.read_text())
    config["model_config"]["quant_method"] = "int8_weight_only"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return model_dir


def test_int8_run_matches_transformers_on_the_same_int8_weights(tmp_path, tiny_llama_dir, int8_reference):
    model_dir = _int8_model_dir(tmp_path, tiny_llama_dir)
    proc = skill_run(model_dir)
    out = json.loads(proc.stdout)
    assert [o["token_ids"] for o in out["outputs"]] == int8_reference["tokens"]
    assert f"int8_weight_only: {int8_reference['linears']} linear layers quantized at load" in proc.stderr
    logits = prefill_logits(model_dir, int8_reference["ids"])
    torch.testing.assert_close(logits, int8_reference["logits"], atol=1e-4, rtol=0)


def test_convert_weights_refuses_an_unknown_quant_mode(tmp_path):
    proc = skill(
        "convert-weights",
        tmp_path,
        "--config",
        tmp_path / "p.yaml",
        "-o",
        tmp_path / "out",
        "--quant-mode",
        "w4a16",
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "'w4a16'" in proc.stderr and "w8a16" in proc.stderr and not (tmp_path / "out").exists()


# --- checkpoints saved by compressed-tensors: migrate verifies them against transformers' own loading ---


def _migrate(checkpoint, out) -> subprocess.CompletedProcess:
    return skill("migrate", checkpoint, "-o", out, "--json")


# scheme -> what the migrate log says the layers read
CHECKPOINT_SCHEMES = {
    "w8a16": "int8 weights (compressed-tensors, per channel)",
    "w4a16_g32": "int4 weights (compressed-tensors, groups of 32)",
    "w8a8": "int8 weights (compressed-tensors, per channel, activations quantized per token)",
    "fp8_tensor": "fp8 weights (compressed-tensors, per tensor, activations quantized per token)",
    "w8a16_int": "int8 weights (compressed-tensors, per channel)",
    "fp8": "fp8 weights (compressed-tensors, per channel, activations quantized per token)",
}
FAST_CHECKPOINTS = {("llama", s) for s in ("w8a16", "w4a16_g32", "fp8_tensor")} | {("qwen3", "w8a8")}


@pytest.mark.parametrize(
    ("arch", "scheme"),
    [
        pytest.param(arch, scheme, marks=() if (arch, scheme) in FAST_CHECKPOINTS else pytest.mark.slow)
        for arch in ("llama", "qwen3")
        for scheme in CHECKPOINT_SCHEMES
    ],
)
def test_compressed_tensors_checkpoint_matches_transformers(arch, scheme, request, tmp_path):
    """Tiny llama and qwen3 saved as W8A16 per channel (pack-quantized, int-quantized), W4A16 in groups of 32,
    W8A8 int8 and FP8 (per-tensor and per-channel weight scales) with activations quantized per token; the
    default run takes the llama's weight-only and per-tensor FP8 ones and qwen3's W8A8, -m slow the
    rest. `skill migrate` converts, runs and verifies each against transformers loading the same checkpoint
    through its compressed-tensors integration: greedy tokens identical; log-probs within the verifier's
    tolerance, the dtype's for weight-only schemes and 0.25 where activations are quantized (our float sums
    run in another order than transformers' F.linear, which now and then moves an activation across a
    rounding tie: a whole quantization step)."""
    from quantized_checkpoint import save_compressed

    checkpoint = save_compressed(request.getfixturevalue(f"tiny_{arch}_dir"), tmp_path / "ckpt", scheme)
    proc = _migrate(checkpoint, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = json.loads(proc.stdout)
    verification = done["verification"]
    quantized_activations = scheme.startswith(("w8a8", "fp8"))
    # qwen3's per-channel FP8 parts from transformers in prompt 0 at a step where transformers' own top two are
    # within the tolerance (a near tie): compared up to there
    allowed = ("identical", "near_tie") if quantized_activations else ("identical",)
    assert done["status"] == "ok" and verification["status"] in allowed, verification
    assert verification["tokens_compared"] >= 16 * len(verification["prompts"]) - 10
    assert verification["logprob_atol"] == (0.25 if quantized_activations else 2e-3)
    assert f"linear layers read as {CHECKPOINT_SCHEMES[scheme]}" in proc.stderr


def test_unsupported_compressed_tensors_scheme_is_refused_at_migrate(tiny_llama_dir, tmp_path):
    """Static per-tensor activation scales (llm-compressor's FP8 preset) are not read."""
    from quantized_checkpoint import save_compressed

    checkpoint = save_compressed(tiny_llama_dir, tmp_path / "ckpt", "fp8_static")
    proc = _migrate(checkpoint, tmp_path / "out")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    for needle in ("input activations", "'dynamic': False", "'float-quantized'", "W8A16, W4A16", "W8A8"):
        assert needle in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize(
    ("scheme", "scenario"),
    [
        ("w4a16_g32", "tp2"),
        ("w8a8", "tp2"),
        pytest.param("fp8_tensor", "tp2", marks=pytest.mark.slow),
        pytest.param("w4a16_g32", "tp2_dp2_dense_tp4", marks=pytest.mark.slow),
        pytest.param("w8a8", "tp2_dp2_dense_tp4", marks=pytest.mark.slow),
    ],
)
def test_compressed_tensors_checkpoint_parallel_matches_the_single_rank(
    scheme, scenario, tiny_llama_dir, tmp_path
):
    """Under TP, column-parallel layers keep their rows' scales, row-parallel ones their columns' groups, and a
    row-parallel layer quantizes each token's activations with the whole token's scale: the multi-rank run
    gives the single-rank tokens. With activations quantized, the float parts outside the integer sums
    (attention, the vocab-split head) sum in another order under TP, which now and then moves an activation
    across a rounding tie: the runs may then part, but only where the single-rank run's own top two are within
    the verifier's tolerance (seen on an AVX2 host: a 0.06 step in log-probs, then a 0.0016 near tie)."""
    from hf_reference import parallel_yaml, parallelize
    from quantized_checkpoint import save_compressed
    from test_parallelize_parity import SCENARIOS, run

    checkpoint = save_compressed(tiny_llama_dir, tmp_path / "ckpt", scheme)
    proc = _migrate(checkpoint, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    model_dir = Path(json.loads(proc.stdout)["model_dir"])
    single = run(model_dir, None, "--logprobs", "5")
    proc = parallelize(model_dir, parallel_yaml(tmp_path / "p.yaml", *SCENARIOS[scenario]), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    parallel = run(model_dir, Path(json.loads(proc.stdout)["yaml"]), "--logprobs", "5")
    if not scheme.startswith(("w8a8", "fp8")):
        assert [o["token_ids"] for o in parallel["outputs"]] == [o["token_ids"] for o in single["outputs"]]
    for ours, theirs in zip(parallel["outputs"], single["outputs"], strict=True):
        _part_only_at_a_near_tie(ours, theirs, ACTIVATION_QUANT_LOGPROB_ATOL)


def _part_only_at_a_near_tie(ours: dict, theirs: dict, atol: float) -> None:
    """One prompt's `skill run --logprobs` outputs: the log-probs of the tokens both rank in their top are
    within atol up to the first differing token, and there the reference (theirs) rates our pick within atol
    of its own."""
    for pos, (mine, its) in enumerate(zip(ours["token_ids"], theirs["token_ids"], strict=True)):
        top, their_top = dict(ours["logprobs"][pos]["top"]), dict(theirs["logprobs"][pos]["top"])
        for token in top.keys() & their_top.keys():
            assert abs(top[token] - their_top[token]) <= atol, (pos, token, top, their_top)
        if mine != its:
            assert their_top[its] - their_top.get(mine, -float("inf")) <= atol, (pos, mine, its, their_top)
            return
