"""The inference YAML of one parallel scenario, written from the model's migrated YAML (comments kept)."""

from __future__ import annotations

import re

import yaml

from runtime.config import InferenceConfig, ParallelConfig
from runtime.errors import ConfigError

# Written always (seed 002's block); the other sizes only when they differ from their default.
_ALWAYS = (
    "world_size",
    "attn_tp_size",
    "dense_tp_size",
    "moe_tp_size",
    "embed_tp_size",
    "lmhead_tp_size",
    "o_proj_tp_size",
)
# the section up to the next top-level key (its comments and blank lines included) or the end of the file
_SECTION = re.compile(r"^parallel_config:.*?(?=^[A-Za-z_][\w-]*:|\Z)", re.MULTILINE | re.DOTALL)


def _parallel_block(pc: ParallelConfig) -> str:
    defaults = ParallelConfig(world_size=pc.world_size)
    keys = [
        *_ALWAYS,
        *(
            k
            for k in ParallelConfig.model_fields
            if k not in _ALWAYS and getattr(pc, k) != getattr(defaults, k)
        ),
    ]
    lines = [f"  {k}: {getattr(pc, k)}" for k in keys]
    derived = f"attn_dp_size = {pc.attn_dp_size}, moe_ep_size = {pc.moe_ep_size}"
    return "parallel_config:\n" + "\n".join(lines) + f"\n  # derived, not set here: {derived}\n\n"


def scenario_yaml(base_text: str, pc: ParallelConfig, source: str) -> str:
    """`base_text` with world_size (both places) and parallel_config set from `pc`, and the global batch rounded
    up to a multiple of attn_dp_size; validated by InferenceConfig."""
    text, found = _SECTION.subn(lambda _: _parallel_block(pc), base_text, count=1)
    if not found:
        raise ConfigError(
            f"{source} has no parallel_config section; re-run `skill migrate --force` to regenerate "
            "the model's YAML."
        )
    text = re.sub(r"^world_size:.*$", f"world_size: {pc.world_size}", text, count=1, flags=re.MULTILINE)
    dp = pc.attn_dp_size

    def round_batch(m: re.Match) -> str:
        return f"{m[1]}{-(-int(m[2]) // dp) * dp}"

    text = re.sub(r"^(  batch_size: )(\d+)", round_batch, text, count=1, flags=re.MULTILINE)
    written = InferenceConfig.from_dict(yaml.safe_load(text), source=source)
    assert written.parallel_config == pc and written.world_size == pc.world_size, (
        f"{source}: rewrite lost a size"
    )
    return text
