"""`skill convert-weights` on a tiny llama parallelized for 2 ranks: the output's layout and binding, shards that
refuse any other parallel config, refusals (invalid config, existing OUT, unparallelized model) that write nothing.
Runs of the shards are compared with transformers in test_parallelize_parity."""

import json
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from hf_reference import NEW_TOKENS, build_reference, migrate, prompts_args
from safetensors.torch import load_file, save_file
from skill_process import skill, skill_json

from runtime.config import InferenceConfig, ParallelConfig
from runtime.engine.loader import load_checkpoint
from runtime.engine.model_worker import ModelWorker
from runtime.errors import UserError
from skills.parallel_impl.convert_weights import _build_rank, _save_rank

TP2 = {"world_size": 2, "attn_tp_size": 2, "dense_tp_size": 2, "embed_tp_size": 2, "lmhead_tp_size": 2}


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def parallel_yaml(path: Path, **sizes: int) -> Path:
    path.write_text(yaml.safe_dump({"parallel_config": sizes}))
    return path


def run_offline(model_dir: Path, yaml_path: Path) -> subprocess.CompletedProcess:
    return skill(
        "run",
        model_dir,
        "--yaml",
        yaml_path,
        "--json",
        "--raw",
        "--max-new-tokens",
        NEW_TOKENS,
        *prompts_args(),
    )


def listing(*folders: Path) -> set[str]:
    return {str(p) for folder in folders for p in folder.rglob("*")}


@pytest.fixture(scope="module")
def conv(tmp_path_factory):
    reference = build_reference("llama", tmp_path_factory)
    root = tmp_path_factory.mktemp("convert")
    model_dir = migrate(reference, root / "models")
    single = shutil.copytree(model_dir, root / "single" / model_dir.name)
    # single-rank code, as `skill migrate --no-fuse` writes it
    for code in (single / "agentic" / "migrated_models").glob("*.py"):
        shutil.copy(code, single / "models" / code.name)
    config = parallel_yaml(root / "tp2.yaml", **TP2)
    ok(skill("parallelize", model_dir, "--config", config))
    out = root / "shards"
    done = skill_json("convert-weights", model_dir, "--config", config, "-o", out, "--json")
    return SimpleNamespace(
        reference=reference,
        root=root,
        model_dir=model_dir,
        single=single,
        config=config,
        out=out,
        done=done,
        yaml=Path(done["yaml"]),
    )


def test_offline_layout_and_binding(conv):
    """(Running the shards against transformers is in test_parallelize_parity, for three architectures.)"""
    assert conv.done["world_size"] == 2 and conv.done["out"] == str(conv.out.resolve())
    assert conv.yaml == conv.model_dir / "config" / "llama_rank_2_2tp_offline.yaml"
    assert yaml.safe_load(conv.yaml.read_text())["model_config"]["model_path"] == str(conv.out.resolve())
    files = {str(p.relative_to(conv.out)) for p in conv.out.rglob("*") if p.is_file()}
    assert {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "parallel_config.json",
        "rank_0/model.safetensors",
        "rank_1/model.safetensors",
    } <= files
    assert not [f for f in files if f.endswith(".safetensors") and "/" not in f]  # no unsharded weights
    meta = json.loads((conv.out / "parallel_config.json").read_text())
    ckpt = Path(conv.reference["ckpt"]).resolve()
    assert meta["parallel_config"] == ParallelConfig(**TP2).model_dump()
    assert meta["entry_class"] == "LlamaForCausalLM" and meta["source"] == str(ckpt)
    assert meta["source_fingerprint"] == {"model.safetensors": (ckpt / "model.safetensors").stat().st_size}
    for rank, size in enumerate(conv.done["ranks"]):
        shard = load_file(conv.out / f"rank_{rank}" / "model.safetensors")
        assert sum(t.numel() * t.element_size() for t in shard.values()) == size


def test_shards_refuse_another_parallel_config(conv, tmp_path):
    doc = yaml.safe_load(conv.yaml.read_text())
    doc["parallel_config"]["attn_tp_size"] = 1  # W=2: attention DP 2, the rest TP 2
    edited = tmp_path / "dp2.yaml"
    edited.write_text(yaml.safe_dump(doc))
    proc = run_offline(conv.model_dir, edited)
    assert proc.returncode != 0
    assert "holds weights converted for parallel_config {world_size: 2, attn_tp_size: 2," in proc.stderr
    assert "this run's parallel_config is {world_size: 2, attn_tp_size: 1," in proc.stderr
    assert (
        "skill convert-weights" in proc.stderr and str(Path(conv.reference["ckpt"]).resolve()) in proc.stderr
    )


def test_invalid_config_exits_2_and_writes_nothing(conv, tmp_path):
    before = listing(conv.root, conv.model_dir)
    bad = parallel_yaml(tmp_path / "bad.yaml", world_size=2, attn_tp_size=3)
    proc = skill("convert-weights", conv.model_dir, "--config", bad, "-o", conv.root / "bad_out")
    assert proc.returncode == 2, proc.stderr
    assert "attn_tp_size" in proc.stderr and listing(conv.root, conv.model_dir) == before


def test_existing_out_or_yaml_is_refused_without_force(conv):
    before = listing(conv.root, conv.model_dir)
    proc = skill("convert-weights", conv.model_dir, "--config", conv.config, "-o", conv.out)
    assert proc.returncode == 1 and "already exists; pass --force" in proc.stderr
    # same config into another OUT: its offline YAML would point elsewhere
    proc = skill("convert-weights", conv.model_dir, "--config", conv.config, "-o", conv.root / "other")
    assert proc.returncode == 1 and "differs from the YAML for this conversion" in proc.stderr
    assert listing(conv.root, conv.model_dir) == before

    (conv.out / "stale").write_text("from an older conversion")
    proc = ok(skill("convert-weights", conv.model_dir, "--config", conv.config, "-o", conv.out, "--force"))
    assert proc.stdout.strip() == str(conv.yaml)
    assert not (conv.out / "stale").exists() and (conv.out / "rank_1" / "model.safetensors").is_file()
    assert sorted(p.name for p in conv.root.iterdir() if p.name.startswith(".")) == []  # no staging left


def test_single_rank_code_is_refused(conv):
    proc = skill("convert-weights", conv.single, "--config", conv.config, "-o", conv.root / "single_out")
    assert proc.returncode == 1
    assert f"run `skill parallelize {conv.single} --config {conv.config}` first" in proc.stderr.replace(
        "\n", ""
    )
    assert not (conv.root / "single_out").exists()


def _model_parts(conv) -> tuple[type[torch.nn.Module], object, InferenceConfig]:
    """The offline YAML's model class, HF config and config, as convert-weights builds its ranks from."""
    config = InferenceConfig.from_yaml(conv.yaml)
    worker = ModelWorker(config, None, conv.model_dir)
    model_cls, config_cls = worker.resolve_classes()
    return model_cls, worker._load_hf_config(config_cls), config


def test_loader_checks_rank_dir_names_and_shapes(conv, tmp_path):
    model_cls, hf_config, config = _model_parts(conv)
    model, pc = _build_rank(model_cls, hf_config, config, 1), config.parallel_config
    load_checkpoint(model, conv.out, pc, 1)
    shard = load_file(conv.out / "rank_1" / "model.safetensors")
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, shard[name], atol=0, rtol=0)

    broken = shutil.copytree(conv.out, tmp_path / "broken")
    file = broken / "rank_1" / "model.safetensors"
    save_file({k: v for k, v in shard.items() if k != "model.norm.weight"}, file)
    with pytest.raises(UserError, match=r"has no weights for \['model.norm.weight'\]"):
        load_checkpoint(model, broken, pc, 1)
    save_file({**shard, "model.norm.weight": torch.zeros(3)}, file)
    with pytest.raises(
        UserError, match=r"'model.norm.weight' of shape \[3\], but LlamaForCausalLM has it as"
    ):
        load_checkpoint(model, broken, pc, 1)
    shutil.rmtree(broken / "rank_1")
    with pytest.raises(UserError, match=r"rank_1/model.safetensors does not exist"):
        load_checkpoint(model, broken, pc, 1)


def test_tied_parameters_are_saved_once(conv, tmp_path):
    model_cls, hf_config, config = _model_parts(conv)
    hf_config.tie_word_embeddings = True
    _save_rank(
        _build_rank(model_cls, hf_config, config, 0), Path(conv.reference["ckpt"]), tmp_path / "rank_0"
    )
    saved = load_file(tmp_path / "rank_0" / "model.safetensors")
    assert "lm_head.weight" not in saved and "model.embed_tokens.weight" in saved
