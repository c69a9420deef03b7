"""The runtime's YAML config: four sections named as in cann-recipes-infer, loaded strictly.

Unknown keys, wrong scalar types and inconsistent parallel sizes are rejected with a
:class:`ConfigError` naming the file, the dotted key, the bad value and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from runtime.config.ineffective import warn_ineffective
from runtime.errors import ConfigError

NPU_GRAPH_MODES = ("ge_graph", "npugraph_ex")


def npu_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch_npu") is not None


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, protected_namespaces=())


class DataConfig(_Section):
    dataset: str = "default"
    dataset_path: str = ""
    input_truncated_len: int = Field(256, gt=0)
    prompts: list[str] | None = None


class ModelConfig(_Section):
    model_name: str = "model"
    model_path: str = ""
    output_path: str = ""
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "bfloat16"
    with_ckpt: bool = True
    next_n: int = Field(0, ge=0)
    exe_mode: str = "eager"
    # quantize a float checkpoint's linear layers at load (runtime/layers/quantization/online.py)
    quant_method: Literal["none", "int8_weight_only", "w8a8_dynamic", "fp8"] = "none"
    enable_profiler: bool = False
    # Accepted for compatibility with seed YAMLs; set, they warn that they have no effect (ineffective.py).
    enable_weight_nz: bool = False
    enable_cache_compile: bool = False
    enable_static_kernel: bool = False
    force_eplb: bool = False
    platform_version: str | None = None
    custom_params: dict[str, Any] = {}
    trust_remote_code: bool = False

    @field_validator("exe_mode")
    @classmethod
    def _known_mode(cls, v: str) -> str:
        if v in NPU_GRAPH_MODES:
            if not npu_importable():
                raise ValueError(
                    f"{v!r} is an Ascend graph mode and needs torch_npu, which is not installed "
                    'here; use "compile" (torch.compile of the decode step) or "eager"'
                )
        elif v not in ("eager", "compile"):
            raise ValueError(
                f'unknown mode {v!r}: use "eager", "compile" (torch.compile of the decode step), '
                'or with torch_npu "ge_graph" / "npugraph_ex"'
            )
        return v

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


# derived data-parallel size -> the tensor-parallel size it is world_size divided by
_DERIVED = {
    "attn_dp_size": "attn_tp_size",
    "moe_ep_size": "moe_tp_size",
    "embed_dp_size": "embed_tp_size",
    "lmhead_dp_size": "lmhead_tp_size",
    "dense_dp_size": "dense_tp_size",
}
_SPLITS = (
    "attn_tp_size",
    "dense_tp_size",
    "moe_tp_size",
    "embed_tp_size",
    "lmhead_tp_size",
    "o_proj_tp_size",
    "shared_tp_size",
    "cp_size",
)


class ParallelConfig(_Section):
    world_size: int = Field(1, ge=1)
    attn_tp_size: int = Field(1, ge=1)
    dense_tp_size: int = Field(1, ge=1)
    moe_tp_size: int = Field(1, ge=1)
    embed_tp_size: int = Field(1, ge=1)
    lmhead_tp_size: int = Field(1, ge=1)
    o_proj_tp_size: int = Field(1, ge=1)
    shared_tp_size: int = Field(1, ge=1)
    cp_size: int = Field(1, ge=1)
    # how tokens reach the experts of other ranks when ranks hold different tokens (runtime/layers/moe.py)
    moe_dispatch: Literal["all_to_all", "all_gather"] = "all_to_all"
    _global_rank: int = PrivateAttr(0)
    _local_rank: int = PrivateAttr(0)

    def _per(self, tp_key: str) -> int:
        tp = getattr(self, tp_key)
        assert self.world_size % tp == 0, f"{tp_key}={tp} does not divide world_size={self.world_size}"
        return self.world_size // tp

    @property
    def attn_dp_size(self) -> int:
        return self._per(_DERIVED["attn_dp_size"])

    @property
    def moe_ep_size(self) -> int:
        return self._per(_DERIVED["moe_ep_size"])

    @property
    def embed_dp_size(self) -> int:
        return self._per(_DERIVED["embed_dp_size"])

    @property
    def lmhead_dp_size(self) -> int:
        return self._per(_DERIVED["lmhead_dp_size"])

    @property
    def dense_dp_size(self) -> int:
        return self._per(_DERIVED["dense_dp_size"])

    @property
    def global_rank(self) -> int:
        return self._global_rank

    @property
    def local_rank(self) -> int:
        return self._local_rank

    def with_rank(self, global_rank: int, local_rank: int) -> ParallelConfig:
        assert 0 <= global_rank < self.world_size, (global_rank, self.world_size)
        pc = self.model_copy()
        pc._global_rank, pc._local_rank = global_rank, local_rank
        return pc


class SchedulerConfig(_Section):
    batch_size: int = Field(1, ge=1)
    max_new_tokens: int = Field(32, ge=1)
    max_prefill_tokens: int = Field(0, ge=0)  # 0: no limit
    block_size: int = Field(128, ge=1)
    mem_fraction_static: float = Field(0.85, gt=0, le=1)
    num_kv_blocks: int | None = Field(None, ge=2)  # overrides the KV pool size computed from memory
    num_reserved_decode_tokens: int = Field(64, ge=0)
    stop_token_ids: list[int] = []
    ignore_eos: bool = False


class DisaggConfig(_Section):
    """Prefill/decode disaggregation; set by the launcher, not read from the YAML."""

    disaggregation_mode: Literal["NONE", "PREFILL", "DECODE"] = "NONE"
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = 18800
    local_ip: str = "127.0.0.1"
    store_url: str = ""
    engine_backend: str = "zmq"  # the KV TransferEngine
    kv_timeout_s: float = Field(30.0, gt=0)  # a request whose KV has not arrived by then fails


_SECTIONS: dict[str, type[_Section]] = {
    "data_config": DataConfig,
    "model_config": ModelConfig,
    "parallel_config": ParallelConfig,
    "scheduler_config": SchedulerConfig,
}


class _Document(_Section):
    """The YAML's top level (``model_config`` is a reserved name in pydantic, hence the alias)."""

    model_name: str | None = None
    world_size: int | None = Field(None, ge=1)
    data_config: DataConfig = Field(default_factory=DataConfig)
    model_cfg: ModelConfig = Field(default_factory=ModelConfig, alias="model_config")
    parallel_config: ParallelConfig = Field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = Field(default_factory=SchedulerConfig)


def _fail(source: str, key: str, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"{source}: `{key}` {problem}; {fix}.")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


_TYPE_HINTS = {
    "int_type": "write a whole number without quotes, e.g. 2",
    "bool_type": "write an unquoted YAML boolean: true or false",
    "float_type": "write an unquoted number, e.g. 0.85",
    "string_type": "write a string (quote it if YAML would read it as a number or boolean)",
    "list_type": "write a YAML list",
    "dict_type": "write a YAML mapping",
    "model_type": "write a mapping of that section's keys",
}


def _allowed_keys(section: str | None) -> list[str]:
    if section is None:
        return [f.alias or name for name, f in _Document.model_fields.items()]
    keys = list(_SECTIONS[section].model_fields)
    return keys + list(_DERIVED) if section == "parallel_config" else keys


def _describe(err: dict) -> str:
    loc = err["loc"]
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    if err["type"] == "extra_forbidden":
        section = loc[0] if len(loc) > 1 else None
        allowed = _allowed_keys(section)
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        guess = f" (did you mean `{close[0]}`?)" if close else ""
        where = f"in {section}" if section else "at the top level"
        return f"unknown key `{path}`{guess}; the keys allowed {where} are: {', '.join(allowed)}."
    value = err["input"]
    if err["type"] == "value_error":
        why = str(err["ctx"]["error"])
    else:
        why = err["msg"].replace("Input should", "it should", 1)
    hint = _TYPE_HINTS.get(err["type"])
    return f"`{path}` is {value!r} ({type(value).__name__}): {why}" + (f"; {hint}." if hint else ".")


def _check_parallel(pc: ParallelConfig, source: str) -> None:
    for key in _SPLITS:
        size = getattr(pc, key)
        if pc.world_size % size:
            raise _fail(
                source,
                f"parallel_config.{key}",
                f"is {size}, which does not divide parallel_config.world_size {pc.world_size}",
                f"use a divisor of {pc.world_size}: {', '.join(map(str, _divisors(pc.world_size)))}",
            )


@dataclass
class InferenceConfig:
    """The whole config; ``model_name`` and ``world_size`` default to their section counterparts."""

    model_name: str | None = None
    world_size: int | None = None
    data_config: DataConfig = field(default_factory=DataConfig)
    model_config: ModelConfig = field(default_factory=ModelConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    disagg_config: DisaggConfig = field(default_factory=DisaggConfig)
    source: str = field(default="<dict>", compare=False, repr=False)  # where it was loaded from, for errors

    def __post_init__(self) -> None:
        pc, sc = self.parallel_config, self.scheduler_config
        if self.model_name is None:
            self.model_name = self.model_config.model_name
        if self.world_size is None:
            self.world_size = pc.world_size
        elif self.world_size != pc.world_size:
            raise _fail(
                self.source,
                "world_size",
                f"is {self.world_size} but `parallel_config.world_size` is {pc.world_size}",
                "make them equal, or drop the top-level world_size",
            )
        _check_parallel(pc, self.source)
        dp = pc.attn_dp_size
        if sc.batch_size % dp:
            below = sc.batch_size // dp * dp
            near = " or ".join(str(b) for b in (below, below + dp) if b > 0)
            raise _fail(
                self.source,
                "scheduler_config.batch_size",
                f"is {sc.batch_size}, which is not divisible by attn_dp_size {dp} "
                f"(parallel_config.world_size {pc.world_size} / attn_tp_size {pc.attn_tp_size})",
                f"use a multiple of {dp}, e.g. {near}, or change parallel_config.attn_tp_size",
            )

    @property
    def batch_size_per_dp_rank(self) -> int:
        return self.scheduler_config.batch_size // self.parallel_config.attn_dp_size

    @property
    def max_seq_len(self) -> int:
        return self.data_config.input_truncated_len + self.scheduler_config.max_new_tokens

    def with_rank(self, global_rank: int, local_rank: int) -> InferenceConfig:
        return dataclasses.replace(
            self, parallel_config=self.parallel_config.with_rank(global_rank, local_rank)
        )

    @classmethod
    def from_dict(cls, d: dict, source: str = "<dict>") -> InferenceConfig:
        if not isinstance(d, dict):
            raise ConfigError(
                f"{source}: the top level must be a mapping of keys such as model_config: and "
                f"parallel_config:, got {type(d).__name__}; see the example YAMLs for the layout."
            )
        d = {k: {} if v is None and k in _SECTIONS else v for k, v in d.items()}  # `section:` left empty
        declared = {}
        if isinstance(d.get("parallel_config"), dict):
            par = dict(d["parallel_config"])
            declared = {k: par.pop(k) for k in _DERIVED if k in par}
            d["parallel_config"] = par
        try:
            doc = _Document.model_validate(d)
        except ValidationError as e:
            raise ConfigError(f"{source}: " + " ".join(_describe(err) for err in e.errors())) from e
        cfg = cls(
            model_name=doc.model_name,
            world_size=doc.world_size,
            data_config=doc.data_config,
            model_config=doc.model_cfg,
            parallel_config=doc.parallel_config,
            scheduler_config=doc.scheduler_config,
            source=source,
        )
        pc = cfg.parallel_config
        for key, value in declared.items():
            if value != getattr(pc, key):
                tp_key = _DERIVED[key]
                raise _fail(
                    source,
                    f"parallel_config.{key}",
                    f"is {value!r} but world_size {pc.world_size} / {tp_key} {getattr(pc, tp_key)} "
                    f"= {getattr(pc, key)}",
                    f"remove the key (it is derived) or set it to {getattr(pc, key)}",
                )
        warn_ineffective(d, source)
        return cfg

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> InferenceConfig:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                f"config file {path} does not exist (or is not a file); pass the path of an "
                "inference YAML with --yaml <file>."
            )
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(e, "problem", None) or str(e)
            raise ConfigError(
                f"{path}: malformed YAML{where}: {problem}; fix the syntax there "
                "(indentation, a missing ':' or an unclosed quote)."
            ) from e
        return cls.from_dict(data, source=str(path))

    def to_dict(self) -> dict:
        """The YAML-level dict (no derived or runtime fields); ``from_dict`` of it gives an equal config."""
        return {
            "model_name": self.model_name,
            "world_size": self.world_size,
            **{name: getattr(self, name).model_dump() for name in _SECTIONS},
        }
