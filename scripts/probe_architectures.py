"""Migrate a tiny random checkpoint of each given model_type and compare greedy tokens with transformers.

    python scripts/probe_architectures.py phi3 olmo2 granite ...

Prints PASS / MISMATCH / MIGRATE-FAIL / RUN-FAIL / SETUP-FAIL per architecture. A dev helper for
checking that the rewrite rules stay general; the suite pins a fixed set of architectures.
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from tiny_checkpoint import PARITY_PROMPTS, make_tokenizer, pick_seed, tiny_config
from transformers import AutoModelForCausalLM

NEW_TOKENS = 8


def skill(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "skills.cli", *args], capture_output=True, text=True, check=False
    )


def probe(model_type: str) -> str:
    ckpt = Path(tempfile.mkdtemp(prefix=f"{model_type}-"))
    config = tiny_config(model_type)
    tok = make_tokenizer(ckpt, config.vocab_size)
    ids = [tok(p)["input_ids"] for p in PARITY_PROMPTS]
    try:
        pick_seed(config, ckpt, ids, max_new_tokens=NEW_TOKENS)
    except (RuntimeError, ValueError, TypeError) as e:  # no usable tiny model of this architecture
        return f"SETUP-FAIL {type(e).__name__}: {e}"
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [
            model.generate(torch.tensor([x]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[
                0, len(x) :
            ].tolist()
            for x in ids
        ]
    proc = skill("migrate", str(ckpt), "-o", tempfile.mkdtemp(), "--no-run", "--json")
    if proc.returncode:
        return "MIGRATE-FAIL " + proc.stderr.strip().replace("\n", " ")[-400:]
    model_dir = json.loads(proc.stdout)["model_dir"]
    proc = skill(
        "run",
        model_dir,
        "--json",
        "--raw",
        "--max-new-tokens",
        str(NEW_TOKENS),
        *[a for p in PARITY_PROMPTS for a in ("--prompt", p)],
    )
    if proc.returncode:
        return "RUN-FAIL " + proc.stderr.strip().replace("\n", " ")[-400:]
    got = [o["token_ids"] for o in json.loads(proc.stdout)["outputs"]]
    return "PASS" if got == ref else "MISMATCH"


if __name__ == "__main__":
    for model_type in sys.argv[1:]:
        print(model_type, probe(model_type), flush=True)
