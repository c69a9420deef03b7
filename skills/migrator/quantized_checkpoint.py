"""Checkpoints saved quantized (config.json ``quantization_config``): refused before anything is converted.

No on-disk quantization format is loaded yet; the runtime quantizes a float checkpoint at load instead
(``model_config.quant_method``).
"""

from pathlib import Path

from runtime.errors import UserError
from runtime.layers.quantization.online import ONLINE_METHODS


def refuse_quantized(config: dict, checkpoint: Path) -> None:
    quant = config.get("quantization_config")
    if not quant:
        return
    method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
    detail = f", format {quant['format']!r}" if isinstance(quant, dict) and quant.get("format") else ""
    raise UserError(
        f"{checkpoint / 'config.json'} declares a quantized checkpoint (quantization_config.quant_method "
        f"{method!r}{detail}); skill migrate reads float checkpoints only (supported quantization_config "
        f"formats: none yet). Migrate the float (bf16 / fp32) release of the model instead; to run it with "
        f"int8 weights set model_config.quant_method to {' or '.join(ONLINE_METHODS)} in the YAML."
    )
