"""Checkpoints saved by compressed-tensors (config.json ``quantization_config.quant_method: compressed-tensors``).

Read, with symmetric scales per output channel (int weights also per group of input columns, fp8 also per
tensor):
- weight-only int8 / int4 (W8A16, W4A16), stored ``pack-quantized`` (int32 words, unpacked with
  compressed-tensors' own helper), ``naive-quantized`` or ``int-quantized``;
- int8 weights with int8 activations quantized per token at run time (W8A8, ``int-quantized``);
- fp8 e4m3 weights, alone or with fp8 activations quantized per token (FP8 dynamic, ``float-quantized``).
The targeted linear layers hold the quantized weights (int4 values widened to a byte) and float32 scales, and
run through the matching ``quant_method``. Anything else is refused, naming the scheme.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from runtime.errors import UserError
from runtime.layers.linear import LoadedWeight, materialize, weight_shape
from runtime.layers.quantization.int8_weight_only import Int8WeightOnlyMethod
from runtime.layers.quantization.online import linear_layers
from runtime.layers.quantization.quantized_weights import QuantizedWeightMethod
from runtime.layers.quantization.w8a8 import Fp8Method, Int8DynamicMethod

INT_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized")
FLOAT_FORMATS = ("float-quantized", "naive-quantized")
SUPPORTED = (
    "compressed-tensors symmetric schemes with one weight scale per output channel (or per group / tensor): "
    f"weight-only int8 / int4 (W8A16, W4A16; formats {', '.join(INT_FORMATS)}), int8 weights with dynamic "
    "per-token int8 activations (W8A8, int-quantized), and fp8 weights alone or with dynamic per-token fp8 "
    f"activations ({', '.join(FLOAT_FORMATS)})"
)


@dataclass(frozen=True)
class CheckpointScheme:
    weight_type: str  # "int" or "float"
    num_bits: int
    strategy: str  # "channel", "group" or "tensor"
    group_size: int | None  # strategy "group" only
    activations: bool  # activations quantized per token (W8A8), as the weights are
    packed: bool
    targets: list[str]
    ignore: list[str]

    def method(self) -> QuantizedWeightMethod:
        if self.weight_type == "float":
            return Fp8Method(prequantized=True, activations=self.activations)
        return Int8DynamicMethod(True) if self.activations else Int8WeightOnlyMethod(True)

    def describe(self) -> str:
        weights = f"{'fp' if self.weight_type == 'float' else 'int'}{self.num_bits} weights"
        per = f"groups of {self.group_size}" if self.group_size else f"per {self.strategy}"
        acts = ", activations quantized per token" if self.activations else ""
        return f"{weights} (compressed-tensors, {per}{acts})"


def _brief(args: Any, fields: set[str]) -> dict | None:
    return args and args.model_dump(include=fields)


def _weights_ok(weights: Any, fmt: str | None) -> bool:
    if weights is None or not weights.symmetric or weights.actorder:
        return False
    if weights.type == "int":
        return (
            weights.num_bits in (4, 8)
            and weights.strategy in ("channel", "group", "tensor")
            and fmt in INT_FORMATS
        )
    return weights.num_bits == 8 and weights.strategy in ("channel", "tensor") and fmt in FLOAT_FORMATS


def _activations_ok(acts: Any, weights: Any) -> bool:
    """None, or dynamic per-token activations of the weights' type and width (scales per channel / tensor)."""
    return acts is None or (
        acts.dynamic is True
        and acts.strategy == "token"
        and acts.symmetric
        and acts.type == weights.type
        and acts.num_bits == weights.num_bits == 8
        and weights.strategy != "group"
    )


def checkpoint_scheme(quant: dict | None, where: str) -> CheckpointScheme | None:
    """The scheme of a checkpoint's ``quantization_config`` (None when it has none); a UserError for one this
    runtime does not read."""
    if not quant:
        return None
    method = quant.get("quant_method", "unknown")
    if method != "compressed-tensors":
        raise UserError(
            f"{where} declares quantization_config.quant_method {method!r}, which this runtime does not read; "
            f"supported: {SUPPORTED}. Use the float (bf16 / fp32) release and model_config.quant_method: "
            "int8_weight_only instead."
        )
    try:
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError as e:
        raise UserError(
            f"{where} is a compressed-tensors checkpoint; reading it needs the compressed-tensors package "
            "(pip install compressed-tensors)."
        ) from e
    try:
        config = QuantizationConfig.model_validate(quant)
    except ValueError as e:  # pydantic's ValidationError
        raise UserError(f"{where}: quantization_config is not a valid compressed-tensors config ({e})") from e
    groups = list(config.config_groups.values())
    scheme = groups[0] if len(groups) == 1 else None
    weights = scheme and scheme.weights
    fmt = (scheme and scheme.format) or config.format
    ok = (
        _weights_ok(weights, fmt)
        and _activations_ok(scheme.input_activations, weights)
        and scheme.output_activations is None
        and config.kv_cache_scheme is None
    )
    if not ok:
        got = (
            f"{len(groups)} config groups"
            if scheme is None
            else f"weights {_brief(weights, {'num_bits', 'type', 'symmetric', 'strategy', 'group_size', 'actorder'})}, "
            f"input activations {_brief(scheme.input_activations, {'num_bits', 'type', 'strategy', 'dynamic'})}, "
            f"format {fmt!r}"
        )
        raise UserError(
            f"{where} is a compressed-tensors checkpoint with {got}; this runtime reads {SUPPORTED}."
        )
    return CheckpointScheme(
        weights.type,
        weights.num_bits,
        weights.strategy,
        weights.group_size if weights.strategy == "group" else None,
        scheme.input_activations is not None,
        fmt == "pack-quantized",
        list(scheme.targets),
        list(config.ignore or []),
    )


def prepare_model(model: nn.Module, scheme: CheckpointScheme) -> int:
    """Gives every linear layer the scheme targets quantized weights and their scales; returns how many."""
    from compressed_tensors.utils import is_match

    # targets name module classes, and every layer here stands for a Linear
    probe = nn.Linear(1, 1, device="meta")
    method = scheme.method()
    layers = linear_layers(model, lambda name: is_match(name, probe, scheme.targets, scheme.ignore))
    for layer in layers:
        layer.quant_method = method
        method.prepare_for_quantized_weights(layer, scheme.group_size)
    return len(layers)


class PackedInts:
    """A pack-quantized weight read as int8 [out, in]: the rows asked for are read from disk, then unpacked."""

    def __init__(self, packed: LoadedWeight, num_bits: int):
        self.packed, self.num_bits = packed, num_bits
        rows, words = weight_shape(packed)
        self.shape = (rows, words * 32 // num_bits)

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        index = () if index is Ellipsis else index if isinstance(index, tuple) else (index,)
        rows = index[0] if index else slice(None)
        packed = self.packed[rows] if isinstance(self.packed, torch.Tensor) else self.packed[rows, :]
        q = unpack_from_int32(packed, self.num_bits, torch.Size([packed.shape[0], self.shape[1]]))
        return q[:, index[1]] if len(index) > 1 else q


def decode_weights(
    weights: Iterable[tuple[str, LoadedWeight]], scheme: CheckpointScheme
) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors under the names and layout the prepared layers load: ``X.weight_packed`` becomes
    ``X.weight`` (int8), ``X.weight_shape`` is checked against it, and a per-tensor ``X.weight_scale`` is repeated
    for every row of ``X.weight`` (the layers hold one scale per row, so fused q / k / v keep their own)."""
    rows: dict[str, int] = {}
    widths: dict[str, int] = {}
    shapes: dict[str, list[int]] = {}
    tensor_scales: dict[str, torch.Tensor] = {}
    for name, weight in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight_packed" and scheme.packed:
            weight = PackedInts(weight, scheme.num_bits)
            widths[prefix], name = weight.shape[1], f"{prefix}.weight"
        elif leaf == "weight_shape" and scheme.packed:
            shapes[prefix] = materialize(weight).tolist()
            continue
        elif leaf == "weight_scale" and scheme.strategy == "tensor":
            tensor_scales[prefix] = materialize(weight).reshape(1, 1)
            continue
        if name.endswith(".weight"):
            rows[prefix] = weight_shape(weight)[0]
        yield name, weight
    for prefix, shape in shapes.items():
        if prefix in widths and shape[1] != widths[prefix]:
            raise UserError(
                f"{prefix}: weight_shape {shape} has {shape[1]} input columns, but its packed words hold "
                f"{widths[prefix]}; padded packing is not read."
            )
    for prefix, scale in tensor_scales.items():
        yield f"{prefix}.weight_scale", scale.float().expand(rows.get(prefix, 1), 1)
