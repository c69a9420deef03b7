"""Shared test setup: offline HF, `scripts/` importable, and a tiny llama checkpoint built once per session."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from tiny_checkpoint import PARITY_PROMPTS, make_tokenizer, pick_seed, tiny_config


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random llama whose greedy decoding of the raw PARITY_PROMPTS ids has a clear top-1 at every step."""
    out = tmp_path_factory.mktemp("tiny_llama")
    config = tiny_config("llama")
    tokenizer = make_tokenizer(out, config.vocab_size)
    pick_seed(config, out, [tokenizer(p)["input_ids"] for p in PARITY_PROMPTS])
    return out
