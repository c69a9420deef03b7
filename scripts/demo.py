"""The README's main job: export the shipped SmolLM2-135M-Instruct, then run it on the runtime.

Until `skill migrate` exists the model code is the hand-written Llama contract model from
tests/fixtures; the weights, tokenizer and chat template are the real SmolLM2 ones.
"""
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from export_smollm2 import default_export_dir, export

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / "models" / "smollm2_135m_instruct"
PROMPT = "What is the capital of France?"


def write_model_dir(checkpoint: Path) -> None:
    shutil.copytree(REPO / "tests" / "fixtures" / "contract_llama" / "models", MODEL_DIR / "models",
                    dirs_exist_ok=True)
    config = {
        "model_name": MODEL_DIR.name,
        "world_size": 1,
        "model_config": {"model_name": MODEL_DIR.name, "model_path": str(checkpoint), "dtype": "float32"},
        "data_config": {"dataset": "default", "input_truncated_len": 256},
        "parallel_config": {"world_size": 1},
        "scheduler_config": {"batch_size": 4, "max_new_tokens": 48, "block_size": 16},
    }
    (MODEL_DIR / "config").mkdir(parents=True, exist_ok=True)
    (MODEL_DIR / "config" / f"{MODEL_DIR.name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def main() -> int:
    checkpoint = export(default_export_dir())
    write_model_dir(checkpoint)
    skill = Path(sys.executable).with_name("skill")
    return subprocess.call([str(skill), "run", str(MODEL_DIR), "--prompt", PROMPT])


if __name__ == "__main__":
    sys.exit(main())
