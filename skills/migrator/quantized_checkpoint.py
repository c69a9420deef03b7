"""Checkpoints saved quantized (config.json ``quantization_config``): checked before anything is converted, so a
format the runtime cannot read is refused naming it and the supported ones."""

from pathlib import Path

from runtime.layers.quantization.compressed_tensors import checkpoint_scheme


def check_quantized(config: dict, checkpoint: Path) -> None:
    checkpoint_scheme(config.get("quantization_config"), str(checkpoint / "config.json"))
