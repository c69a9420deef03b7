"""runtime.layers.norm.rms_norm: the host kernel gives the PyTorch expression's values, roundings included."""

import shutil

import pytest
import torch

from runtime.kernels import host_rms_norm
from runtime.layers.norm import rms_norm


def expression(x, weight, eps, weight_in_float):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype) if weight_in_float else weight * h.to(x.dtype)


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the expression runs instead")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_in_float", [False, True])
@pytest.mark.parametrize("shape", [(1, 576), (3, 5, 96), (700, 64)])
def test_the_host_kernel_matches_the_expression(dtype, weight_in_float, shape):
    """Only the order in which squares are summed differs: float32 within rounding, bfloat16 outputs equal but
    where that moves a value across a rounding boundary (one unit in the last place)."""
    kernel = host_rms_norm()
    assert kernel is not None
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=gen) * 4).to(dtype)
    weight = (torch.randn(shape[-1], generator=gen) * 0.3 + 1).to(dtype)
    want = expression(x, weight, 1e-6, weight_in_float)
    for got in (rms_norm(x, weight, 1e-6, weight_in_float), kernel(x, weight, 1e-6, weight_in_float)):
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        else:
            differing = got != want
            assert differing.float().mean() < 0.001
            ulp = want.float().abs() * 2**-7
            assert ((got.float() - want.float()).abs() <= ulp)[differing].all()


def test_a_strided_input_is_read_as_its_values():
    x = torch.randn(8, 128)[:, ::2]
    torch.testing.assert_close(rms_norm(x, torch.ones(64), 1e-5), expression(x, torch.ones(64), 1e-5, False))


@pytest.mark.parametrize(
    ("x_dtype", "w_dtype"),
    [(torch.float16, torch.float16), (torch.bfloat16, torch.float32)],
    ids=["fp16", "mixed"],
)
def test_other_dtypes_run_the_expression_itself(x_dtype, w_dtype):
    """float16 rows, or a weight of another dtype than the rows (the product then takes the weight's)."""
    x, weight = torch.randn(4, 32).to(x_dtype), torch.rand(32).to(w_dtype)
    for in_float in (False, True):
        assert torch.equal(rms_norm(x, weight, 1e-6, in_float), expression(x, weight, 1e-6, in_float))


def test_no_rows():
    x = torch.empty(0, 3, 64, dtype=torch.bfloat16)
    assert rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 1e-6).shape == (0, 3, 64)
