"""Snapshots: what the rules make of the installed transformers' real files, checked in under tests/snapshots/
and compared byte for byte by the suite: `skill migrate`'s code for llama, qwen3 and gemma3_text, and
`skill parallelize`'s for llama and qwen3, each for a checkpoint whose config is its config class's defaults.
After changing a rule or the transformers pin, regenerate them with

    .venv/bin/python scripts/snapshots.py --update

and review the diff: it is what the change does to real models."""

import argparse
import difflib
import functools
import json
import sys
import tempfile
from pathlib import Path

import transformers

from skills.migrator.pipeline import Conversion, convert_code
from skills.migrator.vendor import VendoredSource, locate_source, snake_name
from skills.parallel_impl.rewrite import rewrite_sources

ROOT = Path(__file__).resolve().parent.parent / "tests" / "snapshots"
MIGRATE = ["llama", "qwen3", "gemma3_text"]
PARALLELIZE = ["llama", "qwen3"]
VERSION_FILE = "TRANSFORMERS_VERSION"


@functools.cache
def source(model_type: str) -> VendoredSource:
    """locate_source on a checkpoint dir holding only config.json, as `skill migrate` does."""
    with tempfile.TemporaryDirectory() as ckpt:
        (Path(ckpt) / "config.json").write_text(json.dumps({"model_type": model_type}))
        return locate_source(Path(ckpt))


@functools.cache
def converted(model_type: str, kv: str = "paged") -> Conversion:
    """convert_code of the architecture for a default config (2-4 s of CPU); callers must not modify it."""
    config = transformers.AutoConfig.for_model(model_type)
    return convert_code(source(model_type), snake_name(model_type), kv, checkpoint_config=config)


def expected() -> dict[str, str]:
    """Snapshot path (relative to tests/snapshots) -> its content, from the code as it is now."""
    files = {VERSION_FILE: f"{transformers.__version__}\n"}
    for model_type in MIGRATE:
        for rel, code in converted(model_type, "paged").files.items():
            files[f"migrate/{model_type}/{Path(rel).name}"] = code
    for model_type in PARALLELIZE:
        name = f"modeling_{snake_name(model_type)}.py"
        code = converted(model_type, "paged").files[f"models/{name}"]
        parallel = rewrite_sources({name: code}, source(model_type).entry_class)
        files[f"parallelize/{model_type}/{name}"] = parallel.files[name]
    return files


def on_disk() -> dict[str, str]:
    return {
        p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8")
        for p in sorted(ROOT.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def differences(want: dict[str, str], have: dict[str, str]) -> list[str]:
    """A unified diff (snapshot -> now) per file that differs, is missing or is stale."""
    out = []
    for rel in sorted(want.keys() | have.keys()):
        old, new = have.get(rel, ""), want.get(rel, "")
        if old != new:
            out.append(
                "".join(
                    difflib.unified_diff(
                        old.splitlines(True), new.splitlines(True), f"snapshot/{rel}", f"now/{rel}"
                    )
                )
            )
    return out


def update(want: dict[str, str]) -> None:
    for rel in on_disk().keys() - want.keys():
        (ROOT / rel).unlink()
    for rel, text in want.items():
        path = ROOT / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--update", action="store_true", help="rewrite tests/snapshots/ from the code as it is"
    )
    args = parser.parse_args()
    want = expected()
    if args.update:
        update(want)
        print(f"wrote {len(want)} files under {ROOT}")
        return 0
    diffs = differences(want, on_disk())
    sys.stdout.write("".join(diffs) or "snapshots are up to date\n")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
