"""runtime.layers.rotary: the host kernel gives transformers' apply_rotary_pos_emb values, and a RoPE that picks its
frequencies by length picks them per request."""

import inspect
import shutil

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from runtime.engine.forward_metadata import ForwardMetaData
from runtime.errors import UserError
from runtime.kernels import host_rotary_embedding
from runtime.layers.rotary import dynamic_rope_update, rotary_embedding, rotate_half

DYNAMIC_NTK = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0 + 0.1 * i for i in range(8)],
    "long_factor": [2.0 + i for i in range(8)],
    "original_max_position_embeddings": 16,
}


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


DYNAMIC = LlamaConfig(
    hidden_size=64, num_attention_heads=4, max_position_embeddings=16, rope_parameters=DYNAMIC_NTK
)
LONG = Phi3Config(
    hidden_size=64,
    num_attention_heads=4,
    max_position_embeddings=64,
    original_max_position_embeddings=16,
    rope_parameters=LONGROPE,
)


def _step(lengths_q: list[int], computed: list[int]) -> ForwardMetaData:
    q, kv = torch.tensor(lengths_q), torch.tensor(computed) + torch.tensor(lengths_q)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(computed, lengths_q)])
    cu = torch.nn.functional.pad(q.cumsum(0), (1, 0))
    return ForwardMetaData(not any(computed), kv - q, q, kv, cu, positions, int(q.max()), int(kv.max()))


@pytest.mark.parametrize(
    "rotary, config",
    [(LlamaRotaryEmbedding, DYNAMIC), (Phi3RotaryEmbedding, LONG)],
    ids=["dynamic", "longrope"],
)
def test_a_rope_that_picks_its_frequencies_by_length_does_so_per_request(rotary, config):
    """transformers' `dynamic_rope_update` reads the longest position in the forward: in a packed batch, the longest
    request's. The runtime's gives each token what transformers gives its request run alone (a fresh module at the
    request's length after the step), and leaves the module as it was."""

    class PerRequest(rotary):
        forward = dynamic_rope_update(inspect.unwrap(rotary.forward))

    ours, x = PerRequest(config), torch.zeros(1)
    state = lambda: {
        **{k: v.clone() for k, v in ours.named_buffers()},
        **{k: v for k, v in vars(ours).items() if k in ("attention_scaling", "max_seq_len_cached")},
    }
    before = state()
    for lengths_q, computed in (([3, 20, 9], [0, 0, 0]), ([1, 1, 1], [24, 3, 16])):
        md = _step(lengths_q, computed)
        cos, sin = ours(x, md.positions[None], forward_metadata=md)
        for i, (n, c) in enumerate(zip(lengths_q, computed)):
            alone = rotary(config)(x, torch.arange(c, c + n)[None])
            at = slice(int(md.actual_seq_lengths_cu_q[i]), int(md.actual_seq_lengths_cu_q[i + 1]))
            torch.testing.assert_close((cos[:, at], sin[:, at]), alone, rtol=0, atol=0)
        after = state()
        assert after.keys() == before.keys() and all(
            torch.equal(v, after[k]) if isinstance(v, torch.Tensor) else v == after[k]
            for k, v in before.items()
        )
    batch = rotary(config)(x, md.positions[None])  # the longest request's length for all: not the same
    assert not torch.equal(batch[0], cos)
    with pytest.raises(UserError, match="pass the caller's \\*\\*kwargs"):
        ours(x, md.positions[None])
