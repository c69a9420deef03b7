"""Running a model directory, collecting its baseline, and diagnosing a failing run (seed scenarios B / C)."""

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import yaml
from transformers import AutoConfig, PretrainedConfig

from runtime.errors import UserError
from skills.atomic_write import write_text_atomic
from skills.baseline import collect_baseline
from skills.migrator.memory import available_memory, estimate_memory, fits
from skills.migrator.render import RenderContext, render_artifacts

MAX_ROUNDS = 5


@dataclass(frozen=True)
class Issue:
    symptom: str  # regex over the run's output
    cause: str
    fix: str
    auto_fix: Callable[[dict], bool] | None = None  # edits the YAML dict; False when it cannot help


def _double(section: str, key: str, default: int) -> Callable[[dict], bool]:
    def fix(doc: dict) -> bool:
        sec = doc.setdefault(section, {})
        sec[key] = 2 * (sec.get(key) or default)
        return True

    return fix


def _halve_batch(doc: dict) -> bool:
    sc = doc.setdefault("scheduler_config", {})
    if sc.get("batch_size", 1) <= 1:
        return False
    sc["batch_size"] = max(1, sc["batch_size"] // 2)
    return True


COMMON_ISSUES = [
    Issue(
        r"no config\.json in|checkpoint directory .* does not exist|no \*\.safetensors",
        "model_config.model_path does not point at the checkpoint",
        "set model_path to the checkpoint directory",
    ),
    Issue(
        r"needs KV space for \d+ tokens",
        "the paged KV pool is smaller than one request",
        "raise scheduler_config.num_kv_blocks",
        _double("scheduler_config", "num_kv_blocks", 64),
    ),
    Issue(
        r"legacy KV cache rows hold",
        "prompt + new tokens exceed the legacy cache rows",
        "raise data_config.input_truncated_len",
        _double("data_config", "input_truncated_len", 256),
    ),
    Issue(
        r"out of memory|can't allocate memory|DefaultCPUAllocator",
        "the device ran out of memory",
        "lower scheduler_config.batch_size (or parallelize over more cards)",
        _halve_batch,
    ),
    Issue(
        r"importing .* failed|SyntaxError|ImportError|ModuleNotFoundError",
        "the model code does not import",
        "re-run `skill migrate --force` to regenerate models/",
    ),
    Issue(
        r"has no weights for|matches no parameter",
        "checkpoint and model code disagree",
        "point model_path at the checkpoint this model was migrated from",
    ),
    Issue(
        r"unknown key|is not one of|must divide|is not divisible",
        "the YAML is invalid",
        "fix the key named in the message",
    ),
    Issue(
        r"no (model-infer-skills )?`skill`",
        "the runtime is not installed where infer.sh looks",
        "set SKILL=/path/to/skill",
    ),
]


def diagnose(output: str) -> Issue | None:
    return next((i for i in COMMON_ISSUES if re.search(i.symptom, output)), None)


def _yaml_of(model_dir: Path, name: str) -> Path:
    return model_dir / "config" / f"{name}.yaml"


def _hf_config(doc: dict) -> PretrainedConfig:
    path = doc["model_config"]["model_path"]
    if doc["model_config"].get("custom_params", {}).get("remote_code"):
        return PretrainedConfig.from_json_file(str(Path(path) / "config.json"))
    return AutoConfig.from_pretrained(path)


def _fits(doc: dict) -> tuple[bool, int]:
    """Whether the YAML's run fits this device, and the smallest power-of-two card count that would."""
    dtype = getattr(torch, doc["model_config"]["dtype"])
    sc, dc = doc["scheduler_config"], doc["data_config"]
    seq_len = dc["input_truncated_len"] + sc["max_new_tokens"]
    checkpoint = Path(doc["model_config"]["model_path"])
    est = estimate_memory(_hf_config(doc), dtype, sc["batch_size"], seq_len, checkpoint)
    avail = available_memory(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    cards = 1
    while est.param_bytes / cards + est.kv_bytes / cards > 0.9 * avail and cards < 1024:
        cards *= 2
    return fits(est, avail), cards


def _run(model_dir: Path) -> tuple[bool, str]:
    from skills.migrator.pipeline import run_infer_sh

    proc = run_infer_sh(model_dir)
    return proc.returncode == 0, proc.stdout + proc.stderr


def _baseline(model_dir: Path, name: str, source: str) -> dict:
    return collect_baseline(
        model_dir / "logs",
        model_dir / "agentic" / "baseline" / "baseline_metadata.json",
        _yaml_of(model_dir, name),
        model_source=source,
    )


def _readme_baseline(data: dict) -> dict:
    perf = data["performance"]
    env = data["environment"]
    return {
        "prefill_ms": perf["prefill_ms"],
        "decode_avg_ms": perf["decode_avg_ms"],
        "output_text": perf["output_text"],
        "device": f"{env.get('device_model') or env.get('npu_model')} x {env.get('num_cards')}",
    }


def collect_run(model_dir: Path, name: str, ctx: RenderContext, source: str, log) -> dict:
    """Run a freshly written model dir (or take the OOM path), then record the baseline."""
    doc = yaml.safe_load(_yaml_of(model_dir, name).read_text())
    ok, cards = _fits(doc)
    if not ok:
        _write_multi_card(model_dir, name, ctx, cards)
        log(f"does not fit this device: placeholder {cards}-card YAML written, baseline left empty")
        return {
            "status": "needs_multi_card",
            "notes": [f"needs {cards} cards: run `skill parallelize` first"],
        }
    log("running infer.sh")
    ok, output = _run(model_dir)
    if not ok:
        issue = diagnose(output)
        hint = f"{issue.cause}; {issue.fix}" if issue else "see logs/log_0.log"
        raise UserError(
            f"the converted model's first run (`bash infer.sh`) failed ({hint}); nothing was written. "
            f"Use --no-run to inspect the files. Last output: {output.strip()[-400:]}"
        )
    data = _baseline(model_dir, name, source)
    readme = render_artifacts(_with_baseline(ctx, data))["README.md"]
    write_text_atomic(model_dir / "README.md", readme)
    return {"status": "ok", "baseline": data}


def _with_baseline(ctx: RenderContext, data: dict) -> RenderContext:
    return replace(ctx, baseline=_readme_baseline(data))


def _write_multi_card(model_dir: Path, name: str, ctx: RenderContext, cards: int) -> None:
    yaml_name = f"{name}_rank_{cards}_{cards}tp"
    files = render_artifacts(
        replace(
            ctx,
            world_size=cards,
            needs_multi_card=True,
            yaml_name=yaml_name,
            batch_size=max(ctx.batch_size, cards),
        )
    )
    _yaml_of(model_dir, name).unlink()  # the single-card YAML cannot run here
    for rel in (f"config/{yaml_name}.yaml", "infer.sh", "README.md"):
        write_text_atomic(model_dir / rel, files[rel])


def baseline_or_doctor(model_dir: Path, name: str, mode: str, source: str, log):
    """infer.sh exists: run it; success -> scenario C (baseline only), failure -> scenario B (diagnose, fix)."""
    from skills.migrator.pipeline import MigrateResult

    notes = []
    ok, output = _run(model_dir)
    scenario = "C" if ok else "B"
    for round_ in range(1, MAX_ROUNDS + 1):
        if ok:
            break
        issue = diagnose(output)
        if issue is None or issue.auto_fix is None:
            raise UserError(
                f"`bash {model_dir}/infer.sh` fails (scenario B) after {round_ - 1} automatic fix(es): "
                + (f"{issue.cause}; fix: {issue.fix}." if issue else "no known cause matched.")
                + f" Last output: {output.strip()[-400:]}"
            )
        yaml_path = _yaml_of(model_dir, name)
        doc = yaml.safe_load(yaml_path.read_text())
        if not issue.auto_fix(doc):
            raise UserError(
                f"`bash infer.sh` fails: {issue.cause}; the automatic fix cannot help further, "
                f"{issue.fix} by hand."
            )
        write_text_atomic(yaml_path, yaml.safe_dump(doc, sort_keys=False))
        notes.append(f"round {round_}: {issue.cause} -> {issue.fix}")
        log(notes[-1])
        ok, output = _run(model_dir)
    if not ok:
        raise UserError(f"`bash infer.sh` still fails after {MAX_ROUNDS} rounds: {output.strip()[-400:]}")
    data = _baseline(model_dir, name, source)
    return MigrateResult(model_dir, name, mode, scenario, "ok", [], data, notes)
