"""Save a float transformers checkpoint as compressed-tensors would (its own API, scales from each weight's
range), for the quantized-checkpoint tests: ``save_compressed(src, out, scheme)``."""

import shutil
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams
from transformers import AutoModelForCausalLM

_INT8_CHANNEL = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
_FP8 = {"num_bits": 8, "type": "float", "symmetric": True}
_PER_TOKEN = {"strategy": "token", "dynamic": True}
# name -> (weight args, input activation args, format)
SCHEMES = {
    "w8a16": (_INT8_CHANNEL, None, "pack-quantized"),
    "w8a16_int": (_INT8_CHANNEL, None, "int-quantized"),
    "w4a16_g32": (
        {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32},
        None,
        "pack-quantized",
    ),
    "w8a8": (_INT8_CHANNEL, {**_INT8_CHANNEL, **_PER_TOKEN}, "int-quantized"),
    "fp8": ({**_FP8, "strategy": "channel"}, {**_FP8, **_PER_TOKEN}, "float-quantized"),
    "fp8_tensor": ({**_FP8, "strategy": "tensor"}, {**_FP8, **_PER_TOKEN}, "float-quantized"),
    # static activation scales (llm-compressor's FP8 preset): not read by the runtime
    "fp8_static": (
        {**_FP8, "strategy": "tensor"},
        {**_FP8, "strategy": "tensor", "dynamic": False},
        "float-quantized",
    ),
}


def _range(w: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    if args.strategy == "group":
        w = w.unflatten(-1, (-1, args.group_size))
        return w.amin(dim=-1), w.amax(dim=-1)
    if args.strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    return w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)


def save_compressed(src: Path, out: Path, scheme_name: str) -> Path:
    weights, activations, fmt = SCHEMES[scheme_name]
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(**weights),
        input_activations=activations and QuantizationArgs(**activations),
        format=fmt,
    )
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    with torch.no_grad():
        for m in model.modules():
            if getattr(m, "quantization_scheme", None) is None:
                continue
            scale, zero_point = calculate_qparams(
                *_range(m.weight, m.quantization_scheme.weights), m.quantization_scheme.weights
            )
            m.weight_scale.copy_(scale.reshape(m.weight_scale.shape))
            m.weight_zero_point.copy_(zero_point.reshape(m.weight_zero_point.shape))
            m.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for f in Path(src).iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(f, out / f.name)
    return out
