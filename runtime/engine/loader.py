"""Checkpoint loading: stream (name, tensor) pairs into ``model.load_weights`` and check coverage.

A directory written by `skill convert-weights` (parallel_config.json + rank_<i>/model.safetensors) holds
each rank's shards already: they are copied into the parameters by name, for the parallel_config they were
made for only.
"""

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from runtime.config import ParallelConfig
from runtime.errors import UserError
from runtime.layers.quantization.compressed_tensors import (
    CheckpointScheme,
    checkpoint_scheme,
    decode_weights,
    prepare_model,
)
from runtime.layers.quantization.online import quantize_online
from runtime.layers.weights import missing_weights, named_weights, tie_declared_weights

logger = logging.getLogger(__name__)

CONVERTED_META = "parallel_config.json"
SHARD_FILE = "model.safetensors"
REMAP_EVERY = 16  # tensors read through one mapping of a safetensors file


def checkpoint_files(model_path: Path) -> list[Path]:
    if not model_path.is_dir():
        raise UserError(
            f"checkpoint directory {model_path} does not exist; set model_config.model_path "
            "in the YAML to a directory holding config.json and *.safetensors."
        )
    index = model_path / "model.safetensors.index.json"
    if index.exists():
        return [model_path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(model_path.glob("*.safetensors")) or sorted(model_path.glob("pytorch_model*.bin"))
    if not files:
        raise UserError(
            f"no *.safetensors or pytorch_model*.bin weights in {model_path}; point "
            "model_config.model_path at the checkpoint, or set model_config.with_ckpt: False "
            "for random weights."
        )
    return files


def iterate_weights(model_path: Path) -> Iterator[tuple[str, object]]:
    """Yield (name, weight) lazily. Safetensors weights come as slices, so a rank reads only what it keeps."""
    for file in checkpoint_files(Path(model_path)):
        if file.suffix == ".bin":
            try:
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:
                raise UserError(
                    f"cannot read {file} as a PyTorch state dict ({e}); re-export it as safetensors."
                ) from e
            yield from state.items()
            continue
        try:
            with safe_open(str(file), framework="pt") as f:
                names = list(f.keys())
            for start in range(0, len(names), REMAP_EVERY):
                # A fresh mapping per group of tensors: the pages read so far leave this process's resident set
                # when the old one closes, so loading never holds the whole file mapped beside the model.
                with safe_open(str(file), framework="pt") as f:
                    for name in names[start : start + REMAP_EVERY]:
                        yield name, f.get_slice(name)
        except (SafetensorError, OSError) as e:
            raise _unreadable(file, e) from e


def _unreadable(file: Path, e: Exception) -> UserError:
    return UserError(
        f"{file} is not a readable safetensors file ({e}); re-download or re-export the checkpoint."
    )


def rank_dir(out: Path, rank: int) -> Path:
    return Path(out) / f"rank_{rank}"


def is_converted(model_path: Path) -> bool:
    return (Path(model_path) / CONVERTED_META).is_file()


def _describe(configs: list[dict]) -> list[str]:
    """The sizes set to more than 1 in any of `configs`, so that every description lists the same keys."""
    keys = [
        k for k in ParallelConfig.model_fields if k == "world_size" or any(c.get(k, 1) != 1 for c in configs)
    ]
    return ["{" + ", ".join(f"{k}: {c.get(k, 1)}" for k in keys) + "}" for c in configs]


def _read_meta(model_path: Path) -> dict:
    path = model_path / CONVERTED_META
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        ParallelConfig.model_validate(meta["parallel_config"])
        return meta
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"{path} is not a parallel_config.json written by `skill convert-weights` ({e}); "
            "re-run convert-weights, or point model_config.model_path at the original "
            "checkpoint."
        ) from e


def converted_quant_method(model_path: Path) -> str | None:
    """The quant_method a convert-weights directory's shards were saved with; None for a checkpoint."""
    return _read_meta(Path(model_path)).get("quant_method", "none") if is_converted(model_path) else None


def _check_converted_for(model: nn.Module, model_path: Path, meta: dict, pc: ParallelConfig) -> None:
    source = meta.get("source", "the original checkpoint")
    fix = (
        f"re-run `skill convert-weights MODEL_DIR --config PARALLEL.yaml -o {model_path} --force` with "
        f"this run's parallel_config, or point model_config.model_path at the original checkpoint "
        f"({source})."
    )
    stored, running = _describe([meta["parallel_config"], pc.model_dump()])
    if stored != running:
        raise UserError(
            f"{model_path} holds weights converted for parallel_config {stored}, but this "
            f"run's parallel_config is {running}; the shards only fit the config they were made "
            f"for: {fix}"
        )
    entry = type(model).__name__
    if meta.get("entry_class", entry) != entry:
        raise UserError(f"{model_path} holds weights converted for {meta['entry_class']}, not {entry}: {fix}")


def _load_converted(model: nn.Module, model_path: Path, pc: ParallelConfig | None, rank: int) -> set[str]:
    """rank_<rank>/model.safetensors copied into the parameters of the same names (they hold the shards)."""
    meta = _read_meta(model_path)
    _check_converted_for(model, model_path, meta, pc or ParallelConfig())
    file = rank_dir(model_path, rank) / SHARD_FILE
    if not file.is_file():
        raise UserError(
            f"{file} does not exist: {model_path} is incomplete for rank {rank} of world_size "
            f"{meta['parallel_config']['world_size']}; re-run `skill convert-weights ... -o "
            f"{model_path} --force`, or point model_config.model_path at the original "
            "checkpoint."
        )
    params, loaded = named_weights(model), set()
    try:
        with safe_open(str(file), framework="pt") as f:
            names = f.keys()
            for name in names:
                param, shape = params.get(name), tuple(f.get_slice(name).get_shape())
                if param is None or tuple(param.shape) != shape:
                    has = "no such parameter" if param is None else f"it as {list(param.shape)}"
                    raise UserError(
                        f"{file} holds {name!r} of shape {list(shape)}, but "
                        f"{type(model).__name__} has {has}; the model code changed since the "
                        f"conversion: re-run `skill convert-weights ... -o {model_path} "
                        "--force`."
                    )
                param.data.copy_(f.get_tensor(name))
                loaded.add(name)
    except (SafetensorError, OSError) as e:
        raise _unreadable(file, e) from e
    return loaded


def checkpoint_quantization(model_path: Path) -> CheckpointScheme | None:
    """The compressed-tensors scheme config.json declares (None: the checkpoint is not quantized); a UserError
    for one the runtime does not read."""
    path = Path(model_path) / "config.json"
    quant = json.loads(path.read_text()).get("quantization_config") if path.is_file() else None
    return checkpoint_scheme(quant, str(path))


def prepare_for_checkpoint(model: nn.Module, model_path: Path) -> CheckpointScheme | None:
    """Gives the layers a checkpoint holds quantized their weights and scales in that form, whether convert-weights
    saved them so or compressed-tensors did, then shares the parameters the model ties (the checkpoint holds them
    once); returns the compressed-tensors scheme, whose storage the loading decodes."""
    if (saved := converted_quant_method(model_path)) not in (None, "none"):
        quantize_online(model, saved, prequantized=True)
    scheme = checkpoint_quantization(model_path)
    if scheme is not None:
        layers, device = prepare_model(model, scheme), next(model.parameters()).device
        kernels = "" if device.type == "meta" else f"; {scheme.method().describe(device)}"
        logger.info("[Main] %d linear layers read as %s%s", layers, scheme.describe(), kernels)
    tie_declared_weights(
        model
    )  # after the layers took their quantized form, whose parameters are shared then
    return scheme


def checkpoint_weights(model_path: Path, scheme: CheckpointScheme | None) -> Iterator[tuple[str, object]]:
    """(name, weight) as the model loads them: a quantized checkpoint's storage decoded."""
    weights = iterate_weights(model_path)
    return weights if scheme is None else decode_weights(weights, scheme)


def load_checkpoint(
    model: nn.Module, model_path: Path, parallel_config: ParallelConfig | None = None, rank: int = 0
) -> None:
    """Loads the checkpoint (for a converted directory, this rank's shards) and checks every parameter got
    weights. `parallel_config` / `rank`: the running ones, which a converted directory must be made for."""
    model_path = Path(model_path)
    scheme = prepare_for_checkpoint(model, model_path)
    if is_converted(model_path):
        loaded = _load_converted(model, model_path, parallel_config, rank)
    else:
        loaded = model.load_weights(checkpoint_weights(model_path, scheme))
    missing = missing_weights(model, set(loaded))
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise UserError(
            f"the checkpoint in {model_path} has no weights for {missing[:8]}{more}; the "
            "checkpoint does not match the model code (wrong model_path or architecture)."
        )


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """``with_ckpt: False``: small random weights, identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
