"""Weights and activations both quantized (W8A8): int8 (``w8a8_dynamic``) or fp8 e4m3 (``fp8``) weights with one
scale per output channel, and activations quantized per token as each layer runs (a row-parallel layer's ranks
agree on each token's scale first).

int8 sums are integers: taken in float32 they are exact while below 2^24 (always for up to 1024 input columns,
and in practice far beyond), so every kernel, batch shape and TP layout gives the same sums; the scales are
applied once, after a row-parallel layer's sum over ranks, so a TP run computes the single-rank outputs.

Kernels for the sums, chosen per call by device and rows (the log names them):
- on the host up to 16 rows the C++ int8 kernel, above that ``F.linear`` on the integers in float32
  (``torch._int_mm`` ran 3x slower than a bf16 ``F.linear`` here, for 1 and 512 rows of 576 x 1536);
- on CUDA above 16 rows ``torch._int_mm`` (int32 sums).
fp8 on the host: up to 16 rows the C++ kernel (which reads fp8 weights too), from 128 rows
``torch._scaled_mm`` (512 rows of 576 x 1536: 9 ms against 47 ms for bf16 ``F.linear``; one row: 4.5 ms
against 0.2 ms), dequantize + matmul between and on other devices (converting fp8 to bf16 alone took 2.5 ms
for that weight, 25x its bf16 product).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from runtime.kernels import host_linear_kernel
from runtime.layers.linear import RowParallelLinear, TPModule
from runtime.layers.quantization.formats import FP8, INT8, QuantType, quantize_tokens
from runtime.layers.quantization.int8_weight_only import Int8WeightOnlyMethod
from runtime.layers.quantization.quantized_weights import (
    KERNEL_ROWS,
    QuantizedWeightMethod,
    decode_kernel,
    token_rows,
)

SCALED_MM_ROWS = 128


def _per_token(layer: TPModule, x: torch.Tensor, qtype: QuantType) -> tuple[torch.Tensor, torch.Tensor]:
    """x quantized per token; a row-parallel layer's ranks hold parts of each token, so they agree on its
    scale first (the single-rank one)."""
    group = layer.group if isinstance(layer, RowParallelLinear) else None
    return quantize_tokens(x, qtype, group)


@functools.cache
def _ones(rows: int, device: torch.device) -> torch.Tensor:
    return torch.ones(rows, 1, device=device)


def int_mm_sums(q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """int8 activations [rows, in] times an int8 weight [out, in] with ``torch._int_mm``: int32 sums, as float32."""
    return torch._int_mm(q, weight.t()).float()


def integer_sums(q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Sum of q * w over the input columns, [..., out] in float32, by the kernel the device and rows call for."""
    rows = q.reshape(-1, q.shape[-1])
    n, device = weight.shape[0], q.device
    if device.type == "cuda" and len(rows) > 16 and n % 8 == 0 and weight.shape[1] % 8 == 0:
        sums = int_mm_sums(rows, weight)  # cuBLAS' int8 matmul takes >16 rows, dimensions in multiples of 8
    elif kernel := decode_kernel(rows):
        sums = kernel.int8_linear(rows.float(), weight, _ones(n, device), None)
    else:
        sums = F.linear(rows.float(), weight.float())
    return sums.reshape(*q.shape[:-1], n)


class Int8DynamicMethod(Int8WeightOnlyMethod):
    name = "w8a8_dynamic"

    def apply_partial(
        self, layer: TPModule, x: torch.Tensor
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        assert layer.weight_scale.shape[1] == 1, "W8A8 weights have one scale per output channel"
        q, scale = _per_token(layer, x, INT8)

        def scaled(sums: torch.Tensor) -> torch.Tensor:
            return (sums * layer.weight_scale.t() * scale.float()).to(x.dtype)

        return integer_sums(q, layer.weight), scaled

    def apply(self, layer: TPModule, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        sums, scaled = self.apply_partial(layer, x)
        out = scaled(sums)
        return out if bias is None else out + bias

    def describe(self, device: torch.device) -> str:
        if device.type == "cuda":
            return "int8 activations per token; torch._int_mm above 16 rows, F.linear on the integers below"
        kernel = f"the host int8 kernel up to {KERNEL_ROWS} rows, " if host_linear_kernel() else ""
        return f"int8 activations per token; {kernel}F.linear on the integers (float32){' above' if kernel else ''}"


@functools.cache
def host_rowwise_scaled_mm() -> bool:
    """Whether this torch's host ``torch._scaled_mm`` takes per-row scales (torch 2.11's takes only per-tensor
    ones and fails an internal assert otherwise)."""
    q = torch.ones(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(
            q, q.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32
        )
    except RuntimeError:
        return False
    return True


def scaled_mm_linear(
    q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """fp8 activations times an fp8 weight [out, in], both scales applied by ``torch._scaled_mm``."""
    out = torch._scaled_mm(
        q.reshape(-1, q.shape[-1]),
        weight.t(),
        scale_a=x_scale.reshape(-1, 1).float(),
        scale_b=weight_scale.t(),
        out_dtype=dtype,
    )
    return out.reshape(*q.shape[:-1], -1)


class Fp8Method(QuantizedWeightMethod):
    """``activations=False``: fp8 weights only (a compressed-tensors FP8 W8A16 checkpoint)."""

    name = "fp8"
    qtype = FP8

    def __init__(self, prequantized: bool = False, activations: bool = True):
        super().__init__(prequantized)
        self.activations = activations

    def apply(self, layer: TPModule, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.activations:
            q, scale = _per_token(layer, x, FP8)
            if (
                x.device.type == "cpu"
                and token_rows(x) >= SCALED_MM_ROWS
                and layer.weight_scale.shape[1] == 1
                and host_rowwise_scaled_mm()
            ):
                out = scaled_mm_linear(q, scale, layer.weight, layer.weight_scale, x.dtype)
                return out if bias is None else out + bias
            x = q.to(x.dtype) * scale
        return super().apply(layer, x, bias)

    def describe(self, device: torch.device) -> str:
        if not self.activations:
            return super().describe(device)
        scaled_mm = (
            f", torch._scaled_mm from {SCALED_MM_ROWS} rows"
            if device.type == "cpu" and host_rowwise_scaled_mm()
            else ""
        )
        return f"fp8 activations per token; {super().describe(device)}{scaled_mm}"
