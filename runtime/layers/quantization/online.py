"""``model_config.quant_method``: quantize a float checkpoint's linear layers once it is loaded.

Plain ``nn.Linear`` layers of a single-rank model become ``ReplicatedLinear`` holding the same parameters, so
every linear layer carries a ``quant_method``; the LM head is quantized too (an embedding tied to it is not).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from runtime.errors import UserError
from runtime.layers.embedding import ParallelLMHead
from runtime.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from runtime.layers.quantization.base import UNQUANTIZED
from runtime.layers.quantization.int8_weight_only import Int8WeightOnlyMethod
from runtime.layers.quantization.quantized_weights import QuantizedWeightMethod
from runtime.layers.quantization.w8a8 import Fp8Method, Int8DynamicMethod

logger = logging.getLogger(__name__)

ONLINE_METHODS: dict[str, type[QuantizedWeightMethod]] = {
    m.name: m for m in (Int8WeightOnlyMethod, Int8DynamicMethod, Fp8Method)
}
LINEAR_LAYERS = (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear, ParallelLMHead)


def _replicated(linear: nn.Linear) -> ReplicatedLinear:
    with torch.device("meta"):
        layer = ReplicatedLinear(
            linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype
        )
    layer.weight, layer.bias = linear.weight, linear.bias
    return layer


def linear_layers(model: nn.Module, select: Callable[[str], bool] = lambda name: True) -> list[nn.Module]:
    """The linear layers whose module names `select` takes, plain ``nn.Linear`` ones swapped for
    ``ReplicatedLinear`` (which holds a ``quant_method``) with the same parameters."""
    for name, child in list(model.named_modules()):
        if type(child) is nn.Linear and select(name):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, _replicated(child))
    return [m for name, m in model.named_modules() if isinstance(m, LINEAR_LAYERS) and select(name)]


def quantize_online(model: nn.Module, method_name: str, prequantized: bool = False) -> int:
    """Gives every linear layer the named method; returns how many. Call after loading a float checkpoint and
    before the post-load hooks, or (``prequantized``) before loading shards convert-weights quantized."""
    method = ONLINE_METHODS[method_name](prequantized)
    layers = linear_layers(model)
    if done := [layer for layer in layers if layer.quant_method is not UNQUANTIZED]:
        raise UserError(
            f"{len(done)} linear layers already hold quantized weights from the checkpoint "
            f"({type(done[0].quant_method).__name__}); model_config.quant_method {method_name!r} cannot quantize "
            'them again: set it to "none".'
        )
    for layer in layers:
        layer.quant_method = method
        if prequantized:
            method.prepare_for_quantized_weights(layer)
    device = next(model.parameters()).device
    logger.info(
        "[Main] %s: %d linear layers %s; %s",
        method_name,
        len(layers),
        "read quantized from the checkpoint" if prequantized else "quantized at load",
        method.describe(device),
    )
    return len(layers)


def process_layers_after_loading(model: nn.Module) -> None:
    """Runs every layer's ``quant_method`` hook."""
    for module in list(model.modules()):
        if (method := getattr(module, "quant_method", None)) is not None:
            method.process_weights_after_loading(module)


def process_weights_after_loading(model: nn.Module) -> None:
    """The layers' ``quant_method`` hooks, then the model's own ``process_weights_after_loading``."""
    process_layers_after_loading(model)
    if hasattr(model, "process_weights_after_loading"):
        model.process_weights_after_loading()
