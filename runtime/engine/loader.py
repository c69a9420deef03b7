"""Checkpoint loading: stream (name, tensor) pairs into ``model.load_weights`` and check coverage."""
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from runtime.errors import UserError


def _checkpoint_files(model_path: Path) -> list[Path]:
    if not model_path.is_dir():
        raise UserError(f"checkpoint directory {model_path} does not exist; set model_config.model_path "
                        "in the YAML to a directory holding config.json and *.safetensors.")
    index = model_path / "model.safetensors.index.json"
    if index.exists():
        return [model_path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(model_path.glob("*.safetensors")) or sorted(model_path.glob("pytorch_model*.bin"))
    if not files:
        raise UserError(f"no *.safetensors or pytorch_model*.bin weights in {model_path}; point "
                        "model_config.model_path at the checkpoint, or set model_config.with_ckpt: False "
                        "for random weights.")
    return files


def iterate_weights(model_path: Path) -> Iterator[tuple[str, object]]:
    """Yield (name, weight) lazily. Safetensors weights come as slices, so a rank reads only what it keeps."""
    for file in _checkpoint_files(Path(model_path)):
        if file.suffix == ".bin":
            try:
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:
                raise UserError(f"cannot read {file} as a PyTorch state dict ({e}); re-export it as "
                                "safetensors.") from e
            yield from state.items()
            continue
        try:
            with safe_open(str(file), framework="pt") as f:
                names = f.keys()
                for name in names:
                    yield name, f.get_slice(name)
        except (SafetensorError, OSError) as e:
            raise UserError(f"{file} is not a readable safetensors file ({e}); re-download or re-export "
                            "the checkpoint.") from e


def load_checkpoint(model: nn.Module, model_path: Path) -> None:
    loaded = model.load_weights(iterate_weights(model_path))
    missing = sorted(set(dict(model.named_parameters())) - set(loaded))
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise UserError(f"the checkpoint in {model_path} has no weights for {missing[:8]}{more}; the "
                        "checkpoint does not match the model code (wrong model_path or architecture).")


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """``with_ckpt: False``: small random weights, identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
