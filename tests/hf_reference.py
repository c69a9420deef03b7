"""transformers references for tiny checkpoints, and the `skill` commands the parity tests run."""

import json
import subprocess
from pathlib import Path

import torch
import yaml
from skill_process import skill, skill_json
from tiny_checkpoint import PARITY_PROMPTS, make_tokenizer, pick_seed, tiny_config
from transformers import AutoModelForCausalLM, AutoTokenizer

NEW_TOKENS = 16


def build_reference(model_type: str, tmp_path_factory, edit=None, **overrides) -> dict:
    """A tiny checkpoint of the architecture (its config's fields overridden) with a clear greedy margin, and
    transformers' reference; ``edit(model)`` changes its weights first (and they are saved)."""
    ckpt = tmp_path_factory.mktemp(model_type)
    config = tiny_config(model_type, **overrides)
    tok = make_tokenizer(ckpt, config.vocab_size)
    ids = [tok(p)["input_ids"] for p in PARITY_PROMPTS]
    pick_seed(config, ckpt, ids)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    if edit is not None:
        with torch.no_grad():
            edit(model)
        model.save_pretrained(ckpt)
    tok = AutoTokenizer.from_pretrained(ckpt)
    with torch.no_grad():
        tokens = [
            model.generate(
                torch.tensor([x]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id
            )[0, len(x) :].tolist()
            for x in ids
        ]
        logits = torch.stack([model(torch.tensor([x])).logits[0, -1] for x in ids])
    return {"name": model_type, "ckpt": ckpt, "ids": ids, "tokens": tokens, "logits": logits}


def migrate(arch, out: Path, *flags: str) -> Path:
    return Path(skill_json("migrate", arch["ckpt"], "-o", out, "--no-run", "--json", *flags)["model_dir"])


def prompts_args() -> list[str]:
    return [a for p in PARITY_PROMPTS for a in ("--prompt", p)]


def run_json(cmd: list[str]) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def parallel_yaml(path: Path, world: int, attn: int, dense: int, embed: int, lmhead: int, **extra) -> Path:
    """A parallel_config file; `extra` adds keys such as moe_tp_size."""
    sizes = {
        "world_size": world,
        "attn_tp_size": attn,
        "dense_tp_size": dense,
        "embed_tp_size": embed,
        "lmhead_tp_size": lmhead,
    }
    path.write_text(yaml.safe_dump({"parallel_config": {**sizes, **extra}}))
    return path


def parallelize(model_dir: Path, config: Path, *flags: str) -> subprocess.CompletedProcess:
    """`skill parallelize` without its verification run: callers compare the runs themselves."""
    return skill("parallelize", model_dir, "--config", config, "--no-verify", *flags)
