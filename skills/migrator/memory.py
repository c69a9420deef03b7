"""Will a model fit on one device? Weights (from the checkpoint's tensor headers, or config shapes) + KV cache
estimated, never by building the model."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import PretrainedConfig

from runtime.errors import UserError


@dataclass(frozen=True)
class MemoryEstimate:
    params: int
    param_bytes: int
    kv_bytes: int
    total_bytes: int


def _mlp_params(hidden: int, intermediate: int, bias: bool) -> int:
    """gate, up and down projections."""
    return 3 * hidden * intermediate + (2 * intermediate + hidden if bias else 0)


def _is_sparse(cfg: PretrainedConfig, layer: int, experts: int) -> bool:
    """Qwen-MoE style layer selection; configs without these keys make every layer sparse."""
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return (
        experts > 0 and layer not in (getattr(cfg, "mlp_only_layers", None) or []) and (layer + 1) % step == 0
    )


def _layer_params(cfg: PretrainedConfig, layer: int, head_dim: int, kv_heads: int) -> int:
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = hidden * (q + 2 * kv) + q * hidden
    if getattr(cfg, "attention_bias", False):
        attention += q + 2 * kv + hidden
    bias = getattr(cfg, "mlp_bias", False)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0
    if _is_sparse(cfg, layer, experts):
        moe_size = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        mlp = experts * _mlp_params(hidden, moe_size, bias) + hidden * experts  # experts + router
        if shared := getattr(cfg, "shared_expert_intermediate_size", None):
            mlp += _mlp_params(hidden, shared, bias) + hidden  # shared expert + its gate
    else:
        mlp = _mlp_params(hidden, cfg.intermediate_size, bias)
    return attention + mlp + 2 * hidden  # input and post-attention norms


def _shapes(hf_config: PretrainedConfig) -> tuple[PretrainedConfig, int, int]:
    """(text config, head_dim, num_key_value_heads)."""
    cfg = hf_config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg, head_dim, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


def estimate_memory(
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    batch_size: int,
    max_seq_len: int,
    checkpoint: Path | None = None,
) -> MemoryEstimate:
    """Weights in `dtype` (the checkpoint's own tensors where its safetensors list them, else embeddings, layers,
    final norm and untied lm_head from the config's shapes) and a full-length KV cache. A config naming its sizes
    otherwise than transformers' (remote code's `num_layers`, `kv_channels`) gives no KV figure: the runtime
    sizes its pool from the memory the weights leave."""
    try:
        cfg, head_dim, kv_heads = _shapes(hf_config)
        layers = cfg.num_hidden_layers
        kv_bytes = 2 * layers * kv_heads * head_dim * batch_size * max_seq_len * dtype.itemsize
    except AttributeError:
        cfg, kv_bytes = None, 0
    params = _checkpoint_params(checkpoint) if checkpoint is not None else 0
    if not params and cfg is not None:
        embeddings = cfg.vocab_size * cfg.hidden_size
        tied = getattr(hf_config, "tie_word_embeddings", getattr(cfg, "tie_word_embeddings", False))
        params = (
            embeddings * (1 if tied else 2)
            + cfg.hidden_size
            + sum(_layer_params(cfg, i, head_dim, kv_heads) for i in range(layers))
        )
    param_bytes = params * dtype.itemsize
    return MemoryEstimate(params, param_bytes, kv_bytes, param_bytes + kv_bytes)


def _checkpoint_params(checkpoint: Path) -> int:
    """Elements of every tensor the checkpoint's safetensors hold (headers only; the shards its index names where
    it has one, not a consolidated copy beside them); 0 without them."""
    index = Path(checkpoint) / "model.safetensors.index.json"
    if index.is_file():
        paths = sorted({Path(checkpoint) / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        paths = sorted(Path(checkpoint).glob("*.safetensors"))
    total = 0
    for path in paths:
        with safe_open(path, framework="pt") as f:
            names = f.keys()  # a safe_open handle is not iterable
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in names)
    return total


MEMORY_LIMIT_ENV = "SKILL_MEMORY_LIMIT_BYTES"


def available_memory(device: torch.device) -> int:
    """Free bytes on `device` now (CPU: MemAvailable), capped by $SKILL_MEMORY_LIMIT_BYTES when set."""
    free = _free_memory(device)
    limit = os.environ.get(MEMORY_LIMIT_ENV)
    return min(free, int(limit)) if limit else free


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "npu":
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)
        except ImportError as e:
            raise UserError(
                f"device {device} needs torch_npu, which is not installed; install it "
                "(pip install torch_npu matching your CANN) or pick another device."
            ) from e
        return torch.npu.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            found = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
        except OSError:
            found = None
        if found:
            return int(found[1]) * 1024
    raise UserError(
        f"cannot tell how much memory {device} has free (only cuda, npu and Linux cpu are "
        "supported); skip the memory check or run on one of those."
    )


def fits(estimate: MemoryEstimate, available: int, headroom: float = 0.9) -> bool:
    """True when the estimate takes at most `headroom` of the available bytes."""
    return estimate.total_bytes <= available * headroom
