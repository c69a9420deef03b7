"""Generated code goes through ruff (default rules, autofix, format) so it reads like hand-written code."""
import subprocess
import sys


def _ruff(args: list[str], code: str, filename: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "ruff", *args, "--isolated", "--stdin-filename", filename, "-"],
                          input=code, capture_output=True, text=True, check=False)
    return proc.stdout if proc.returncode in (0, 1) and proc.stdout else code


def tidy(code: str, filename: str) -> str:
    code = _ruff(["check", "--fix", "--quiet", "--exit-zero"], code, filename)
    return _ruff(["format", "--quiet"], code, filename)
