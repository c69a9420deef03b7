"""`skill parallelize` as a command: invalid configs stop before anything changes, --plan writes nothing, the
parallel code `skill migrate` wrote is kept, a second config starts from the per-tensor code, hand edits are kept
without --force, standalone mode runs under torchrun."""

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import safetensors.torch
import yaml
from hf_reference import NEW_TOKENS, build_reference, migrate, prompts_args, run_json
from skill_process import skill as run_skill

from runtime.config import ParallelConfig
from runtime.errors import ConfigError
from skills.parallel_impl.pipeline import check_token_layout

TP2 = {"world_size": 2, "attn_tp_size": 2, "dense_tp_size": 2, "embed_tp_size": 2, "lmhead_tp_size": 2}


def skill(*args: str) -> subprocess.CompletedProcess:
    """`skill parallelize` without its verification run (tests/test_verify.py covers that)."""
    flags = ("--no-verify",) if args[0] == "parallelize" else ()
    return run_skill(*args, *flags)


def config_file(tmp_path: Path, doc: dict, name: str = "parallel.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


def snapshot(model_dir: Path) -> dict[str, str]:
    return {
        str(p.relative_to(model_dir)): hashlib.sha1(p.read_bytes()).hexdigest()
        for p in sorted(model_dir.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return build_reference("llama", tmp_path_factory)


@pytest.fixture(scope="module")
def migrated_once(reference, tmp_path_factory):
    return migrate(reference, tmp_path_factory.mktemp("models"))


@pytest.fixture
def model_dir(migrated_once, tmp_path):
    """A fresh copy of the migrated directory: tests parallelize and edit it."""
    return Path(shutil.copytree(migrated_once, tmp_path / migrated_once.name))


@pytest.mark.parametrize(
    "doc, fragments",
    [
        (
            {
                "parallel_config": {
                    **TP2,
                    "world_size": 8,
                    "attn_tp_size": 8,
                    "dense_tp_size": 8,
                    "embed_tp_size": 8,
                    "lmhead_tp_size": 8,
                }
            },
            [
                "parallel_config.attn_tp_size is 8",
                "num_attention_heads 4 is not divisible",
                "values for world_size 8",
            ],
        ),
        (
            {"parallel_config": {**TP2, "embed_tp_size": 1}},
            ["parallel_config.embed_tp_size is 1", "multiple of attn_tp_size 2"],
        ),
        (
            {"world_size": 2, "parallel_config": {**TP2, "world_size": 4}},
            ["`world_size` is 2 but `parallel_config.world_size` is 4"],
        ),
    ],
)
def test_invalid_config_exits_2_and_changes_nothing(model_dir, tmp_path, doc, fragments):
    before = snapshot(model_dir)
    proc = skill("parallelize", str(model_dir), "--config", str(config_file(tmp_path, doc)))
    assert proc.returncode == 2, proc.stderr
    message = " ".join(proc.stderr.split())
    for fragment in fragments:
        assert fragment in message
    assert "Traceback" not in proc.stderr
    assert snapshot(model_dir) == before


def test_plan_json_writes_nothing(model_dir, tmp_path):
    before = snapshot(model_dir)
    proc = skill(
        "parallelize",
        str(model_dir),
        "--config",
        str(config_file(tmp_path, {"parallel_config": TP2})),
        "--plan",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["world_size"] == 2 and plan["per_rank_param_bytes"] < plan["total_param_bytes"]
    assert {g["name"] for g in plan["groups"]} == {
        "attn_tp_group",
        "dense_tp_group",
        "embed_tp_group",
        "lmhead_tp_group",
    }
    assert snapshot(model_dir) == before


def test_migrate_writes_the_parallel_code_which_parallelize_keeps(model_dir, tmp_path):
    pristine = model_dir / "agentic" / "migrated_models" / "modeling_llama.py"
    migrated, fused = pristine.read_text(), (model_dir / "models" / "modeling_llama.py").read_text()
    assert "QKVParallelLinear" in fused and "MergedColumnParallelLinear" in fused
    assert "nn.Linear(" in migrated and "ParallelLinear" not in migrated
    proc = skill(
        "parallelize", str(model_dir), "--config", str(config_file(tmp_path, {"parallel_config": TP2}))
    )
    assert proc.returncode == 0, proc.stderr
    assert pristine.read_text() == migrated
    assert (model_dir / "models" / "modeling_llama.py").read_text() == fused


def test_second_config_starts_from_migrated_code_and_edits_need_force(reference, tmp_path):
    model_dir = migrate(reference, tmp_path / "models", "--no-fuse")
    migrated = (model_dir / "models" / "modeling_llama.py").read_text()
    assert "ParallelLinear" not in migrated and not (model_dir / "agentic" / "migrated_models").exists()
    first = json.loads(
        skill(
            "parallelize",
            str(model_dir),
            "--config",
            str(config_file(tmp_path, {"parallel_config": TP2})),
            "--json",
        ).stdout
    )
    assert set(first) >= {"model_dir", "yaml", "world_size", "groups", "rewrites"}
    assert Path(first["yaml"]).name == "llama_rank_2_2tp.yaml"
    assert (model_dir / "agentic" / "migrated_models" / "modeling_llama.py").read_text() == migrated
    parallel = (model_dir / "models" / "modeling_llama.py").read_text()
    assert (
        "QKVParallelLinear" in parallel
        and f"config/{Path(first['yaml']).name}" in (model_dir / "infer.sh").read_text()
    )

    dp = config_file(
        tmp_path,
        {"world_size": 2, "attn_tp_size": 1, "dense_tp_size": 2, "embed_tp_size": 2, "lmhead_tp_size": 2},
        "dp.yaml",
    )
    second = json.loads(skill("parallelize", str(model_dir), "--config", str(dp), "--json").stdout)
    assert Path(second["yaml"]).name == "llama_rank_2_1tp_2dp_densetp2_embedtp2_lmheadtp2.yaml"
    assert Path(first["yaml"]).is_file()  # each scenario keeps its YAML
    assert (model_dir / "models" / "modeling_llama.py").read_text() == parallel  # same code for every config

    (model_dir / "models" / "modeling_llama.py").write_text(parallel + "# my edit\n")
    proc = skill("parallelize", str(model_dir), "--config", str(dp))
    assert proc.returncode == 1 and "--force" in proc.stderr
    assert (model_dir / "models" / "modeling_llama.py").read_text().endswith("# my edit\n")
    assert skill("parallelize", str(model_dir), "--config", str(dp), "--force").returncode == 0
    assert (model_dir / "models" / "modeling_llama.py").read_text() == parallel


def test_mode_must_match_the_directory(model_dir, tmp_path):
    proc = skill(
        "parallelize",
        str(model_dir),
        "--config",
        str(config_file(tmp_path, {"parallel_config": TP2})),
        "--mode",
        "standalone",
    )
    assert proc.returncode == 1 and "framework mode" in proc.stderr


def test_standalone_tp2_matches_transformers(reference, tmp_path):
    model_dir = migrate(reference, tmp_path / "models", "--mode", "standalone")
    proc = skill(
        "parallelize", str(model_dir), "--config", str(config_file(tmp_path, {"parallel_config": TP2}))
    )
    assert proc.returncode == 0, proc.stderr
    assert shutil.which("bash")
    out = run_json(
        [
            "bash",
            str(model_dir / "infer.sh"),
            "--json",
            "--raw",
            "--max_new_tokens",
            str(NEW_TOKENS),
            *prompts_args(),
        ]
    )  # infer.sh now points at the TP2 YAML: torchrun, 2 ranks, rank 0 prints
    assert [o["token_ids"] for o in out["outputs"]] == reference["tokens"]


def test_bfloat16_model_shards_check_in_its_dtype(reference, tmp_path):
    model_dir = migrate(reference, tmp_path / "models", "--dtype", "bfloat16")
    proc = skill(
        "parallelize",
        str(model_dir),
        "--config",
        str(config_file(tmp_path, {"parallel_config": TP2})),
        "--json",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    done = json.loads(proc.stdout)
    assert done["total_param_bytes"] == 2 * sum(
        t.numel() for t in safetensors.torch.load_file(reference["ckpt"] / "model.safetensors").values()
    )


def test_attention_dp_of_a_model_with_states_tokens_first_is_refused_naming_both_layouts():
    """ChatGLM keeps its states [tokens, batch, hidden]: attention DP's token split would cut the batch axis."""
    tokens_first = {
        "modeling_glm.py": "hidden_states = hidden_states[forward_metadata.last_token_indices, 0]"
    }
    batch_first = {"modeling_glm.py": "hidden_states = hidden_states[0, forward_metadata.last_token_indices]"}
    dp = ParallelConfig(**{**TP2, "attn_tp_size": 1})  # attention DP 2
    with pytest.raises(ConfigError, match=r"keeps its states \[tokens, batch, hidden\]"):
        check_token_layout(dp, tokens_first)
    check_token_layout(dp, batch_first)
    check_token_layout(ParallelConfig(**TP2), tokens_first)  # TP alone keeps every token on every rank


def test_an_error_naming_brackets_prints_them_as_written(tmp_path):
    proc = skill("parallelize", str(tmp_path / "model[1]"), "--config", str(tmp_path / "tp[2].yaml"))
    assert proc.returncode == 2 and "tp[2].yaml" in proc.stderr  # not read as console markup
