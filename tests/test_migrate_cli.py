"""`skill migrate` behaviour around the conversion: idempotent --force, scenarios B / C, the OOM path,
and bad input that fails cleanly without leaving anything behind."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file, save_file
from skill_process import skill as run_skill


def skill(*args: str, env: dict | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    return run_skill(*args, env={**os.environ, **(env or {})}, input=stdin)


def migrate_json(*args: str, env: dict | None = None) -> dict:
    proc = skill("migrate", *args, "--json", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def assert_clean_failure(proc: subprocess.CompletedProcess, out: Path, *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())  # nothing half-written


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_force_rewrite_is_byte_identical(tiny_llama_dir, tmp_path):
    uncached = {"SKILL_CODEGEN_CACHE": ""}  # the rules themselves run twice
    first = Path(
        migrate_json(str(tiny_llama_dir), "-o", str(tmp_path / "a"), "--no-run", env=uncached)["model_dir"]
    )
    before = tree(first)
    migrate_json(str(tiny_llama_dir), "-o", str(tmp_path / "a"), "--no-run", "--force", env=uncached)
    assert tree(first) == before
    proc = skill("migrate", str(tiny_llama_dir), "-o", str(tmp_path / "a"), "--no-run")  # no --force: refused
    assert proc.returncode != 0 and "--force" in proc.stderr
    assert "rules applied" not in proc.stderr  # refused before any conversion work


def test_existing_model_dir_scenarios_c_and_b(tiny_llama_dir, tmp_path):
    result = migrate_json(
        str(tiny_llama_dir), "-o", str(tmp_path), "--prompt", "The capital of", "--max-new-tokens", "4"
    )
    assert result["scenario"] == "A" and result["baseline"]["verification"]["all_ranks_success"]
    metadata = json.loads(
        (Path(result["model_dir"]) / "agentic" / "baseline" / "baseline_metadata.json").read_text()
    )
    assert metadata["verification"]["identical"] is True and metadata["verification"]["all_ranks_success"]
    assert metadata["verification"]["prompts"] == ["The capital of"] and result["verification"]["identical"]
    again = migrate_json(str(tiny_llama_dir), "-o", str(tmp_path), "--prompt", "Paris is")
    assert again["scenario"] == "C" and again["baseline"]["performance"]["output_text"]
    assert again["verification"]["identical"] and again["verification"]["prompts"] == ["Paris is"]
    yaml_path = Path(result["model_dir"]) / "config" / "llama.yaml"
    doc = yaml.safe_load(yaml_path.read_text())
    doc["scheduler_config"].update(num_kv_blocks=2, block_size=4)  # too small for one request
    yaml_path.write_text(yaml.safe_dump(doc))
    fixed = migrate_json(str(tiny_llama_dir), "-o", str(tmp_path), "--no-verify")
    assert fixed["scenario"] == "B" and fixed["status"] == "ok" and fixed["verification"] is None
    assert any("num_kv_blocks" in n for n in fixed["notes"])


def test_oom_path_writes_multi_card_placeholder(tiny_llama_dir, tmp_path):
    proc = skill(
        "migrate",
        str(tiny_llama_dir),
        "-o",
        str(tmp_path),
        "--json",
        env={"SKILL_MEMORY_LIMIT_BYTES": "100000"},
    )
    assert proc.returncode == 3, proc.stderr
    result = json.loads(proc.stdout)
    model_dir = Path(result["model_dir"])
    assert result["status"] == "needs_multi_card"
    yamls = [p.name for p in (model_dir / "config").glob("*.yaml")]
    assert len(yamls) == 1 and yamls[0].startswith("llama_rank_") and yamls[0].endswith("tp.yaml")
    assert not any((model_dir / "agentic" / "baseline").iterdir())
    assert "multi-card" in (model_dir / "README.md").read_text().lower()


def test_unknown_architecture(tiny_llama_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_llama_dir, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config.update(model_type="not_a_real_arch", architectures=["NotARealForCausalLM"])
    (ckpt / "config.json").write_text(json.dumps(config))
    assert_clean_failure(
        skill("migrate", str(ckpt), "-o", str(tmp_path / "out")), tmp_path / "out", "not_a_real_arch"
    )


def test_quantized_checkpoint_is_refused_naming_its_format(tiny_llama_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_llama_dir, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (ckpt / "config.json").write_text(json.dumps(config))
    assert_clean_failure(
        skill("migrate", str(ckpt), "-o", str(tmp_path / "out")),
        tmp_path / "out",
        "'gptq'",
        "compressed-tensors symmetric schemes",
        "int8_weight_only",
    )


def test_missing_config_json(tmp_path):
    (tmp_path / "ckpt").mkdir()
    assert_clean_failure(
        skill("migrate", str(tmp_path / "ckpt"), "-o", str(tmp_path / "out")), tmp_path / "out", "config.json"
    )


def test_weights_missing_for_a_parameter(tiny_llama_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_llama_dir, ckpt)
    weights = load_file(ckpt / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    assert_clean_failure(
        skill("migrate", str(ckpt), "-o", str(tmp_path / "out")), tmp_path / "out", "down_proj"
    )


def test_non_writable_out(tiny_llama_dir, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    proc = skill("migrate", str(tiny_llama_dir), "-o", str(blocker / "out"), "--no-run")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and "-o OUT" in proc.stderr
    assert "rules applied" not in proc.stderr


@pytest.mark.parametrize("prompt", ["部署模式: 混合部署", "deployment mode: hybrid"])
def test_dispatch_prompt_with_unknown_mode(tiny_llama_dir, tmp_path, prompt):
    proc = skill(
        "migrate", str(tiny_llama_dir), "-o", str(tmp_path / "out"), "--dispatch-prompt", "-", stdin=prompt
    )
    assert_clean_failure(proc, tmp_path / "out")


def test_dispatch_prompt_selects_standalone(tiny_llama_dir, tmp_path):
    prompt = tmp_path / "dispatch.txt"
    prompt.write_text("请适配该模型。\n部署模式: 独立部署\n")
    result = migrate_json(
        str(tiny_llama_dir), "-o", str(tmp_path / "out"), "--no-run", "--dispatch-prompt", str(prompt)
    )
    assert result["mode"] == "standalone" and "runner_llama.py" in result["files"]
