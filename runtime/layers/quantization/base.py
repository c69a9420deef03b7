"""The seed's quantization contract: every linear layer holds a ``quant_method`` that creates its weights,
applies them and post-processes them once they are loaded.

``UnquantizedLinearMethod`` is the default: a float weight [out, in] and ``F.linear``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from runtime.layers.host_linear import host_linear, kernel_applies, packed_linear

if TYPE_CHECKING:
    from runtime.layers.linear import TPModule


class UnquantizedLinearMethod:
    """How a linear layer stores and applies its weight; quantized methods override what differs."""

    name = "none"

    def create_weights(
        self, layer: TPModule, output_size_per_partition: int, input_size_per_partition: int
    ) -> None:
        """Registers the parameters the checkpoint loads (each with the layer's ``weight_loader``)."""
        layer._add_param("weight", output_size_per_partition, input_size_per_partition)

    def apply(self, layer: TPModule, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        packed = getattr(layer, "packed_weight", None)  # oneDNN's layout, set by swap_host_linears
        if packed is not None:
            return packed_linear(x, packed, bias, layer.weight.shape[0])
        # swap_host_linears chose the host kernel, or a 16-bit weight on a host oneDNN cannot pack it for
        if getattr(layer, "host_kernel", False) or kernel_applies(layer.weight):
            return host_linear(x, layer.weight, bias)
        return F.linear(x, layer.weight, bias)

    def apply_partial(
        self, layer: TPModule, x: torch.Tensor
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        """A row-parallel layer's share of the product, and what turns the sum of every rank's share into the
        output (a method whose shares sum exactly applies its scales there)."""
        return self.apply(layer, x), _unchanged

    def process_weights_after_loading(self, layer: TPModule) -> None:
        """Turns the loaded parameters into the form ``apply`` reads; runs once, after every weight is loaded."""


def _unchanged(out: torch.Tensor) -> torch.Tensor:
    return out


UNQUANTIZED = UnquantizedLinearMethod()
