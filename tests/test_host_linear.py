"""oneDNN-prepacked host linears compute what nn.Linear computes, and are only swapped in where they apply."""

import pytest
import torch
from torch import nn

from runtime.layers import host_linear
from runtime.layers.host_linear import FLOAT32_ROWS, HostPackedLinear, onednn_packs, pack_host_linears

needs_bf16_packing = pytest.mark.skipif(
    not onednn_packs(torch.bfloat16),
    reason="this CPU's oneDNN cannot prepack bf16 (needs AVX-512 or AVX-NE-CONVERT)",
)


@needs_bf16_packing
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 64, FLOAT32_ROWS])
def test_packed_linear_matches_nn_linear_in_bf16(bias, rows):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias, dtype=torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    expected = linear(x)
    packed = HostPackedLinear(linear)
    torch.testing.assert_close(packed(x), expected, atol=0, rtol=1.6e-2)  # bf16 rounding of one accumulation
    assert packed(x[None]).shape == (1, rows, 160)
    assert packed.weight.shape == (160, 96) and packed.weight.dtype == torch.bfloat16


@needs_bf16_packing
def test_pack_swaps_bf16_host_linears_including_a_tied_head():
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 50, bias=False))
    model.to(torch.bfloat16)
    model[3].weight = model[0].weight  # tied head
    ids = torch.tensor([1, 7, 3])
    expected = model(ids)
    assert pack_host_linears(model) == 2
    assert isinstance(model[1], HostPackedLinear) and isinstance(model[3], HostPackedLinear)
    torch.testing.assert_close(model(ids), expected, atol=0, rtol=1.6e-2)
    assert model[0].weight.device.type == "cpu"  # the embedding keeps its table


def test_float32_models_are_left_alone():
    model = nn.Sequential(nn.Linear(8, 8))
    assert pack_host_linears(model) == 0 and type(model[0]) is nn.Linear


def test_hosts_that_cannot_prepack_keep_nn_linear(monkeypatch):
    monkeypatch.setattr(host_linear, "onednn_packs", lambda dtype: False)
    model = nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16)
    assert pack_host_linears(model) == 0 and type(model[0]) is nn.Linear
