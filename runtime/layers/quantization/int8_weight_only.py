"""Linear layers with int8 weights and float scales, one per output channel or per group of input columns;
activations stay in the model's dtype. ``int8_weight_only`` quantizes a float checkpoint at load (symmetric,
scale = max |w| / 127 per channel); ``prequantized`` layers read the weights and scales a checkpoint or
convert-weights saved.

On the host, up to ``KERNEL_ROWS`` rows (decode) go through the C++ kernel, which reads the int8 weight as is;
more rows (prefill) and other devices dequantize the weight and use ``F.linear``. Under TP the scales equal
the single-rank ones: a row-parallel layer's channel maxima are reduced over its group first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from runtime.errors import ConfigError
from runtime.kernels import host_int8_linear
from runtime.layers.linear import RowParallelLinear, TPModule
from runtime.layers.quantization.base import UnquantizedLinearMethod

KERNEL_ROWS = 16
CHUNK_ROWS = 4096  # rows quantized at a time: bounds the float copy of a large LM head


def channel_maxima(weight: torch.Tensor) -> torch.Tensor:
    """max |w| of each output row, in float32: what its per-channel scale is made from."""
    return weight.detach().abs().amax(dim=1).float()


def quantize_rows(weight: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, float32 scale per row) for the given per-row maxima of |weight|."""
    scale = (amax.float() / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    for start in range(0, weight.shape[0], CHUNK_ROWS):
        rows = slice(start, start + CHUNK_ROWS)
        q[rows] = (weight[rows].float() / scale[rows, None]).round_().clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize(layer: TPModule, dtype: torch.dtype) -> torch.Tensor:
    """weight * scale, each of the scale's G columns covering in / G consecutive input columns."""
    weight, scale = layer.weight, layer.weight_scale
    groups = weight.float().unflatten(1, (scale.shape[1], -1)) * scale[:, :, None]
    return groups.flatten(1).to(dtype)


class Int8WeightOnlyMethod(UnquantizedLinearMethod):
    """``prequantized``: the checkpoint already holds the int8 weights and scales (nothing to do after loading)."""

    name = "int8_weight_only"

    def __init__(self, prequantized: bool = False):
        self.prequantized = prequantized

    def prepare_for_quantized_weights(self, layer: TPModule, group_size: int | None = None) -> None:
        """Gives a float layer the int8 weight and the scales a quantized checkpoint stores: [out, 1], or one per
        group of ``group_size`` input columns (a row-parallel layer's loader narrows those with the weight)."""
        (rows, cols), device = layer.weight.shape, layer.weight.device
        if group_size and cols % group_size:
            raise ConfigError(
                f"{layer.prefix or type(layer).__name__}: its {cols} input columns on this rank are not whole "
                f"groups of {group_size}; use a TP size that keeps the quantization groups whole"
            )
        del layer.weight
        with torch.device(device):
            layer._add_param("weight", rows, cols, dtype=torch.int8)
            layer._add_param(
                "weight_scale", rows, cols // group_size if group_size else 1, dtype=torch.float32
            )
        if group_size:
            layer.weight_scale.input_dim = 1

    def process_weights_after_loading(self, layer: TPModule) -> None:
        if self.prequantized:
            return
        weight = layer.weight.detach()
        amax = getattr(layer, "row_amax", None)  # set by convert-weights, which builds one rank at a time
        if amax is None:
            amax = channel_maxima(weight)
            if isinstance(layer, RowParallelLinear) and layer.group is not None:
                # each rank holds part of every row: the whole row's maximum
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=layer.group)
        q, scale = quantize_rows(weight, amax)
        del layer.weight  # a tied LM head drops only its own reference; the embedding keeps the float weight
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale[:, None], requires_grad=False)

    def apply(self, layer: TPModule, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if (
            x.device.type == "cpu"
            and rows <= KERNEL_ROWS
            and not torch.compiler.is_compiling()
            and (kernel := host_int8_linear())
        ):
            return kernel.int8_linear(x, layer.weight, layer.weight_scale, bias)
        return F.linear(x, dequantize(layer, x.dtype), bias)

    @staticmethod
    def describe(device: torch.device) -> str:
        if device.type == "cpu" and host_int8_linear():
            return f"the host int8 kernel up to {KERNEL_ROWS} rows, dequantize + matmul above"
        return "dequantize + matmul (no int8 kernel for this device)"
