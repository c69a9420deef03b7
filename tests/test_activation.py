"""runtime.layers.activation.act_and_mul: act(gate) * up, SiLU through the host kernel with the same roundings."""

import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from runtime.kernels import host_silu_and_mul
from runtime.layers.activation import act_and_mul


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the expression runs instead")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 300])
def test_silu_through_the_host_kernel_matches_the_expression(dtype, rows):
    """The gate and up halves of one fused projection (rows strided, a width off the 16 lanes): float32 within a
    few units in the last place (the kernel's exp), bfloat16 equal but where that crosses a rounding boundary."""
    kernel = host_silu_and_mul()
    assert kernel is not None
    gen = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(1, rows, 2 * 200, generator=gen) * 4).to(dtype).split([200, 200], dim=-1)
    want = F.silu(gate) * up
    for got in (act_and_mul(ACT2FN["silu"], gate, up), act_and_mul(nn.SiLU(), gate, up), kernel(gate, up)):
        assert got.shape == want.shape and got.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        else:
            differing = got != want
            assert differing.float().mean() < 0.001
            assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7)[differing].all()


@pytest.mark.parametrize("case", ["gelu", "float16", "broadcast", "inplace", "number"])
def test_anything_else_runs_the_expression(case):
    """Other activations, other dtypes, operands that broadcast, an in-place SiLU and a number for up give the
    expression's values."""
    act = {"gelu": ACT2FN["gelu_pytorch_tanh"], "inplace": nn.SiLU(inplace=True)}.get(case, nn.SiLU())
    dtype = torch.float16 if case == "float16" else torch.float32
    gate, up = torch.randn(3, 8).to(dtype), torch.randn(1 if case == "broadcast" else 3, 8).to(dtype)
    if case == "number":  # `self.act_fn(h) * 0.5`
        up = 0.5
    want = act(gate.clone()) * up
    assert torch.equal(act_and_mul(act, gate, up), want)


def test_no_rows():
    gate = up = torch.empty(0, 8, dtype=torch.bfloat16)
    assert act_and_mul(nn.SiLU(), gate, up).shape == (0, 8)


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the expression runs instead")
def test_silu_at_the_extremes_behaves_as_the_expression():
    """NaN and infinities as PyTorch gives them (SiLU(-inf) is NaN: -inf / inf), underflow to zero."""
    gate = torch.tensor([float("nan"), float("-inf"), float("inf"), -100.0, 100.0] * 4)
    got, want = act_and_mul(nn.SiLU(), gate, torch.ones_like(gate)), F.silu(gate)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-6, atol=1e-30)
