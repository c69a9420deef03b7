"""Collect a run's performance baseline from its log(s) into baseline_metadata.json (the seed's schema)."""

from __future__ import annotations

import json
import os
import re
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import yaml
from rich.table import Table
from rich.text import Text

from runtime.config.inference_config import ModelConfig
from runtime.errors import UserError
from skills.atomic_write import write_text_atomic

# `HH:MM:SS [rankN ]LEVEL message`, as runtime.logging_config writes it
_PREFIX = re.compile(r"\d{2}:\d{2}:\d{2} (?:\[rank\d+\] )?(?P<level>[A-Z]+) ")
# a per-step time, in the runtime's style or the seed runners' style (the summary line matches neither)
_STEP = re.compile(
    r"(?:\[Main\] Inference time \((?P<new>prefill|decode)\):"
    r"|inference time cost of (?P<old>prefill|decode) is) (?P<ms>\d+(?:\.\d+)?) ms"
)
_REQUEST = re.compile(r"Request (?P<i>\d+): outputs: ?(?P<text>.*)", re.DOTALL)
_SUMMARY = re.compile(r"decode average inference time cost is")
_TRACEBACK = re.compile(r"Traceback \(most recent call last\)")
_FAILURE = re.compile(rf"{_TRACEBACK.pattern}|\bERROR\b")
_CANN_ROOT = "/usr/local/Ascend/ascend-toolkit/latest"


@dataclass
class _Log:
    prefill_ms: list[float] = field(default_factory=list)
    decode_ms: list[float] = field(default_factory=list)
    outputs: dict[int, str] = field(default_factory=dict)
    failed: bool = False  # a Traceback or an ERROR record


def _records(lines: list[str]) -> Iterator[tuple[str, str]]:
    """(level, message) per log record; lines without a prefix or a known message continue the previous one."""
    level, message = "", []
    for line in lines:
        prefix = _PREFIX.match(line)
        starts = prefix or any(p.search(line) for p in (_STEP, _REQUEST, _SUMMARY, _TRACEBACK))
        if starts and message:
            yield level, "\n".join(message)
            message = []
        if prefix:
            level, line = prefix["level"], line[prefix.end() :]
        elif starts:
            level = ""
        message.append(line)
    if message:
        yield level, "\n".join(message)


def _parse(path: Path) -> _Log:
    log = _Log()
    for level, message in _records(path.read_text(encoding="utf-8", errors="replace").splitlines()):
        if request := _REQUEST.search(message):
            log.outputs[int(request["i"])] = request["text"].rstrip("\n")
        elif step := _STEP.search(message):
            stage = step["new"] or step["old"]
            (log.prefill_ms if stage == "prefill" else log.decode_ms).append(float(step["ms"]))
        elif level == "ERROR" or _FAILURE.search(message):
            log.failed = True
    return log


def _pick_log(log_path: Path, rank: int | None) -> tuple[Path, list[Path]]:
    """The log to read performance from, and every log of the run (for the success check)."""
    if log_path.is_file():
        return log_path, [log_path]
    if not log_path.is_dir():
        raise UserError(
            f"log path {log_path} does not exist; pass the log file of a `skill run` (its stderr) "
            "or the directory holding log_<rank>.log files."
        )
    logs = sorted(log_path.glob("*.log"))
    candidates = [log_path / f"log_{rank}.log"] if rank is not None else [log_path / "log_0.log"]
    if rank is None and len(logs) == 1:
        candidates.append(logs[0])
    chosen = next((c for c in candidates if c in logs), None)
    if chosen is None:
        which = f"log_{rank}.log" if rank is not None else "log_0.log or a single *.log"
        raise UserError(
            f"{log_path} has no {which} (found {[p.name for p in logs] or 'no *.log files'}); "
            "pass the log file itself, or --rank N to pick log_N.log."
        )
    return chosen, sorted({chosen, *log_path.glob("log_[0-9]*.log")})


def _yaml_fields(yaml_file: Path) -> tuple[str, str]:
    """(model_name, exe_mode) as the YAML states them; exe_mode falls back to the runtime's default."""
    try:
        data = yaml.safe_load(yaml_file.read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(
            f"cannot read the YAML {yaml_file} ({e.strerror}); pass the YAML the run used."
        ) from e
    except yaml.YAMLError as e:
        raise UserError(
            f"{yaml_file} is not valid YAML ({e}); fix its syntax or pass the YAML the run used."
        ) from e
    data = data if isinstance(data, dict) else {}
    model_config = data.get("model_config") or {}
    name = model_config.get("model_name") or data.get("model_name") or yaml_file.stem
    return name, model_config.get("exe_mode") or ModelConfig.model_fields["exe_mode"].default


def _yaml_path(yaml_file: Path) -> str:
    """Relative to the model directory when the YAML lives in <model_dir>/config/, absolute otherwise."""
    resolved = yaml_file.resolve()
    if resolved.parent.name == "config":
        return resolved.relative_to(resolved.parent.parent).as_posix()
    return str(resolved)


def _cann_version() -> str | None:
    root = Path(os.environ.get("ASCEND_TOOLKIT_HOME") or _CANN_ROOT)
    for info in [root / "version.info", *sorted(root.glob("*/version.info"))]:
        if info.is_file():
            found = re.search(
                r"^\s*version\s*=\s*(\S+)", info.read_text(errors="replace"), re.MULTILINE | re.IGNORECASE
            )
            if found:
                return found[1]
    return None


def _cpu_model() -> str | None:
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    except OSError:
        return None
    return found[1].strip() if found else None


def _device() -> tuple[str, int, str | None, str | None]:
    """(device type, device count, device model, torch_npu version)."""
    import torch

    try:
        import torch_npu
    except (ImportError, OSError):
        torch_npu = None
    if torch_npu is not None and torch.npu.device_count() > 0:
        return "npu", torch.npu.device_count(), torch.npu.get_device_name(0), torch_npu.__version__
    if torch.cuda.device_count() > 0:
        return "cuda", torch.cuda.device_count(), torch.cuda.get_device_name(0), None
    return "cpu", 1, _cpu_model(), None


def _environment(exe_mode: str) -> dict:
    import torch

    device_type, count, model, npu_version = _device()
    return {
        "device_type": device_type,
        "device_model": model,
        "npu_model": model,
        "num_cards": count,
        "cann_version": _cann_version(),
        "pytorch_version": torch.__version__,
        "torch_npu_version": npu_version,
        "exe_mode": exe_mode,
    }


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 2) if values else None


def collect_baseline(
    log_path: Path, output: Path, yaml_file: Path, rank: int | None = None, model_source: str = ""
) -> dict:
    """Parse a run's log(s), write baseline_metadata.json to `output` atomically and return its content."""
    main_log, all_logs = _pick_log(Path(log_path), rank)
    parsed = {path: _parse(path) for path in all_logs}
    log = parsed[main_log]
    if not log.prefill_ms and not log.decode_ms:
        raise UserError(
            f"{main_log} has no inference timing lines (`[Main] Inference time (prefill|decode): "
            "X ms` or `... inference time cost of prefill|decode is X ms`); pass the log of a run "
            "that completed, or another rank's log with --rank."
        )
    model_name, exe_mode = _yaml_fields(Path(yaml_file))
    data = {
        "timestamp": datetime.now().astimezone().isoformat(timespec="seconds"),
        "yaml_path": _yaml_path(Path(yaml_file)),
        "environment": _environment(exe_mode),
        "model_config": {"model_name": model_name, "model_source": model_source},
        "performance": {
            "prefill_ms": _mean(log.prefill_ms),
            "decode_avg_ms": _mean(log.decode_ms[1:] or log.decode_ms),  # first step is cold
            "output_text": log.outputs.get(0),
        },
        "verification": {
            "all_ranks_success": not any(p.failed for p in parsed.values())
            and any(p.outputs for p in parsed.values())
        },
    }
    write_text_atomic(Path(output), json.dumps(data, ensure_ascii=False, indent=2) + "\n")
    return data


def _ms(value: float | None) -> str | None:
    return None if value is None else f"{value} ms"


def format_baseline_table(data: dict) -> Table:
    env, perf = data.get("environment", {}), data.get("performance", {})
    table = Table(
        title=Text(f"Baseline: {data.get('model_config', {}).get('model_name', '?')}"), show_header=False
    )
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    device = env.get("device_model") or env.get("npu_model") or "unknown model"
    rows = [
        ("yaml", data.get("yaml_path")),
        ("source", data.get("model_config", {}).get("model_source")),
        ("device", f"{env.get('device_type', 'npu')} x{env.get('num_cards', '?')} ({device})"),
        ("pytorch", env.get("pytorch_version")),
        ("torch_npu", env.get("torch_npu_version")),
        ("CANN", env.get("cann_version")),
        ("exe_mode", env.get("exe_mode")),
        ("prefill", _ms(perf.get("prefill_ms"))),
        ("decode (avg, cold step excluded)", _ms(perf.get("decode_avg_ms"))),
        ("output", perf.get("output_text")),
        ("all ranks succeeded", str(data.get("verification", {}).get("all_ranks_success"))),
        ("collected", data.get("timestamp")),
    ]
    for name, value in rows:
        table.add_row(name, Text(value or "-"))  # generated text may hold `[/INST]`: no console markup
    return table
