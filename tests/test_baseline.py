"""Baseline collection from synthetic logs in the runtime's style and the seed runners' style."""

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from runtime.errors import UserError
from skills.baseline import collect_baseline, format_baseline_table

RUNTIME_LOG = """\
10:00:01 INFO Loading weights took 1.20 s
10:00:02 INFO [Main] Inference time (prefill): 150.00 ms
10:00:02 INFO [Main] Inference time (prefill): 152.00 ms
10:00:03 INFO [Main] Inference time (decode): 900.00 ms
10:00:03 INFO [Main] Inference time (decode): 60.00 ms
10:00:03 INFO [Main] Inference time (decode): 62.00 ms
10:00:03 INFO [Main] Inference time (decode): 64.00 ms
10:00:04 INFO Request 0: outputs: The capital of France is Paris.
It is known for the Eiffel Tower.

It has ERROR-free croissants.
10:00:04 INFO Request 1: outputs: Two plus two is four.
10:00:04 INFO tiny decode average inference time cost is 1.00 ms
"""

SEED_LOG = """\
[2025-01-01 10:00:00] INFO qwen3 inference time cost of prefill is 200.50 ms
[2025-01-01 10:00:01] INFO qwen3 inference time cost of decode is 500.00 ms
[2025-01-01 10:00:01] INFO qwen3 inference time cost of decode is 40.00 ms
[2025-01-01 10:00:01] INFO qwen3 inference time cost of decode is 42.00 ms
Request 0: outputs: Hello there,
general Kenobi.
Request 1: outputs: second
qwen3 decode average inference time cost is 194.00 ms
model run success
"""


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "tiny" / "config").mkdir(parents=True)
    (tmp_path / "tiny" / "config" / "tiny.yaml").write_text("model_config:\n  model_name: tiny\n")
    return tmp_path / "tiny"


def collect(log: Path, model_dir: Path, **kw) -> dict:
    return collect_baseline(
        log,
        model_dir / "agentic" / "baseline" / "baseline_metadata.json",
        model_dir / "config" / "tiny.yaml",
        **kw,
    )


def test_runtime_log(tmp_path: Path, model_dir: Path):
    log = tmp_path / "run.log"
    log.write_text(RUNTIME_LOG)
    data = collect(log, model_dir, model_source="https://huggingface.co/org/tiny")
    perf = data["performance"]
    assert perf["prefill_ms"] == 151.0
    assert perf["decode_avg_ms"] == 62.0  # 900 ms cold step and the 1.00 ms summary left out
    assert perf["output_text"] == (
        "The capital of France is Paris.\nIt is known for the Eiffel Tower.\n\nIt has ERROR-free croissants."
    )
    assert data["verification"]["all_ranks_success"] is True
    assert data["yaml_path"] == "config/tiny.yaml"
    assert data["model_config"] == {"model_name": "tiny", "model_source": "https://huggingface.co/org/tiny"}
    written = model_dir / "agentic" / "baseline" / "baseline_metadata.json"
    assert json.loads(written.read_text()) == data
    assert [p.name for p in written.parent.iterdir()] == ["baseline_metadata.json"]  # no temp file left


def test_seed_style_log(tmp_path: Path, model_dir: Path):
    log = tmp_path / "seed.log"
    log.write_text(SEED_LOG)
    perf = collect(log, model_dir)["performance"]
    assert perf == {
        "prefill_ms": 200.5,
        "decode_avg_ms": 41.0,
        "output_text": "Hello there,\ngeneral Kenobi.",
    }


def test_environment_schema(tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch):
    toolkit = tmp_path / "toolkit"
    (toolkit / "x86_64-linux").mkdir(parents=True)
    (toolkit / "x86_64-linux" / "version.info").write_text("Version=8.0.RC3\nversion_dir=8.0\n")
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(toolkit))
    log = tmp_path / "run.log"
    log.write_text(RUNTIME_LOG)
    data = collect(log, model_dir)
    assert list(data) == [
        "timestamp",
        "yaml_path",
        "environment",
        "model_config",
        "performance",
        "verification",
    ]
    env = data["environment"]
    assert env["cann_version"] == "8.0.RC3"
    assert env["pytorch_version"] == torch.__version__
    assert env["exe_mode"] == "eager"  # the runtime's default when the YAML doesn't say
    assert env["npu_model"] == env["device_model"]
    if env["device_type"] == "cpu":
        assert env["num_cards"] == 1 and env["torch_npu_version"] is None


def test_no_cann_is_null(tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path / "absent"))
    log = tmp_path / "run.log"
    log.write_text(RUNTIME_LOG)
    assert collect(log, model_dir)["environment"]["cann_version"] is None


def test_log_dir_defaults_to_rank0_and_checks_all_ranks(tmp_path: Path, model_dir: Path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "log_0.log").write_text(RUNTIME_LOG.replace(" INFO ", " [rank0] INFO "))
    data = collect(logs, model_dir)
    assert data["performance"]["decode_avg_ms"] == 62.0 and data["verification"]["all_ranks_success"]
    (logs / "log_1.log").write_text(
        SEED_LOG + "Traceback (most recent call last):\n  File x\nRuntimeError: boom\n"
    )
    assert collect(logs, model_dir)["verification"]["all_ranks_success"] is False
    assert collect(logs, model_dir, rank=1)["performance"]["prefill_ms"] == 200.5


def test_error_level_fails_verification(tmp_path: Path, model_dir: Path):
    log = tmp_path / "run.log"
    log.write_text(RUNTIME_LOG + "10:00:05 ERROR rank 1 lost\n")
    assert collect(log, model_dir)["verification"]["all_ranks_success"] is False


def test_single_log_in_dir(tmp_path: Path, model_dir: Path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "stderr.log").write_text(SEED_LOG)
    assert collect(tmp_path / "logs", model_dir)["performance"]["prefill_ms"] == 200.5


def test_ambiguous_dir_lists_candidates(tmp_path: Path, model_dir: Path):
    (tmp_path / "logs").mkdir()
    for name in ("a.log", "b.log"):
        (tmp_path / "logs" / name).write_text(SEED_LOG)
    with pytest.raises(UserError, match=r"'a.log', 'b.log'"):
        collect(tmp_path / "logs", model_dir)
    with pytest.raises(UserError, match="log_3.log"):
        collect(tmp_path / "logs", model_dir, rank=3)


def test_no_timing_lines_names_the_log(tmp_path: Path, model_dir: Path):
    log = tmp_path / "empty.log"
    log.write_text(
        "10:00:00 INFO loading\n10:00:01 INFO tiny decode average inference time cost is 1.00 ms\n"
    )
    with pytest.raises(UserError, match="empty.log"):
        collect(log, model_dir)
    assert not (model_dir / "agentic").exists()


def test_yaml_outside_config_dir_is_absolute(tmp_path: Path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("model_name: top\nmodel_config:\n  exe_mode: ge_graph\n")
    (tmp_path / "run.log").write_text(SEED_LOG)
    data = collect_baseline(tmp_path / "run.log", tmp_path / "out.json", yaml_file)
    assert data["yaml_path"] == str(yaml_file.resolve())
    assert data["model_config"]["model_name"] == "top"
    assert data["environment"]["exe_mode"] == "ge_graph"


def test_table_renders(tmp_path: Path, model_dir: Path):
    (tmp_path / "run.log").write_text(RUNTIME_LOG)
    console = Console(record=True, width=200)
    console.print(format_baseline_table(collect(tmp_path / "run.log", model_dir)))
    text = console.export_text()
    assert "151.0 ms" in text and "62.0 ms" in text and "Paris" in text


def test_generated_text_with_brackets_is_shown_as_written():
    # a chat model's output holds `[/INST]`, which rich would read as a closing tag (and raise on)
    console = Console(record=True, width=200)
    data = {"model_config": {"model_name": "m[1]"}, "performance": {"output_text": "Sure [/INST] [bold]x"}}
    console.print(format_baseline_table(data))
    shown = console.export_text()
    assert "Sure [/INST] [bold]x" in shown and "m[1]" in shown
