"""Deployment-mode decision: flag > dispatch prompt > output-directory self-check > framework."""

import io
from pathlib import Path

import pytest

from runtime.errors import UserError
from skills.migrator.mode import decide_mode, read_dispatch_prompt


@pytest.mark.parametrize(
    ("prompt", "mode"),
    [
        ("任务：适配 qwen3\n部署模式: 框架部署\n", "framework"),
        ("部署模式：独立部署", "standalone"),
        ("部署模式 ：  独立部署模式。", "standalone"),
        ("部署模式:框架部署请直接适配", "framework"),
        ("Port it. Deployment Mode: STANDALONE.", "standalone"),
        ("deployment mode: framework", "framework"),
    ],
)
def test_prompt(tmp_path: Path, prompt: str, mode: str):
    assert decide_mode(None, prompt, tmp_path, "m")[0] == mode


@pytest.mark.parametrize("prompt", ["部署模式: 混合部署", "deployment mode: hybrid"])
def test_unknown_prompt_mode(tmp_path: Path, prompt: str):
    with pytest.raises(UserError, match="unknown deployment mode"):
        decide_mode(None, prompt, tmp_path, "m")


def test_contradicting_prompt(tmp_path: Path):
    with pytest.raises(UserError, match="both deployment modes"):
        decide_mode(None, "部署模式: 框架部署\ndeployment mode: standalone", tmp_path, "m")


def test_flag_wins(tmp_path: Path):
    assert decide_mode("standalone", "部署模式: 框架部署", tmp_path, "m") == ("standalone", "--mode flag")
    with pytest.raises(UserError, match="--mode framework"):
        decide_mode("hybrid", None, tmp_path, "m")


def write(path: Path, text: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_own_runner_is_standalone(tmp_path: Path):
    write(
        tmp_path / "m" / "runner_m.py",
        "import torch\nclass Runner:\n    pass\nclass R2(torch.nn.Module):\n    pass\n",
    )
    mode, reason = decide_mode(None, "no mode here", tmp_path, "m")
    assert mode == "standalone" and "runner_m.py" in reason


@pytest.mark.parametrize(
    "source",
    [
        "from runtime.engine import ModelRunner\nclass R(ModelRunner): pass\n",
        "import runtime.engine\nclass R(runtime.engine.ModelRunner): pass\n",
        "from runtime import engine as e\nclass R(e.ModelRunner): pass\n",
    ],
)
def test_runner_on_runtime_is_not_standalone(tmp_path: Path, source: str):
    write(tmp_path / "m" / "runner_m.py", source)
    assert decide_mode(None, None, tmp_path, "m")[0] == "framework"


def test_registered_framework_model(tmp_path: Path):
    write(tmp_path / "m" / "models" / "modeling_m.py")
    write(tmp_path / "m" / "config" / "m.yaml")
    mode, reason = decide_mode(None, None, tmp_path, "m")
    assert mode == "framework" and "modeling_" in reason


def test_default(tmp_path: Path):
    assert decide_mode(None, None, tmp_path, "new") == (
        "framework",
        "no deployment signal; framework is the default",
    )


def test_prompt_beats_directory(tmp_path: Path):
    write(tmp_path / "m" / "runner_m.py", "class Runner: pass\n")
    assert decide_mode(None, "部署模式: 框架部署", tmp_path, "m")[0] == "framework"


def test_broken_runner(tmp_path: Path):
    write(tmp_path / "m" / "runner_m.py", "class (:\n")
    with pytest.raises(UserError, match="runner_m.py:1"):
        decide_mode(None, None, tmp_path, "m")


def test_read_dispatch_prompt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    assert read_dispatch_prompt(None) is None
    write(tmp_path / "p.txt", "部署模式: 独立部署")
    assert read_dispatch_prompt(str(tmp_path / "p.txt")) == "部署模式: 独立部署"
    monkeypatch.setattr("sys.stdin", io.StringIO("deployment mode: framework"))
    assert read_dispatch_prompt("-") == "deployment mode: framework"
    with pytest.raises(UserError, match="dispatch prompt"):
        read_dispatch_prompt(str(tmp_path / "absent.txt"))
