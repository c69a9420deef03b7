"""Render a model directory's non-code artifacts (YAML, infer.sh, README, requirements, standalone runner)."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import jinja2
import yaml

from runtime.config import InferenceConfig

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = REPO / "templates"
PARALLEL_KEYS = (
    "attn_tp_size",
    "dense_tp_size",
    "moe_tp_size",
    "embed_tp_size",
    "lmhead_tp_size",
    "o_proj_tp_size",
)
# What a model directory needs at run time, pinned as the project pins them.
REQUIRED_PACKAGES = ("torch", "transformers", "safetensors", "pyyaml")


@dataclass
class RenderContext:
    name: str  # model_name: directory, file and module names
    class_name: str  # CamelCase stem of the runner class: <class_name>Runner
    mode: Literal["framework", "standalone"]
    model_source: str  # HF id / URL or local path the model was migrated from
    model_path: str  # checkpoint directory written into model_config.model_path
    dtype: Literal["float32", "bfloat16", "float16"]
    skill_executable: str  # absolute path of the `skill` that did the migration (infer.sh's fallback)
    world_size: int = 1
    batch_size: int = 1
    max_new_tokens: int = 32
    input_truncated_len: int = 256
    block_size: int = 128
    kv_layout: Literal["paged", "legacy"] = "paged"
    baseline: dict[str, Any] | None = None  # prefill_ms, decode_avg_ms, output_text, device
    needs_multi_card: bool = False
    custom_params: dict[str, Any] = field(default_factory=dict)
    parallel: dict[str, int] | None = None  # *_tp_size overrides; unset sizes are world_size (pure TP)
    prompts: list[str] = field(default_factory=list)  # data_config.prompts; empty: the bundled default set
    yaml_name: str = ""  # config/<yaml_name>.yaml; default: <name>
    trust_remote_code: bool = False
    attention: list[dict[str, Any]] = field(
        default_factory=list
    )  # runtime Attention kinds of the built model
    experts: list[dict[str, Any]] = field(default_factory=list)  # its MoE experts modules and routers
    fused: list[str] = field(default_factory=list)  # "qkv_proj (q_proj, k_proj, v_proj)": fused projections


def yaml_value(value: Any) -> str:
    """A YAML flow scalar / collection; booleans as the seeds write them (True / False)."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{yaml_value(str(k))}: {yaml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} into the YAML")


def md_cell(value: Any) -> str:
    """One Markdown table cell: numbers to 2 decimals, no raw pipes or line breaks."""
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value).replace("|", "\\|").replace("\n", "<br>")


def project_pins(names: tuple[str, ...] = REQUIRED_PACKAGES) -> list[str]:
    """The requirement strings of ``names`` from this project's pyproject.toml, in that order."""
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")  # no tomllib: Python 3.10 is supported
    block = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.DOTALL | re.MULTILINE).group(1)
    deps = re.findall(r'"([^"]+)"', block)
    by_name = {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower(): d for d in deps}
    return [by_name[n] for n in names]


def _parallel_sizes(ctx: RenderContext) -> dict[str, int]:
    given = ctx.parallel or {}
    unknown = sorted(set(given) - set(PARALLEL_KEYS))
    if unknown:
        raise ValueError(f"unknown parallel sizes {unknown}; allowed: {', '.join(PARALLEL_KEYS)}")
    return {k: given.get(k, ctx.world_size) for k in PARALLEL_KEYS}


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["yaml"] = yaml_value
    env.filters["shquote"] = shlex.quote
    env.filters["md_cell"] = md_cell
    return env


def render_artifacts(ctx: RenderContext) -> dict[str, str]:
    """Relative path -> file text; byte-identical for equal contexts. The YAML is validated by the runtime."""
    env = _environment()
    values = {**asdict(ctx), "parallel": _parallel_sizes(ctx), "pins": project_pins(), "repo": str(REPO)}
    yaml_path = f"config/{ctx.yaml_name or ctx.name}.yaml"
    files = {yaml_path: env.get_template("model.yaml.j2").render(values)}
    InferenceConfig.from_dict(yaml.safe_load(files[yaml_path]), source=yaml_path)
    files["infer.sh"] = env.get_template("infer.sh.j2").render(values, yaml_path=yaml_path)
    files["README.md"] = env.get_template("README.md.j2").render(values, yaml_path=yaml_path)
    files["requirements.txt"] = env.get_template("requirements.txt.j2").render(values)
    if ctx.mode == "standalone":
        files[f"runner_{ctx.name}.py"] = env.get_template("runner.py.j2").render(values)
        files["infer.py"] = env.get_template("infer.py.j2").render(values, yaml_path=yaml_path)
    return files
