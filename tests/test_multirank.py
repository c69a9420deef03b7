"""Multi-rank runs: `skill run` relaunches itself under torchrun (gloo) and attention-DP ranks split the
requests; the tokens equal the single-rank run and transformers."""
import json
import subprocess
import sys

import yaml
from model_dirs import make_model_dir
from tiny_checkpoint import PARITY_PROMPTS


def run_tokens(model_dir, yaml_path) -> list[list[int]]:
    cmd = [sys.executable, "-m", "skills.cli", "run", str(model_dir), "--yaml", str(yaml_path), "--json", "--raw",
           "--max-new-tokens", "16", *[a for p in PARITY_PROMPTS for a in ("--prompt", p)]]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [o["token_ids"] for o in json.loads(proc.stdout)["outputs"]]


def test_data_parallel_world_2_matches_single_rank(tmp_path, tiny_llama_dir):
    model_dir = make_model_dir(tmp_path, tiny_llama_dir)
    single = model_dir / "config" / "contract_llama.yaml"
    doc = yaml.safe_load(single.read_text())
    doc["world_size"] = 2
    doc["parallel_config"] = {"world_size": 2}  # attn_tp 1 -> attn_dp 2: requests split over the ranks
    dp2 = model_dir / "config" / "dp2.yaml"
    dp2.write_text(yaml.safe_dump(doc))
    assert run_tokens(model_dir, dp2) == run_tokens(model_dir, single)
