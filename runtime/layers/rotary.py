"""Rotary position embedding as transformers' `apply_rotary_pos_emb` computes it, the call `skill migrate`
writes in its body (MG030).

On the host, float32 and bfloat16 go through one C++ pass per tensor (``host_rotary_embedding``) with the
expression's roundings, other dtypes and layouts through ATen's operators in the same call; elsewhere and inside
a compiled graph (where inductor fuses the expression itself) the expression runs as written.
"""

import torch

from runtime.kernels import host_rotary_embedding


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x * cos + rotate_half(x) * sin`` for x = q and k, with cos and sin unsqueezed at ``unsqueeze_dim``."""
    if q.device.type == "cpu" and not torch.compiler.is_compiling() and (kernel := host_rotary_embedding()):
        return kernel(q, k, cos, sin, unsqueeze_dim)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
