"""A checkpoint whose model code ships with it (`auto_map`) and that no transformers release knows: `skill migrate`
parses that code (never executes it), converts it, and, trusted, matches transformers running it."""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from tiny_checkpoint import greedy_margin, make_tokenizer

from skills.verify.verify import DEFAULT_PROMPTS

FIXTURE = Path(__file__).parent / "fixtures" / "remote_packlm"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"remote_packlm.{name}", FIXTURE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _checkpoint(out: Path) -> Path:
    """The fixture's code beside random weights with a clear greedy margin and an offline tokenizer."""
    _load("configuration_packlm")
    modeling = _load("modeling_packlm")
    config = modeling.PackLMConfig()
    config.auto_map = {
        "AutoConfig": "configuration_packlm.PackLMConfig",
        "AutoModelForCausalLM": "modeling_packlm.PackLMForCausalLM",
    }
    ids = [
        make_tokenizer(out, config.vocab_size)(p)["input_ids"] for p in DEFAULT_PROMPTS
    ]  # the prompts migrate verifies on
    for seed in range(20):
        torch.manual_seed(seed)
        model = modeling.PackLMForCausalLM(config).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.3)
        if greedy_margin(model, ids, 16) >= 0.02:
            break
    model.save_pretrained(out)
    for source in FIXTURE.glob("*.py"):
        shutil.copy(source, out / source.name)
    return out


def test_remote_code_converts_and_matches_transformers_running_it(tmp_path):
    checkpoint = _checkpoint(tmp_path / "packlm")
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "skills.cli",
            "migrate",
            str(checkpoint),
            "-o",
            str(out),
            "--trust-remote-code",
        ]
        + ["--strict", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["verification"]["status"] == "identical" and result["verification"]["tokens_compared"] == 64
    code = (Path(result["model_dir"]) / "models" / "modeling_packlm.py").read_text()
    assert "self.attn = Attention(" in code and "F.scaled_dot_product_attention(" not in code
    assert "mask =" not in code  # the hand-built mask nothing reads went with the locals only it read
