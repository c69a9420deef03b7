"""int8 weights, activations in the model's dtype (W8A16). ``int8_weight_only`` quantizes a float checkpoint at
load (symmetric, scale = max |w| / 127 per channel).

On the host, up to ``KERNEL_ROWS`` rows (decode) go through the C++ kernel, which reads the int8 weight as is;
more rows (prefill) and other devices dequantize the weight and use ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.kernels import host_int8_linear
from runtime.layers.linear import TPModule
from runtime.layers.quantization.formats import INT8, dequantize
from runtime.layers.quantization.quantized_weights import QuantizedWeightMethod

KERNEL_ROWS = 16


class Int8WeightOnlyMethod(QuantizedWeightMethod):
    name = "int8_weight_only"
    qtype = INT8

    def apply(self, layer: TPModule, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if (
            x.device.type == "cpu"
            and rows <= KERNEL_ROWS
            and not torch.compiler.is_compiling()
            and (kernel := host_int8_linear())
        ):
            return kernel.int8_linear(x, layer.weight, layer.weight_scale, bias)
        return F.linear(x, dequantize(layer.weight, layer.weight_scale, x.dtype), bias)

    def describe(self, device: torch.device) -> str:
        if device.type == "cpu" and host_int8_linear():
            return f"the host int8 kernel up to {KERNEL_ROWS} rows, dequantize + matmul above"
        return "dequantize + matmul (no int8 kernel for this device)"
