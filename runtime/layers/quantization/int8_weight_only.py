"""int8 weights, activations in the model's dtype (W8A16). ``int8_weight_only`` quantizes a float checkpoint at
load (symmetric, scale = max |w| / 127 per channel)."""

from runtime.layers.quantization.formats import INT8
from runtime.layers.quantization.quantized_weights import QuantizedWeightMethod


class Int8WeightOnlyMethod(QuantizedWeightMethod):
    name = "int8_weight_only"
    qtype = INT8
