"""`skill convert-weights`: every rank's weight shards for one parallel config, saved ahead of time.

Each rank's model is built on the CPU with a CommManager that knows the rank's shards but creates no process
group; the original checkpoint goes through the normal weight loaders (each rank reads only its slices) and
the parameters are saved to OUT/rank_<r>/model.safetensors, one rank at a time. OUT is staged in a sibling
directory and renamed into place once complete; the runtime's load_checkpoint copies a rank's shards in
by name.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file
from torch import nn
from transformers import PretrainedConfig

from runtime.config import InferenceConfig
from runtime.config.comm_manager import CommManager
from runtime.engine.loader import (
    CONVERTED_META,
    SHARD_FILE,
    checkpoint_files,
    is_converted,
    load_checkpoint,
    rank_dir,
)
from runtime.engine.model_worker import default_dtype, param_bytes
from runtime.engine.registry import resolve_model
from runtime.errors import ConfigError, UserError
from runtime.layers.linear import RowParallelLinear
from runtime.layers.quantization.formats import channel_maxima
from runtime.layers.quantization.online import process_layers_after_loading, quantize_online
from runtime.layers.weights import named_weights
from skills.atomic_write import write_text_atomic
from skills.parallel_impl.pipeline import _load, _Target, replicates_attention, scenario_yaml_name
from skills.parallel_impl.scenario import scenario_yaml

# Checkpoint files that are (or index) weights: converted, not copied. Hidden files (.cache/) are skipped too.
WEIGHT_PATTERNS = (
    "*.safetensors",
    "*.bin",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.h5",
    "*.msgpack",
    "*.gguf",
    "*.index.json",
)
_MODEL_PATH = re.compile(r"^(  model_path:).*$", re.MULTILINE)
_QUANT_METHOD = re.compile(r"^  quant_method:.*\n", re.MULTILINE)
# --quant-mode -> the model_config.quant_method its shards are saved with
QUANT_MODES = {"w8a16": "int8_weight_only", "w8a8": "w8a8_dynamic", "fp8": "fp8"}


@dataclasses.dataclass
class ConvertResult:
    model_dir: str
    out: str
    yaml: str
    world_size: int
    ranks: list[int]  # parameter bytes saved for each rank

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _source(t: _Target) -> Path:
    source = Path(t.config.model_config.model_path).expanduser().resolve()
    if is_converted(source):
        raise UserError(
            f"{t.yaml_path} points model_config.model_path at {source}, which `skill convert-weights` wrote; "
            "set it back to the original checkpoint (convert-weights reads the unsharded weights)."
        )
    return source


def _require_parallel_code(t: _Target, config_path: Path) -> None:
    """The model class must already be rewritten to parallel layers."""
    if not hasattr(t.model_cls, "init_parallel_comm_group"):
        raise UserError(
            f"{t.model_dir} holds the single-rank code of {t.model_cls.__name__} (no "
            "init_parallel_comm_group), so its weights cannot be sharded; run `skill parallelize "
            f"{t.model_dir} --config {config_path}` first."
        )


def _check_out(out: Path, source: Path, model_dir: Path, force: bool) -> None:
    """OUT may not be, hold or lie inside the checkpoint or the model directory; --force replaces only an earlier
    convert-weights output (or an empty directory), never other files."""
    for path, what in ((source, "the source checkpoint"), (model_dir, "the model directory")):
        if out == path or out in path.parents or path in out.parents:
            raise UserError(
                f"-o {out} overlaps {what} {path}; write the converted weights to a directory of their own."
            )
    if not out.exists():
        return
    if not force:
        raise UserError(
            f"{out} already exists; pass --force to replace it (once the new one is complete), or choose "
            "another -o."
        )
    if not (is_converted(out) or (out.is_dir() and not any(out.iterdir()))):
        raise UserError(
            f"{out} exists and is not a `skill convert-weights` output (no parallel_config.json), so --force will "
            "not delete it; choose another -o or remove it yourself."
        )


def _offline_yaml(t: _Target, out: Path, quant_method: str) -> tuple[str, str]:
    """(file name, text): the model's YAML with the parallel config applied, model_path set to `out` and
    model_config.quant_method to the shards' own."""
    name = scenario_yaml_name(t, scenario="offline" if quant_method == "none" else f"offline_{quant_method}")
    text = scenario_yaml(t.yaml_path.read_text(encoding="utf-8"), t.pc, f"config/{name}")
    text = _QUANT_METHOD.sub("", text)
    text = _MODEL_PATH.sub(
        lambda m: f"{m[1]} {json.dumps(str(out))}\n  quant_method: {json.dumps(quant_method)}", text, count=1
    )
    if (yaml.safe_load(text).get("model_config") or {}).get("model_path") != str(out):
        raise ConfigError(
            f"{t.yaml_path} has no `  model_path:` line in its model_config section; re-run `skill migrate "
            "--force` to regenerate the model's YAML."
        )
    return name, text


def _refuse_overwrite(path: Path, text: str, force: bool) -> None:
    if not force and path.exists() and path.read_text(encoding="utf-8") != text:
        raise UserError(
            f"{path} exists and differs from the YAML for this conversion; pass --force to overwrite it "
            "(your edits there would be lost)."
        )


def _build_rank(
    model_cls: type[nn.Module], hf_config: PretrainedConfig, config: InferenceConfig, rank: int
) -> nn.Module:
    comm_manager = CommManager(config.parallel_config.world_size, rank, create_groups=False)
    with torch.device("cpu"), default_dtype(config.model_config.torch_dtype):
        model = model_cls(hf_config, config.with_rank(rank, rank), comm_manager, prefix="")
    return model.eval().requires_grad_(False)


def _row_maxima(t: _Target, config: InferenceConfig, source: Path) -> dict[str, torch.Tensor]:
    """Per row-parallel layer, the largest |w| of each output row over every rank's shard: the scales of the
    whole row, as the run's collective would compute them (convert-weights builds one rank at a time)."""
    maxima: dict[str, torch.Tensor] = {}
    for rank in range(t.pc.world_size):
        model = _build_rank(t.model_cls, t.hf_config, config, rank)
        load_checkpoint(model, source)
        for name, m in model.named_modules():
            if isinstance(m, RowParallelLinear):
                amax = channel_maxima(m.weight)
                maxima[name] = torch.maximum(maxima[name], amax) if name in maxima else amax
        del model
        gc.collect()
    return maxima


def _save_rank(
    model: nn.Module,
    source: Path,
    folder: Path,
    quant_method: str = "none",
    row_maxima: dict[str, torch.Tensor] | None = None,
) -> int:
    """Loads `source` through the weight loaders, quantizes it if asked and saves the parameters (tied ones
    once); their bytes."""
    load_checkpoint(model, source)
    if quant_method != "none":
        quantize_online(model, quant_method)
        for name, m in model.named_modules():
            if (amax := (row_maxima or {}).get(name)) is not None:
                m.row_amax = amax
        process_layers_after_loading(model)
    state = {name: p.detach().contiguous() for name, p in named_weights(model).items()}
    folder.mkdir()
    save_file(state, folder / SHARD_FILE, metadata={"format": "pt"})
    os.chmod(folder / SHARD_FILE, folder.stat().st_mode & 0o666)  # safetensors creates it 0600
    return param_bytes(model)


def _meta(t: _Target, source: Path, ranks: list[int], quant_method: str) -> dict:
    fingerprint = {str(f.relative_to(source)): f.stat().st_size for f in checkpoint_files(source)}
    return {
        "parallel_config": t.pc.model_dump(),
        "quant_method": quant_method,
        "entry_class": t.model_cls.__name__,
        "source": str(source),
        "source_fingerprint": fingerprint,
        "param_bytes_per_rank": ranks,
    }


def _install(staged: Path, out: Path) -> None:
    """Renames `staged` to `out`; an existing `out` is moved aside first and removed once replaced."""
    if not out.exists():
        os.replace(staged, out)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
    os.replace(out, aside / out.name)
    try:
        os.replace(staged, out)
    except OSError:
        os.replace(aside / out.name, out)  # put the old one back
        raise
    shutil.rmtree(aside)


def convert_weights(
    model_dir: Path,
    config_path: Path,
    out: Path,
    force: bool = False,
    log: Callable[[str], None] = lambda msg: None,
    quant_mode: str | None = None,
) -> ConvertResult:
    if quant_mode is not None and quant_mode not in QUANT_MODES:
        raise UserError(
            f"--quant-mode {quant_mode!r} is not supported; choose {', '.join(QUANT_MODES)} (int8 weights; int8 "
            "weights and activations; fp8 weights and activations; each weight with one scale per output channel)."
        )
    quant_method = QUANT_MODES.get(quant_mode, "none")
    resolve_model.cache_clear()  # the model code may have been rewritten since it was last imported
    t = _load(model_dir, config_path, replicate_attention=replicates_attention(model_dir))
    out, source = out.expanduser().resolve(), _source(t)
    _check_out(out, source, t.model_dir, force)
    name, text = _offline_yaml(t, out, quant_method)
    target_yaml = t.model_dir / "config" / name
    _refuse_overwrite(target_yaml, text, force)
    config = InferenceConfig.from_dict(yaml.safe_load(text), source=str(target_yaml))
    _require_parallel_code(t, config_path)

    out.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    staged.chmod(0o755)  # mkdtemp's 0700 would make OUT private
    try:
        shutil.copytree(
            source, staged, ignore=shutil.ignore_patterns(*WEIGHT_PATTERNS, ".*"), dirs_exist_ok=True
        )
        row_maxima = _row_maxima(t, config, source) if quant_method != "none" else {}
        ranks = []
        for rank in range(t.pc.world_size):
            model = _build_rank(t.model_cls, t.hf_config, config, rank)
            ranks.append(_save_rank(model, source, rank_dir(staged, rank), quant_method, row_maxima))
            del model
            gc.collect()  # parameters and their weight_loaders reference each other: free before the next rank
            log(f"rank {rank}/{t.pc.world_size}: {ranks[-1] / 2**20:.1f} MiB of parameters")
        (staged / CONVERTED_META).write_text(
            json.dumps(_meta(t, source, ranks, quant_method), indent=2) + "\n", encoding="utf-8"
        )
        _install(staged, out)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    write_text_atomic(target_yaml, text)
    return ConvertResult(str(t.model_dir), str(out), str(target_yaml), t.pc.world_size, ranks)
