"""Rotary position embedding as transformers' `apply_rotary_pos_emb` computes it, the call `skill migrate`
writes in its body (MG030), and the frequencies of a RoPE that picks them by sequence length, per request (MG034).

On the host, float32 and bfloat16 go through one C++ pass per tensor (``host_rotary_embedding``) with the
expression's roundings, other dtypes and layouts through ATen's operators in the same call; elsewhere and inside
a compiled graph (where inductor fuses the expression itself) the expression runs as written.
"""

import functools
from collections.abc import Callable

import torch
from transformers import modeling_rope_utils

from runtime.engine.forward_metadata import ForwardMetaData
from runtime.errors import UserError
from runtime.kernels import host_rotary_embedding

# transformers' frequency update alone: the decorator around a forward that computes nothing
_hf_update = modeling_rope_utils.dynamic_rope_update(lambda self, x, position_ids, **kwargs: None)


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


def dynamic_rope_update(rope_forward: Callable) -> Callable:
    """transformers' decorator of this name, per request. transformers picks a dynamic RoPE's frequencies from the
    longest position in the forward (LongRoPE: the long factors past `original_max_position_embeddings`; dynamic
    NTK: a base grown with the length), which in a packed batch would be the longest request's. Here each token's
    come from its own request's length after the step, as a fresh transformers module computes them for the request
    alone: the tokens are grouped by that length, and each group gets transformers' own update from the module's
    state at start, which is put back after. The callers pass ``forward_metadata`` (MG034)."""

    @functools.wraps(rope_forward)
    def wrapper(
        self, x, position_ids, layer_type=None, forward_metadata: ForwardMetaData | None = None, **kwargs
    ):
        extra = {} if layer_type is None else {"layer_type": layer_type}
        rope_type = self.rope_type if layer_type is None else self.rope_type[layer_type]
        if "dynamic" not in rope_type and rope_type != "longrope":
            return rope_forward(self, x, position_ids, **extra)
        if forward_metadata is None:
            raise UserError(
                f"{type(self).__name__} picks its RoPE frequencies ({rope_type}) by each request's length, which "
                "it reads from forward_metadata: pass the caller's **kwargs (or forward_metadata=) to it."
            )
        return _per_request(rope_forward, self, x, position_ids, forward_metadata, extra)

    return wrapper


@torch.compiler.disable  # a loop over the step's request lengths
def _per_request(
    rope_forward: Callable, module, x, position_ids, md: ForwardMetaData, extra: dict
) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_forward's cos and sin, each token's computed after transformers' update for its request's length."""
    lengths = torch.repeat_interleave(
        md.actual_seq_lengths_kv, md.actual_seq_lengths_q, output_size=md.num_tokens
    )
    state = RopeState(module)
    cos = sin = None
    for length in lengths.unique().tolist():
        try:
            _hf_update(module, x, position_ids.new_full((1, 1), length - 1), **extra)
            picked = (lengths == length).nonzero()[:, 0]
            c, s = rope_forward(module, x, position_ids[..., picked], **extra)
        finally:
            state.restore()
        if cos is None:
            cos = c.new_empty(*c.shape[:-2], lengths.numel(), c.shape[-1])
            sin = torch.empty_like(cos)
        cos[..., picked, :], sin[..., picked, :] = c, s
    return cos, sin


# transformers' record of the length a rotary module's frequencies were grown for
GROWN = "max_seq_len_cached"


class RopeState:
    """What transformers' frequency update changes on a rotary module (its frequency buffers, the length they were
    grown for, the attention scaling), as it was, to put back."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.buffers = {k: v.clone() for k, v in module._buffers.items() if v is not None}
        self.attrs = {k: v for k, v in vars(module).items() if _grown(k)}

    def restore(self) -> None:
        module = self.module
        for name, value in self.buffers.items():
            persistent = name not in module._non_persistent_buffers_set
            module.register_buffer(name, value.clone(), persistent=persistent)
        for name in [k for k in vars(module) if _grown(k) and k not in self.attrs]:
            del module.__dict__[name]  # set by the update, absent before
        for name, value in self.attrs.items():
            setattr(module, name, value)


def rope_states(model: torch.nn.Module) -> list[RopeState]:
    """The state of each rotary module of model that keeps frequencies grown for the longest sequence it saw."""
    return [RopeState(m) for m in model.modules() if any(k.endswith(GROWN) for k in vars(m))]


def _grown(attr: str) -> bool:
    return attr.endswith(GROWN) or attr == "attention_scaling"
