"""Generated code goes through ruff (default rules, autofix, format) in the project's own style, so it reads
like hand-written code."""

import subprocess
import sys

LINE_LENGTH = 110  # pyproject.toml's [tool.ruff] line-length: the project and its generated code share it
# ruff sorts imports and guesses first-party modules from the working directory; pinned, the output is the same
# wherever the skill runs
FIRST_PARTY = "lint.isort.known-first-party = ['runtime']"


def _ruff(args: list[str], code: str, filename: str) -> str:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            *args,
            "--isolated",
            "--line-length",
            str(LINE_LENGTH),
            "--config",
            FIRST_PARTY,
            "--stdin-filename",
            filename,
            "-",
        ],
        input=code,
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.stdout if proc.returncode in (0, 1) and proc.stdout else code


def tidy(code: str, filename: str) -> str:
    code = _ruff(["check", "--fix", "--quiet", "--exit-zero"], code, filename)
    return _ruff(["format", "--quiet"], code, filename)
