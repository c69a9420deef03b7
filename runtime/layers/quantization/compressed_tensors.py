"""Checkpoints saved by compressed-tensors (config.json ``quantization_config.quant_method: compressed-tensors``).

Read: weight-only symmetric int8 / int4 schemes (W8A16, W4A16) with one scale per output channel or per group of
input columns, stored ``pack-quantized`` (int32 words, unpacked with compressed-tensors' own helper),
``naive-quantized`` or ``int-quantized``. The targeted linear layers hold int8 weights (int4 values widened) and
their scales, and run through ``int8_weight_only``'s apply. Anything else is refused, naming the scheme.
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

FORMATS = ("pack-quantized", "naive-quantized", "int-quantized")
SUPPORTED = (
    "compressed-tensors weight-only symmetric int8 / int4 (W8A16, W4A16), per channel or per group, "
    f"formats {', '.join(FORMATS)}"
)


@dataclass(frozen=True)
class CheckpointScheme:
    num_bits: int
    group_size: int | None  # None: one scale per output channel
    packed: bool
    targets: list[str]
    ignore: list[str]


def _brief(args: Any, fields: set[str]) -> dict | None:
    return args and args.model_dump(include=fields)


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
        weights is not None
        and scheme.input_activations is None
        and scheme.output_activations is None
        and config.kv_cache_scheme is None
        and weights.type == "int"
        and weights.symmetric
        and weights.num_bits in (4, 8)
        and weights.strategy in ("channel", "group")
        and not weights.actorder
        and fmt in FORMATS
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
        weights.num_bits,
        weights.group_size if weights.strategy == "group" else None,
        fmt == "pack-quantized",
        list(scheme.targets),
        list(config.ignore or []),
    )


def prepare_model(model: nn.Module, scheme: CheckpointScheme) -> int:
    """Gives every linear layer the scheme targets int8 weights and their scales; returns how many."""
    from compressed_tensors.utils import is_match

    # targets name module classes, and every layer here stands for a Linear
    probe = nn.Linear(1, 1, device="meta")
    method = Int8WeightOnlyMethod(prequantized=True)
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
    ``X.weight`` (int8), and ``X.weight_shape`` is checked against it."""
    if not scheme.packed:
        yield from weights
        return
    widths: dict[str, int] = {}
    shapes: dict[str, list[int]] = {}
    for name, weight in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight_packed":
            ints = PackedInts(weight, scheme.num_bits)
            widths[prefix] = ints.shape[1]
            yield f"{prefix}.weight", ints
        elif leaf == "weight_shape":
            shapes[prefix] = materialize(weight).tolist()
        else:
            yield name, weight
    for prefix, shape in shapes.items():
        if prefix in widths and shape[1] != widths[prefix]:
            raise UserError(
                f"{prefix}: weight_shape {shape} has {shape[1]} input columns, but its packed words hold "
                f"{widths[prefix]}; padded packing is not read."
            )
