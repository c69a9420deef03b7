"""Shared test setup: offline HF, `scripts/` importable, and a tiny llama checkpoint built once per session."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from tiny_checkpoint import PARITY_PROMPTS, make_tokenizer, pick_seed, tiny_config


def _tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory, model_type: str) -> Path:
    """Tiny random checkpoint whose greedy decoding of the raw PARITY_PROMPTS ids has a clear top-1 at every
    step."""
    out = tmp_path_factory.mktemp(f"tiny_{model_type}")
    config = tiny_config(model_type)
    tokenizer = make_tokenizer(out, config.vocab_size)
    pick_seed(config, out, [tokenizer(p)["input_ids"] for p in PARITY_PROMPTS])
    return out


@pytest.fixture(scope="session", autouse=True)
def codegen_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One cache of the rules' output (skills/codegen_cache.py) for the whole run, xdist workers included, so
    each architecture and option set is converted by the rules once; set SKILL_CODEGEN_CACHE= to turn it off."""
    root = tmp_path_factory.getbasetemp()
    shared = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    os.environ.setdefault("SKILL_CODEGEN_CACHE", str(shared / "codegen-cache"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_checkpoint(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_checkpoint(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def served_llama(tmp_path_factory: pytest.TempPathFactory):
    """A migrated tiny llama parallelized for TP 2 and for attention DP 2 (+ TP 2 dense), and the offline
    answers the serving tests compare with: (model_dir, {layout: yaml}, {"raw": texts, "chat": texts})."""
    from hf_reference import NEW_TOKENS
    from serve_harness import migrated_with_layouts, offline_outputs

    model_dir, yamls = migrated_with_layouts(
        tmp_path_factory, {"tp2": (2, 2, 2, 2, 2), "attn_dp2": (2, 1, 2, 2, 2)}
    )
    texts = {
        kind: [o["text"] for o in offline_outputs(model_dir, PARITY_PROMPTS, NEW_TOKENS, *flags)]
        for kind, flags in (("raw", ["--raw"]), ("chat", []))
    }
    return model_dir, yamls, texts
