"""The checked-in snapshots (tests/snapshots/) are what the rules make of the pinned transformers' real
llama / qwen3 / gemma3_text files now, byte for byte; they and the whole project pass ruff."""

import re
import subprocess
import sys
from pathlib import Path

import snapshots
import transformers

from skills.migrator.codestyle import LINE_LENGTH

REPO = Path(__file__).resolve().parent.parent
UPDATE = ".venv/bin/python scripts/snapshots.py --update"


def test_snapshots_match_the_rules():
    diffs = snapshots.differences(snapshots.expected(), snapshots.on_disk())
    shown = "\n".join(d[:2000] for d in diffs[:3])
    assert not diffs, f"{len(diffs)} snapshot(s) differ; if the change is intended run `{UPDATE}`:\n{shown}"


def test_snapshots_are_of_the_pinned_transformers():
    pin = re.search(r'"transformers==([^"]+)"', (REPO / "pyproject.toml").read_text())[1]
    recorded = (snapshots.ROOT / snapshots.VERSION_FILE).read_text().strip()
    assert pin == recorded == transformers.__version__, (
        f"pin {pin}, snapshots {recorded}, installed "
        f"{transformers.__version__}: change them together (`{UPDATE}`)"
    )


def test_project_and_snapshots_pass_ruff_with_one_style():
    assert re.search(rf"^line-length = {LINE_LENGTH}$", (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    for args in (["check", "."], ["format", "--check", "."]):
        proc = subprocess.run(
            [sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True, check=False
        )
        assert proc.returncode == 0, f"ruff {' '.join(args)}:\n{proc.stdout[-3000:]}{proc.stderr[-1000:]}"
