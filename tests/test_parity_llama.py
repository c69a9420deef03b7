"""The runtime reproduces transformers on the same weights: greedy tokens and prefill logits (fp32)."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from hf_reference import prompts_args
from model_dirs import make_model_dir, prefill_logits
from skill_process import skill
from tiny_checkpoint import PARITY_PROMPTS
from transformers import AutoModelForCausalLM, AutoTokenizer

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = [tok(p)["input_ids"] for p in PARITY_PROMPTS]
    with torch.no_grad():
        tokens = [
            model.generate(
                torch.tensor([x]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id
            )[0, len(x) :].tolist()
            for x in ids
        ]
        logits = [model(torch.tensor([x])).logits[0, -1] for x in ids]
    return {"ids": ids, "tokens": tokens, "logits": torch.stack(logits)}


def skill_run(model_dir: Path, *args: str) -> subprocess.CompletedProcess:
    proc = skill("run", model_dir, "--json", "--raw", "--max-new-tokens", NEW_TOKENS, *args, *prompts_args())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("kv_layout", ["paged", "legacy"])
def test_skill_run_matches_transformers_generate(tmp_path, tiny_llama_dir, reference, kv_layout):
    out = json.loads(skill_run(make_model_dir(tmp_path, tiny_llama_dir, kv_layout=kv_layout)).stdout)
    assert [o["prompt_token_ids"] for o in out["outputs"]] == reference["ids"]
    assert [o["token_ids"] for o in out["outputs"]] == reference["tokens"]
    assert out["prefill_ms"] > 0 and out["decode_avg_ms"] > 0
    kv = out["kv_cache"]
    assert kv["layout"] == kv_layout
    if kv_layout == "paged":  # sized for 4 requests of 64 + 16 tokens in blocks of 8; taken as requests grow
        assert kv["num_blocks"] == 4 * 10
        assert 0 < kv["peak_used_blocks"] <= sum(-(-(len(x) + NEW_TOKENS) // 8) for x in reference["ids"])
    else:
        assert (kv["num_blocks"], kv["peak_used_blocks"]) == (4, 4)


@pytest.mark.parametrize("kv_layout", ["paged", "legacy"])
def test_prefill_logits_match_transformers(tmp_path, tiny_llama_dir, reference, kv_layout):
    logits = prefill_logits(make_model_dir(tmp_path, tiny_llama_dir, kv_layout=kv_layout), reference["ids"])
    torch.testing.assert_close(logits, reference["logits"], atol=1e-4, rtol=0)


def test_small_kv_pool_preempts_and_still_matches(tmp_path, tiny_llama_dir, reference):
    """Too few blocks for all four requests: the scheduler preempts and recomputes instead of crashing."""
    model_dir = make_model_dir(tmp_path, tiny_llama_dir, num_kv_blocks=20, block_size=4)
    proc = skill_run(model_dir)
    assert "preempted request" in proc.stderr
    assert [o["token_ids"] for o in json.loads(proc.stdout)["outputs"]] == reference["tokens"]
