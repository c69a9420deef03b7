"""The installed transformers' real modeling files, located and migrated (`convert_code`) once per test
session: shared by the golden tests of `skill migrate` and of `skill parallelize`."""

import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from skills.migrator.pipeline import convert_code
from skills.migrator.vendor import VendoredSource, locate_source, snake_name

# config.json model_type -> the entry class locate_source must pick
ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


@functools.cache
def source(model_type: str) -> VendoredSource:
    """locate_source on a checkpoint dir holding only config.json, as `skill migrate` does."""
    with tempfile.TemporaryDirectory() as ckpt:
        (Path(ckpt) / "config.json").write_text(json.dumps({"model_type": model_type}))
        return locate_source(Path(ckpt))


@functools.cache
def converted(model_type: str, kv: str) -> dict[str, str]:
    """convert_code's files (2-4 s of CPU each); callers must not modify the dict."""
    return convert_code(source(model_type), snake_name(model_type), kv).files


def paths(model_type: str) -> tuple[str, str]:
    name = snake_name(model_type)
    return f"models/modeling_{name}.py", f"models/configuration_{name}.py"


def ruff_check(code: str, filename: str) -> str:
    """ruff's default rules, no project configuration; '' when clean."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--isolated",
            "--output-format",
            "concise",
            "--stdin-filename",
            filename,
            "-",
        ],
        input=code,
        capture_output=True,
        text=True,
        check=False,
    )
    return "" if proc.returncode == 0 else proc.stdout + proc.stderr
