"""Pick the deployment mode: --mode flag, then the dispatch prompt, then what the output directory already holds."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from runtime.errors import UserError

MODES = ("framework", "standalone")
_PROMPT_MODES = {
    "框架部署": "framework",
    "独立部署": "standalone",
    "framework": "framework",
    "standalone": "standalone",
}
_PROMPT = re.compile(
    r"(?:部署模式|deployment[ _-]mode)\s*[:：]\s*(?P<mode>[A-Za-z_-]+|[\u3400-\u9fff]+)", re.IGNORECASE
)


def read_dispatch_prompt(arg: str | None) -> str | None:
    """The dispatch prompt from a file, or from stdin when `arg` is "-"."""
    if arg is None:
        return None
    if arg == "-":
        return sys.stdin.read()
    try:
        return Path(arg).read_text(encoding="utf-8")
    except OSError as e:
        raise UserError(
            f"cannot read the dispatch prompt {arg} ({e.strerror}); pass a readable file, "
            'or "-" to read it from stdin.'
        ) from e


def _prompt_mode(prompt: str) -> tuple[str, str] | None:
    # a known value may run into the following Chinese text: "部署模式: 框架部署请适配"
    named = [
        (m[0], next((v for k, v in _PROMPT_MODES.items() if m["mode"].lower().startswith(k)), None))
        for m in _PROMPT.finditer(prompt)
    ]
    unknown = [text for text, mode in named if mode is None]
    if unknown:
        raise UserError(
            f"the dispatch prompt names an unknown deployment mode ({unknown[0]!r}); write "
            "`部署模式: 框架部署` / `部署模式: 独立部署` or `deployment mode: framework|standalone`."
        )
    modes = {mode for _, mode in named}
    if len(modes) > 1:
        raise UserError(
            f"the dispatch prompt names both deployment modes ({[text for text, _ in named]}); "
            "keep the one you mean."
        )
    return (modes.pop(), f"dispatch prompt says {named[0][0]!r}") if modes else None


def _runtime_names(tree: ast.Module) -> set[str]:
    """Names bound by imports from the `runtime` package (`import runtime.x as y` binds y)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] == "runtime":
            names |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {
                alias.asname or alias.name.split(".")[0]
                for alias in node.names
                if alias.name.split(".")[0] == "runtime"
            }
    return names


def _subclasses_runtime(runner: Path) -> bool:
    try:
        tree = ast.parse(runner.read_text(encoding="utf-8"), filename=str(runner))
    except SyntaxError as e:
        raise UserError(
            f"{runner}:{e.lineno}: syntax error ({e.msg}), so its deployment mode cannot be "
            "told; fix the file or pass --mode framework|standalone."
        ) from e
    names = _runtime_names(tree)
    bases = [base for node in ast.walk(tree) if isinstance(node, ast.ClassDef) for base in node.bases]
    for base in bases:
        while isinstance(base, ast.Attribute):
            base = base.value
        if isinstance(base, ast.Name) and base.id in names:
            return True
    return False


def _self_check(model_dir: Path) -> tuple[str, str] | None:
    runners = sorted(model_dir.glob("runner_*.py"))
    standalone = [r for r in runners if not _subclasses_runtime(r)]
    if standalone:
        return "standalone", f"{standalone[0]} runs its own loop (no class subclasses a runtime class)"
    if not runners and any(model_dir.glob("models/modeling_*.py")) and any(model_dir.glob("config/*.yaml")):
        return (
            "framework",
            f"{model_dir} is a framework model (models/modeling_*.py + config/*.yaml, no runner)",
        )
    return None


def decide_mode(flag: str | None, dispatch_prompt: str | None, out_dir: Path, name: str) -> tuple[str, str]:
    """(mode, reason): explicit flag > dispatch prompt > what out_dir/name holds > "framework"."""
    if flag is not None:
        if flag not in MODES:
            raise UserError(f"unknown deployment mode {flag!r}; pass --mode framework or --mode standalone.")
        return flag, "--mode flag"
    return (
        (dispatch_prompt and _prompt_mode(dispatch_prompt))
        or _self_check(Path(out_dir) / name)
        or ("framework", "no deployment signal; framework is the default")
    )
