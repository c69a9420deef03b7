"""Host linears (oneDNN-prepacked, or the host kernel where oneDNN cannot prepack) compute what nn.Linear computes,
and are only swapped in where they apply."""

import pytest
import torch
from torch import nn

from runtime.kernels import host_linear_kernel
from runtime.layers import host_linear
from runtime.layers.host_linear import (
    FLOAT32_ROWS,
    KERNEL_ROWS,
    PACK_ROWS,
    SMALL_BATCH,
    HostKernelLinear,
    HostPackedLinear,
    onednn_packs,
    swap_host_linears,
)

needs_bf16_packing = pytest.mark.skipif(
    not onednn_packs(torch.bfloat16),
    reason="this CPU's oneDNN cannot prepack bf16 (needs AVX-512 or AVX-NE-CONVERT)",
)
needs_kernel = pytest.mark.skipif(host_linear_kernel() is None, reason="no C++ compiler for the host kernel")


@needs_bf16_packing
@pytest.mark.parametrize("float32_pays", [False, True], ids=["onednn", "float32-from-1024-rows"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 64, FLOAT32_ROWS])
def test_packed_linear_matches_nn_linear_in_bf16(monkeypatch, float32_pays, bias, rows):
    """Whichever path this host's timing picks for long inputs computes what nn.Linear does."""
    monkeypatch.setattr(host_linear, "float32_pays", lambda dtype: float32_pays)
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias, dtype=torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    expected = linear(x)
    packed = HostPackedLinear(linear)
    # bf16 rounding of one accumulation; atol for an output near zero after cancellation (on a Xeon with AMX one
    # of 163840 float32 products was 1.5e-8 against nn.Linear's 1.1e-8)
    torch.testing.assert_close(packed(x), expected, atol=1e-6, rtol=1.6e-2)
    assert packed(x[None]).shape == (1, rows, 160)
    assert packed.weight.shape == (160, 96) and packed.weight.dtype == torch.bfloat16


@needs_bf16_packing
def test_pack_swaps_bf16_host_linears_including_a_tied_head():
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 50, bias=False))
    model.to(torch.bfloat16)
    model[3].weight = model[0].weight  # tied head
    ids = torch.tensor([1, 7, 3])
    expected = model(ids)
    assert swap_host_linears(model)[0] == 2
    assert isinstance(model[1], HostPackedLinear) and isinstance(model[3], HostPackedLinear)
    torch.testing.assert_close(model(ids), expected, atol=0, rtol=1.6e-2)
    assert model[0].weight.device.type == "cpu"  # the embedding keeps its table


@needs_bf16_packing
@pytest.mark.parametrize("rows", [1, PACK_ROWS])
def test_either_packed_layout_computes_what_nn_linear_does(monkeypatch, rows):
    """Weights laid out for one row or for long inputs (pack_rows picks per host) give nn.Linear's products."""
    monkeypatch.setattr(host_linear, "pack_rows", lambda dtype: rows)
    monkeypatch.setattr(host_linear, "float32_pays", lambda dtype: False)
    torch.manual_seed(0)
    linear = nn.Linear(
        576, 960, dtype=torch.bfloat16
    )  # the shape whose long inputs the one-row layout slowed
    packed = HostPackedLinear(linear)
    for n in (1, 7, 300):
        x = torch.randn(n, 576, dtype=torch.bfloat16)
        torch.testing.assert_close(packed(x), linear(x), atol=1e-6, rtol=1.6e-2)


@needs_bf16_packing
@pytest.mark.parametrize("timing", ["pack_rows", "float32_pays", "kernel_beats_library"])
def test_each_path_choice_is_timed_once_and_leaves_the_rng_alone(timing):
    choose = getattr(host_linear, timing)
    choose.cache_clear()
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    assert choose(torch.bfloat16) in ((1, PACK_ROWS) if timing == "pack_rows" else (False, True))
    assert torch.equal(torch.rand(3), expected)
    assert choose.cache_info().currsize == 1


@pytest.mark.parametrize("kernel_wins", [False, True])
def test_float32_models_take_the_kernel_only_where_it_beats_f_linear(monkeypatch, kernel_wins):
    monkeypatch.setattr(host_linear, "kernel_beats_library", lambda dtype: kernel_wins)
    model = nn.Sequential(nn.Linear(8, 8))
    assert swap_host_linears(model) == (0, "") and type(model[0]) is nn.Linear  # no decode batch given
    count, what = swap_host_linears(model, decode_rows=64)
    assert (count, type(model[0])) == ((1, HostKernelLinear) if kernel_wins else (0, nn.Linear))
    assert ("F.linear" in what) == kernel_wins


def test_a_weight_the_kernel_cannot_read_in_place_keeps_nn_linear(monkeypatch):
    monkeypatch.setattr(host_linear, "kernel_beats_library", lambda dtype: True)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[1].weight = nn.Parameter(model[1].weight.detach().t().contiguous().t())  # column-major
    assert swap_host_linears(model, decode_rows=1)[0] == 1
    assert type(model[0]) is HostKernelLinear and type(model[1]) is nn.Linear


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, KERNEL_ROWS, KERNEL_ROWS + 1])
def test_float32_kernel_linear_matches_f_linear(rows):
    """In float32 the kernel differs from F.linear only in the order of the sums."""
    torch.manual_seed(0)
    linear = nn.Linear(100, 37)
    x = torch.randn(rows, 100)
    torch.testing.assert_close(HostKernelLinear(linear)(x), linear(x), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_compiled_float32_engines_take_the_kernel_up_to_its_rows(monkeypatch):
    """A compiled step calls the kernel at any row count, so only decode batches of up to KERNEL_ROWS get it."""
    monkeypatch.setattr(host_linear, "kernel_beats_library", lambda dtype: True)
    for rows, expected in ((KERNEL_ROWS, HostKernelLinear), (KERNEL_ROWS + 1, nn.Linear)):
        model = nn.Sequential(nn.Linear(8, 8))
        swap_host_linears(model, compiled=True, decode_rows=rows)
        assert type(model[0]) is expected


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, KERNEL_ROWS, KERNEL_ROWS + 1, 64, FLOAT32_ROWS])
@pytest.mark.parametrize("columns", [100, 96])  # a remainder of columns, and whole 32-column steps
def test_kernel_linear_matches_float32_product_rounded_once(dtype, bias, rows, columns):
    """Up to KERNEL_ROWS rows the kernel, above them oneDNN or float32: all sum in float32 and round the output
    once."""
    torch.manual_seed(0)
    linear = nn.Linear(columns, 37, bias=bias, dtype=dtype)  # 37: remainder rows of the kernel's passes
    x = torch.randn(rows, columns, dtype=dtype)
    bias_f = None if linear.bias is None else linear.bias.float()
    expected = torch.nn.functional.linear(x.float(), linear.weight.float(), bias_f).to(dtype)
    swapped = HostKernelLinear(linear)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(swapped(x), expected, atol=1e-5, rtol=eps)
    assert swapped(x[None]).shape == (1, rows, 37) and swapped.weight is linear.weight


@needs_bf16_packing
@needs_kernel
@pytest.mark.parametrize("decode_rows", [1, SMALL_BATCH, SMALL_BATCH + 1, None])
def test_small_decode_batches_keep_their_weights_for_the_kernel_where_it_beats_packing(
    monkeypatch, decode_rows
):
    """An engine whose decode steps have at most SMALL_BATCH rows takes the kernel (its weights as they are, a
    tied head still tied), a larger or unknown one packs; either computes what nn.Linear does."""
    from runtime.layers.linear import QKVParallelLinear

    monkeypatch.setattr(host_linear, "kernel_beats_library", lambda dtype: True)
    torch.manual_seed(0)
    qkv = QKVParallelLinear(16, 8, 4, 2, bias=True, params_dtype=torch.bfloat16)
    for p in qkv.parameters():
        p.data.normal_()
    model = nn.Sequential(nn.Embedding(50, 16), qkv, nn.Linear(64, 16), nn.Linear(16, 50, bias=False))
    model.to(torch.bfloat16)
    model[3].weight = model[0].weight
    ids = torch.tensor([1, 7, 3])
    expected = model(ids)
    count, what = swap_host_linears(model, decode_rows=decode_rows)
    small = decode_rows is not None and decode_rows <= SMALL_BATCH
    assert count == 3 and ("host kernel" in what) == small
    assert isinstance(model[3], HostKernelLinear if small else HostPackedLinear)
    assert getattr(qkv, "host_kernel", False) == small and hasattr(qkv, "packed_weight") != small
    if small:
        assert model[3].weight is model[0].weight and qkv.weight.device.type == "cpu"
    torch.testing.assert_close(model(ids), expected, atol=1e-6, rtol=1.6e-2)


@needs_kernel
def test_hosts_that_cannot_prepack_use_the_host_kernel_and_keep_a_tied_head_tied(monkeypatch):
    monkeypatch.setattr(host_linear, "onednn_packs", lambda dtype: False)
    monkeypatch.setattr(host_linear, "_kernel_dtype", lambda dtype: True)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 50, bias=False))
    model.to(torch.bfloat16)
    model[3].weight = model[0].weight
    ids = torch.tensor([1, 7, 3])
    expected = model(ids)
    count, what = swap_host_linears(model)
    assert count == 2 and "host kernel" in what and isinstance(model[3], HostKernelLinear)
    assert model[3].weight is model[0].weight
    torch.testing.assert_close(model(ids), expected, atol=0, rtol=1.6e-2)


def test_hosts_without_prepacking_or_kernel_keep_nn_linear(monkeypatch):
    monkeypatch.setattr(host_linear, "onednn_packs", lambda dtype: False)
    monkeypatch.setattr(host_linear, "_kernel_dtype", lambda dtype: False)  # no compiler for the kernel
    model = nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16)
    assert swap_host_linears(model) == (0, "") and type(model[0]) is nn.Linear


@needs_kernel
@pytest.mark.parametrize("rows", [3, KERNEL_ROWS + 5])
def test_parallel_linears_take_the_host_path_too(monkeypatch, rows):
    """The runtime's parallel layers apply 16-bit weights the way HostKernelLinear does (their quant_method)."""
    from runtime.layers.linear import ColumnParallelLinear

    monkeypatch.setattr(host_linear, "_kernel_dtype", lambda dtype: True)  # as on an AVX2 host
    layer = ColumnParallelLinear(100, 37, bias=True, params_dtype=torch.bfloat16)
    for p in layer.parameters():
        p.data.normal_()
    x = torch.randn(rows, 100, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float()).bfloat16()
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=torch.finfo(torch.bfloat16).eps)


@needs_bf16_packing
@pytest.mark.parametrize("rows", [1, FLOAT32_ROWS])
def test_parallel_linears_are_prepacked_where_onednn_packs(rows):
    """An unquantized parallel linear gets oneDNN's layout too (it was re-laid out on every F.linear call);
    a quantized one keeps its own method's weights."""
    from runtime.layers.linear import QKVParallelLinear, RowParallelLinear
    from runtime.layers.quantization.int8_weight_only import Int8WeightOnlyMethod

    torch.manual_seed(0)
    qkv = QKVParallelLinear(64, 16, 4, 2, bias=True, params_dtype=torch.bfloat16)
    out = RowParallelLinear(64, 64, params_dtype=torch.bfloat16, quant_method=Int8WeightOnlyMethod())
    model = nn.Sequential(qkv, nn.Linear(128, 64, dtype=torch.bfloat16), out)
    for p in qkv.parameters():
        p.data.normal_()
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    expected = qkv(x)
    assert swap_host_linears(model)[0] == 2  # the nn.Linear and the QKV layer
    assert qkv.weight.device.type == "meta" and qkv.weight.shape == (128, 64)
    assert not hasattr(out, "packed_weight")
    torch.testing.assert_close(qkv(x), expected, atol=0, rtol=1.6e-2)
