"""The part every quantized method shares: weights stored quantized (int8 or fp8) with float32 scales, one per
output channel or per group of input columns. Online (``prequantized=False``) a float checkpoint's weights are
quantized after loading; ``prequantized`` layers read the weights and scales a checkpoint or convert-weights
saved. Under TP the scales equal the single-rank ones: a row-parallel layer's channel maxima are reduced over
its group first.

On the host, up to ``KERNEL_ROWS`` rows (decode) go through the C++ kernel, which reads the quantized weight as
is; more rows (prefill) and other devices dequantize the weight and use ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from runtime.errors import ConfigError
from runtime.kernels import KERNEL_ROWS, host_linear_kernel
from runtime.layers.linear import RowParallelLinear, TPModule
from runtime.layers.quantization.base import UnquantizedLinearMethod
from runtime.layers.quantization.formats import QuantType, channel_maxima, dequantize, quantize_rows


def token_rows(x: torch.Tensor) -> int:
    """Rows of x [..., features]: tokens for a linear layer."""
    return x.numel() // x.shape[-1]


def decode_kernel(x: torch.Tensor):
    """The host kernel module when x's rows are few enough for it (decode), else None."""
    if x.device.type != "cpu" or token_rows(x) > KERNEL_ROWS or torch.compiler.is_compiling():
        return None
    return host_linear_kernel()


class QuantizedWeightMethod(UnquantizedLinearMethod):
    """Subclasses set ``name`` and ``qtype`` (how the weight is stored); activations stay in the model's dtype."""

    qtype: QuantType

    def __init__(self, prequantized: bool = False):
        self.prequantized = prequantized

    def prepare_for_quantized_weights(self, layer: TPModule, group_size: int | None = None) -> None:
        """Gives a float layer the quantized weight and the scales a quantized checkpoint stores: [out, 1], or
        one per group of ``group_size`` input columns (a row-parallel layer's loader narrows those with the
        weight)."""
        (rows, cols), device = layer.weight.shape, layer.weight.device
        if group_size and cols % group_size:
            raise ConfigError(
                f"{layer.prefix or type(layer).__name__}: its {cols} input columns on this rank are not whole "
                f"groups of {group_size}; use a TP size that keeps the quantization groups whole"
            )
        del layer.weight
        with torch.device(device):
            layer._add_param("weight", rows, cols, dtype=self.qtype.dtype)
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
        q, scale = quantize_rows(weight, amax, self.qtype)
        del layer.weight  # a tied LM head drops only its own reference; the embedding keeps the float weight
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale[:, None], requires_grad=False)

    def apply(self, layer: TPModule, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if kernel := decode_kernel(x):
            return getattr(kernel, f"{self.qtype.name}_linear")(x, layer.weight, layer.weight_scale, bias)
        return F.linear(x, dequantize(layer.weight, layer.weight_scale, x.dtype), bias)

    def describe(self, device: torch.device) -> str:
        """The kernels ``apply`` uses on `device`, for the log."""
        if device.type == "cpu" and host_linear_kernel():
            return f"the host {self.qtype.name} kernel up to {KERNEL_ROWS} rows, dequantize + matmul above"
        return "dequantize + matmul"
