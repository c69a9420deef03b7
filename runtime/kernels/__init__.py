"""Host kernels built from C++ on first use (torch.utils.cpp_extension, cached across runs).

Each loader returns the compiled module or operator, or None where it cannot be built (no compiler, set
``SKILL_HOST_KERNELS=0`` to skip them); callers then take their portable PyTorch path. What a compiled decode
step calls is a ``torch.ops.skill`` operator with a fake (shape-only) implementation, so graphs keep it; the
elementwise ones (RMS norm, rotary embedding, SiLU-and-mul) are not called inside graphs, where inductor fuses the
expressions they replace.
"""

import functools
import hashlib
import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCES = Path(__file__).parent
# a build takes about a minute on two cores; an older lock outlived the process that took it
STALE_LOCK_S = 600
# operators built so far, by name: a compiled graph looks them up here (tracing a loader would trace the build)
BUILT: dict[str, Callable] = {}
KERNEL_ROWS = 16  # rows (decode tokens) up to which host_linear_kernel's products beat the library's


def _build_tag() -> str:
    """The build is tuned to this CPU (-march=native) and includes the shared headers, so the cache key names
    the CPU's feature flags and the headers' contents (torch rebuilds on a change of the source alone)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = platform.processor()
    headers = "".join(p.read_text() for p in sorted(_SOURCES.glob("*.h")))
    return hashlib.sha1((flags + headers).encode()).hexdigest()[:10]


def _load(source: str, what: str, python_module: bool = True, flags: tuple[str, ...] = ()):
    """The compiled ``<source>.cpp`` (its Python module, or with ``python_module=False`` the ``torch.ops.skill``
    namespace its operators joined), or None (logged, naming the portable path ``what`` falls back to)."""
    if os.environ.get("SKILL_HOST_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        name = f"skill_{source}_{_build_tag()}"
        _drop_stale_lock(Path(_get_build_directory(name, verbose=False)) / "lock")
        module = load(
            name=name,
            sources=[str(_SOURCES / f"{source}.cpp")],
            extra_cflags=["-O3", "-march=native", "-fopenmp", *flags],
            extra_ldflags=["-fopenmp"],
            is_python_module=python_module,
            verbose=False,
        )
        return module if python_module else torch.ops.skill
    except Exception as e:  # noqa: BLE001 - any build failure means: use the portable path
        logger.warning("host kernel %s unavailable (%s); using %s", source, e, what)
        return None


@functools.cache
def host_decode_attention():
    """``torch.ops.skill.paged_decode_attention``: q [B, H, D], caches [blocks, block_size, Hkv, D | Dv], block
    table [B, n], lengths [B], scale, window (0: none), soft cap (0.0: none), sinks [H] or None -> [B, H, Dv]."""
    if (ops := _load("paged_decode_attention", "the gather + SDPA path", python_module=False)) is None:
        return None
    torch.library.register_fake("skill::paged_decode_attention")(
        lambda q, k_cache, v_cache, *_: q.new_empty(*q.shape[:2], v_cache.shape[3])
    )
    BUILT["paged_decode_attention"] = ops.paged_decode_attention
    return ops.paged_decode_attention


@functools.cache
def host_rms_norm():
    """``torch.ops.skill.rms_norm``: x [..., n], weight [n] (one dtype, float32 or bfloat16), eps,
    weight_in_float -> Llama's RMS norm of x (see rms_norm.cpp)."""
    ops = _load("rms_norm", "the PyTorch expression", python_module=False)
    return None if ops is None else ops.rms_norm


@functools.cache
def host_rotary_embedding():
    """``torch.ops.skill.rotary_embedding``: q, k, cos, sin, unsqueeze_dim -> (q, k) rotated as transformers'
    apply_rotary_pos_emb does (see rotary_embedding.cpp)."""
    # no fused multiply-adds: each product is rounded before the sum, as the expression rounds it
    ops = _load(
        "rotary_embedding", "the PyTorch expression", python_module=False, flags=("-ffp-contract=off",)
    )
    return None if ops is None else ops.rotary_embedding


@functools.cache
def host_silu_and_mul():
    """``torch.ops.skill.silu_and_mul``: gate, up (one shape and dtype, float32 or bfloat16) -> F.silu(gate) * up
    (see silu_and_mul.cpp)."""
    ops = _load("silu_and_mul", "the PyTorch expression", python_module=False)
    return None if ops is None else ops.silu_and_mul


@functools.cache
def host_linear_kernel():
    """int8_linear / fp8_linear (quantized weights) and float_linear (float32, bf16, fp16 weights) for decode rows;
    ``torch.ops.skill.onednn_linear`` (x, oneDNN-packed weight, bias) and ``torch.ops.skill.float_linear`` join
    the operators with it."""
    module = _load("host_linear", "dequantize + matmul, or F.linear")
    if module is not None:
        for op in ("onednn_linear", "float_linear"):
            torch.library.register_fake(f"skill::{op}")(
                lambda x, weight, bias: x.new_empty(*x.shape[:-1], weight.shape[0])
            )
    return module


def _drop_stale_lock(lock: Path) -> None:
    """torch waits forever on the lock of a build whose process was killed; remove one that old."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        logger.warning("removing the stale build lock %s (%.0f s old)", lock, age)
        lock.unlink(missing_ok=True)
