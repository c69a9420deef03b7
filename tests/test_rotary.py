"""runtime.layers.rotary.rotary_embedding: the host kernel gives transformers' apply_rotary_pos_emb values."""

import shutil

import pytest
import torch

from runtime.kernels import host_rotary_embedding
from runtime.layers.rotary import rotary_embedding, rotate_half


def expression(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def tables(batch, length, dim, dtype):
    freqs = torch.arange(length).float()[:, None] / 10000 ** (torch.arange(0, dim, 2) / dim)
    emb = torch.cat((freqs, freqs), -1).expand(batch, length, dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the expression runs instead")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("unsqueeze_dim", "batch", "length"),
    [(1, 1, 1), (1, 2, 37), (2, 2, 37)],
    ids=["decode", "heads-first", "seq-first"],
)
def test_the_host_kernel_matches_the_expression(dtype, unsqueeze_dim, batch, length):
    """Heads-first q / k as the attention's views give them (transposed, not contiguous) and sequence-first ones;
    each product and the sum are rounded as the expression rounds them: bit for bit in both dtypes."""
    kernel = host_rotary_embedding()
    assert kernel is not None
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(batch, length, n, 64, generator=gen).to(dtype) for n in (6, 2))
    if unsqueeze_dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = tables(batch, length, 64, dtype)
    wanted = expression(q, k, cos, sin, unsqueeze_dim)
    for got in (rotary_embedding(q, k, cos, sin, unsqueeze_dim), kernel(q, k, cos, sin, unsqueeze_dim)):
        for x, want in zip(got, wanted):
            assert x.shape == want.shape and x.dtype == want.dtype
            assert torch.equal(x, want)


@pytest.mark.parametrize(
    "case",
    ["float16", "float32-tables", "odd-dim", "strided-rows", "broadcast-up", "one-column-tables"],
    ids=str,
)
def test_what_the_kernel_does_not_take_runs_the_expression(case):
    """Other dtypes, tables of another dtype than q, an odd head size, rows that are not contiguous, tables
    that broadcast q to a larger shape or along the head size all give the expression's result."""
    dtype = torch.float16 if case == "float16" else torch.bfloat16
    dim = 63 if case == "odd-dim" else 64
    q, k = torch.randn(1, 4, 5, dim).to(dtype), torch.randn(1, 2, 5, dim).to(dtype)
    cos, sin = tables(2 if case == "broadcast-up" else 1, 5, dim + (dim % 2), torch.float32)
    cos, sin = cos[..., :dim], sin[..., :dim]
    if case != "float32-tables":
        cos, sin = cos.to(dtype), sin.to(dtype)
    if case == "strided-rows":
        q = torch.randn(1, 4, 5, 2 * dim).to(dtype)[..., ::2]
    if case == "one-column-tables":  # broadcast along the head size: a stride of 0 once expanded
        cos, sin = cos[..., :1], sin[..., :1]
    for got, want in zip(rotary_embedding(q, k, cos, sin), expression(q, k, cos, sin)):
        assert torch.equal(got, want)


def test_no_tokens():
    q, k = torch.empty(1, 4, 0, 64), torch.empty(1, 2, 0, 64)
    cos, sin = tables(1, 0, 64, torch.float32)
    assert [x.shape for x in rotary_embedding(q, k, cos, sin)] == [q.shape, k.shape]
