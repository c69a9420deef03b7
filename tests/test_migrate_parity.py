"""`skill migrate` on tiny random checkpoints of several architectures: the converted model reproduces
transformers' greedy tokens (framework + standalone modes, paged + legacy KV) and prefill logits."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_dirs import prefill_logits
from tiny_checkpoint import PARITY_PROMPTS, make_tokenizer, pick_seed, tiny_config
from transformers import AutoModelForCausalLM, AutoTokenizer

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3_text"]
MOE_ARCHS = ["qwen3_moe", "mixtral"]  # framework + paged only: MoE blocks pass through unchanged
NEW_TOKENS = 16


def build_reference(model_type: str, tmp_path_factory) -> dict:
    """A tiny checkpoint of the architecture with a clear greedy margin, and transformers' reference."""
    ckpt = tmp_path_factory.mktemp(model_type)
    config = tiny_config(model_type)
    tok = make_tokenizer(ckpt, config.vocab_size)
    ids = [tok(p)["input_ids"] for p in PARITY_PROMPTS]
    pick_seed(config, ckpt, ids)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(ckpt)
    with torch.no_grad():
        tokens = [model.generate(torch.tensor([x]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=tok.pad_token_id)[0, len(x):].tolist() for x in ids]
        logits = torch.stack([model(torch.tensor([x])).logits[0, -1] for x in ids])
    return {"name": model_type, "ckpt": ckpt, "ids": ids, "tokens": tokens, "logits": logits}


@pytest.fixture(scope="module", params=ARCHS)
def arch(request, tmp_path_factory):
    return build_reference(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=MOE_ARCHS)
def moe_arch(request, tmp_path_factory):
    return build_reference(request.param, tmp_path_factory)


def migrate(arch, out: Path, *flags: str) -> Path:
    cmd = [sys.executable, "-m", "skills.cli", "migrate", str(arch["ckpt"]), "-o", str(out), "--no-run", "--json",
           *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(json.loads(proc.stdout)["model_dir"])


def prompts_args() -> list[str]:
    return [a for p in PARITY_PROMPTS for a in ("--prompt", p)]


def run_json(cmd: list[str]) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def assert_framework_run_matches(reference: dict, model_dir: Path) -> None:
    out = run_json([sys.executable, "-m", "skills.cli", "run", str(model_dir), "--json", "--raw",
                    "--max-new-tokens", str(NEW_TOKENS), *prompts_args()])
    assert [o["prompt_token_ids"] for o in out["outputs"]] == reference["ids"]
    assert [o["token_ids"] for o in out["outputs"]] == reference["tokens"]


@pytest.mark.parametrize("kv", ["paged", "legacy"])
def test_framework_mode_matches_transformers(arch, tmp_path, kv):
    assert_framework_run_matches(arch, migrate(arch, tmp_path, "--kv", kv, "--mode", "framework"))


def test_moe_checkpoints_load_and_match_transformers(moe_arch, tmp_path):
    """Per-expert tensors on disk, stacked 3-D expert parameters in memory."""
    assert_framework_run_matches(moe_arch, migrate(moe_arch, tmp_path))


@pytest.mark.parametrize("kv", ["paged", "legacy"])
def test_standalone_mode_matches_transformers(arch, tmp_path, kv):
    model_dir = migrate(arch, tmp_path, "--kv", kv, "--mode", "standalone")
    assert (model_dir / f"runner_{model_dir.name}.py").is_file()
    out = run_json(["bash", str(model_dir / "infer.sh"), "--json", "--raw", "--max_new_tokens", str(NEW_TOKENS),
                    *[a for p in PARITY_PROMPTS for a in ("--prompt", p)]])
    assert [o["token_ids"] for o in out["outputs"]] == arch["tokens"]


def test_prefill_logits_match_transformers(arch, tmp_path):
    logits = prefill_logits(migrate(arch, tmp_path), arch["ids"])
    torch.testing.assert_close(logits, arch["logits"], atol=1e-4, rtol=0)
