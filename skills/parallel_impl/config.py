"""Reading a parallelize config (seed 002's ``parallel_config``) and naming the YAML of each scenario."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import yaml
from pydantic import ValidationError

from runtime.config import ParallelConfig
from runtime.errors import ConfigError

# Top-level keys of a full inference YAML (seed 002's four sections plus the launcher's copies).
_DOCUMENT_KEYS = (
    "model_name",
    "world_size",
    "data_config",
    "model_config",
    "parallel_config",
    "scheduler_config",
)
# derived size -> the TP size it is world_size divided by
_DERIVED = {
    "attn_dp_size": "attn_tp_size",
    "moe_ep_size": "moe_tp_size",
    "embed_dp_size": "embed_tp_size",
    "lmhead_dp_size": "lmhead_tp_size",
    "dense_dp_size": "dense_tp_size",
}
_PARALLEL_KEYS = (*ParallelConfig.model_fields, *_DERIVED)


def _unknown(path: Path, keys: dict, allowed: tuple[str, ...], where: str) -> None:
    for key in keys:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            guess = f" (did you mean `{close[0]}`?)" if close else ""
            raise ConfigError(
                f"{path}: unknown key `{where}{key}`{guess}; the keys allowed there are: "
                f"{', '.join(allowed)}."
            )


def load_parallel_config(path: Path) -> ParallelConfig:
    """The parallel sizes in `path`: a ``parallel_config`` block (other sections of an inference YAML are ignored)
    or the same keys bare at the top level, not both.

    ``world_size`` is required, at the top level or in the block (equal when in both). Derived sizes
    (``attn_dp_size``...) may be written and must equal world_size / their TP size.
    """
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(
            f"cannot read parallel config {path}: {e.strerror}; pass the path of a YAML holding a "
            "parallel_config block (or its keys at the top level) with --config."
        ) from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: malformed YAML: {e}; fix the syntax (indentation, a missing ':').") from e
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: expected a mapping such as `parallel_config: {{world_size: 2, attn_tp_size: 2}}`, "
            f"got {type(data).__name__}."
        )
    if (set(data) - {"world_size"}) & set(_DOCUMENT_KEYS):
        bare = sorted((set(data) & set(_PARALLEL_KEYS)) - {"world_size"})
        if bare:
            raise ConfigError(
                f"{path}: `{bare[0]}` is at the top level next to other sections; write either a "
                f"parallel_config block or bare keys, not both: move {', '.join(bare)} into "
                "parallel_config."
            )
        _unknown(path, data, _DOCUMENT_KEYS, "")
        block, where = data.get("parallel_config") or {}, "parallel_config."
        if not isinstance(block, dict):
            raise ConfigError(
                f"{path}: parallel_config is a {type(block).__name__}; write a mapping of sizes such "
                "as `parallel_config: {world_size: 2, attn_tp_size: 2}`."
            )
        top = data.get("world_size")
    else:
        block, where, top = data, "", None
    _unknown(path, block, _PARALLEL_KEYS, where)
    if top is not None and block.get("world_size", top) != top:
        raise ConfigError(
            f"{path}: `world_size` is {top} but `parallel_config.world_size` is "
            f"{block['world_size']}; make them equal (seed 002 writes both), or drop one."
        )
    if top is None and "world_size" not in block:
        raise ConfigError(
            f"{path}: world_size is not set; add `world_size: N` (the number of ranks, which every "
            f"*_tp_size must divide) to {where.rstrip('.') or 'the file'}."
        )
    try:
        pc = ParallelConfig.model_validate(
            {"world_size": top, **{k: v for k, v in block.items() if k not in _DERIVED}}
        )
    except ValidationError as e:
        raise ConfigError(
            f"{path}: "
            + " ".join(
                f"`{where}{err['loc'][0]}` is {err['input']!r}: {err['msg'].lower()}." for err in e.errors()
            )
        ) from e
    w = pc.world_size
    for key, value in block.items():
        if key in _DERIVED:
            tp_key = _DERIVED[key]
            tp = getattr(pc, tp_key)
            if w % tp or value != w // tp:
                fix = f"make {tp_key} divide {w}" if w % tp else f"set it to {w // tp}"
                raise ConfigError(
                    f"{path}: `{where}{key}` is {value!r}, but it is derived: world_size {w} / "
                    f"{tp_key} {tp}; remove it or {fix}."
                )
    return pc


def yaml_name(model_name: str, pc: ParallelConfig, moe: bool = False, scenario: str = "") -> str:
    """``{model}_rank_{W}_{attn_tp}tp[_{attn_dp}dp][_{module}tp{n}...][_ep{m}][_{scenario}].yaml``.

    After seed 002's ``{model}_rank_{W}_{tp}tp_prefill.yaml`` / ``..._densetp{n}_ep{m}.yaml``: attention's TP (and DP
    when > 1) come first; dense, embed and lmhead TP follow when they differ from attn_tp; oproj and shared TP when
    neither 1 (unset) nor attn_tp; for MoE models ``moetp{n}`` when > 1, ``ep{m}`` when > 1 and the dispatch mode
    (``allgather``) when it is not the default.
    E.g. ``llama_rank_2_2tp.yaml``, ``llama_rank_4_2tp_2dp_densetp4_embedtp4_lmheadtp4.yaml``.
    """
    a = pc.attn_tp_size
    parts = [re.sub(r"[^a-z0-9]+", "_", model_name.lower()).strip("_"), "rank", str(pc.world_size), f"{a}tp"]
    parts += [f"{pc.attn_dp_size}dp"] if pc.attn_dp_size > 1 else []
    parts += [
        f"{m}tp{n}"
        for m, n in (("dense", pc.dense_tp_size), ("embed", pc.embed_tp_size), ("lmhead", pc.lmhead_tp_size))
        if n != a
    ]
    parts += [
        f"{m}tp{n}"
        for m, n in (("oproj", pc.o_proj_tp_size), ("shared", pc.shared_tp_size))
        if n not in (1, a)
    ]
    if moe:
        parts += [f"moetp{pc.moe_tp_size}"] if pc.moe_tp_size > 1 else []
        parts += [f"ep{pc.moe_ep_size}"] if pc.moe_ep_size > 1 else []
        default = ParallelConfig.model_fields["moe_dispatch"].default
        parts += [pc.moe_dispatch.replace("_", "")] if pc.moe_dispatch != default else []
    parts += [scenario] if scenario else []
    return "_".join(parts) + ".yaml"
