"""How quantized values are stored (int8, fp8 e4m3) and how weights and activations are quantized to them.

Weights get one float32 scale per output row, max |w| / (largest value the type holds symmetrically).
Activations get one scale per token, computed the way compressed-tensors' dynamic token quantization does
(max |x| over half the type's range, in the activations' dtype), so a checkpoint's W8A8 model runs the
arithmetic it was saved for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

CHUNK_ROWS = 4096  # rows quantized at a time: bounds the float copy of a large LM head


@dataclass(frozen=True)
class QuantType:
    name: str
    dtype: torch.dtype
    qmin: float
    qmax: float

    @property
    def is_int(self) -> bool:
        return not self.dtype.is_floating_point

    def cast(self, scaled: torch.Tensor, low: float, high: float) -> torch.Tensor:
        """`scaled` clamped to [low, high] and stored in this type (integers rounded to nearest, half to even)."""
        scaled = scaled.clamp(low, high)
        return (scaled.round() if self.is_int else scaled).to(self.dtype)


INT8 = QuantType("int8", torch.int8, -128.0, 127.0)
FP8 = QuantType("fp8", torch.float8_e4m3fn, -448.0, 448.0)


def channel_maxima(weight: torch.Tensor) -> torch.Tensor:
    """max |w| of each output row, in float32: what its per-channel scale is made from."""
    return weight.detach().abs().amax(dim=1).float()


def quantize_rows(
    weight: torch.Tensor, amax: torch.Tensor, qtype: QuantType = INT8
) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantized weight, float32 scale per row) for the given per-row maxima of |weight|; symmetric, so int8
    uses -127..127."""
    bound = min(-qtype.qmin, qtype.qmax)
    scale = (amax.float() / bound).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.empty(weight.shape, dtype=qtype.dtype, device=weight.device)
    for start in range(0, weight.shape[0], CHUNK_ROWS):
        rows = slice(start, start + CHUNK_ROWS)
        q[rows] = qtype.cast(weight[rows].float() / scale[rows, None], -bound, bound)
    return q, scale


def quantize_tokens(
    x: torch.Tensor, qtype: QuantType, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantized x, scale [..., 1] in x's dtype): one scale per token, max |x| / ((qmax - qmin) / 2); a token
    of zeros gets the dtype's eps, as compressed-tensors gives it. ``group``: x is this rank's share of every
    token's columns, and the scale is the whole token's."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    if group is not None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale = amax / ((qtype.qmax - qtype.qmin) / 2)
    scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
    return qtype.cast(x / scale, qtype.qmin, qtype.qmax), scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight * scale, each of the scale's G columns covering in / G consecutive input columns."""
    groups = weight.float().unflatten(1, (scale.shape[1], -1)) * scale[:, :, None]
    return groups.flatten(1).to(dtype)
