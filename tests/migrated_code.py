"""The installed transformers' real modeling files, located and migrated (`convert_code`) once per test
session: shared by the golden tests of `skill migrate` and of `skill parallelize`."""

import subprocess
import sys

import snapshots

from skills.migrator.codestyle import LINE_LENGTH
from skills.migrator.vendor import snake_name

source = snapshots.source  # VendoredSource of a model type, located once per session

# config.json model_type -> the entry class locate_source must pick
ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


def converted(model_type: str, kv: str) -> dict[str, str]:
    """convert_code's files, converted once per session (shared with the snapshots); do not modify."""
    return snapshots.converted(model_type, kv).files


def paths(model_type: str) -> tuple[str, str]:
    name = snake_name(model_type)
    return f"models/modeling_{name}.py", f"models/configuration_{name}.py"


def ruff_check(code: str, filename: str) -> str:
    """ruff's default rules at the project's line length, no other configuration; '' when clean."""
    args = ["check", "--isolated", "--line-length", str(LINE_LENGTH), "--output-format", "concise"]
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--stdin-filename", filename, "-"],
        input=code,
        capture_output=True,
        text=True,
        check=False,
    )
    return "" if proc.returncode == 0 else proc.stdout + proc.stderr
