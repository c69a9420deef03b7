"""What the converted model's runtime attention layers are, read off the built model for its README: head
counts and sizes, sliding window, soft cap, sinks, and what the KV cache holds per token (keys and values, or
the latents multi-head latent attention expands them from, or a sparse-attention indexer's keys)."""

import inspect

from torch import nn

from runtime.layers.attention import Attention
from runtime.layers.index_cache import IndexKeyCache


def _sinks(parent: nn.Module) -> bool:
    """Whether the module owning an Attention hands it sinks (read from the converted forward's source)."""
    return "sinks=" in inspect.getsource(type(parent).forward)


def attention_layouts(model: nn.Module) -> list[dict]:
    """One row per kind of Attention layer (layers built alike share a row), in order of first appearance."""
    modules = dict(model.named_modules())
    rows: dict[tuple, dict] = {}
    for name, layer in modules.items():
        if not isinstance(layer, Attention):
            continue
        (k_heads, k_size), (v_heads, v_size) = layer.cache_shapes
        expanded = layer.num_kv_heads * (layer.head_dim + layer.v_head_dim)
        # not attention: the keys a sparse-attention indexer scores
        indexer = isinstance(layer, IndexKeyCache)
        row = {
            "heads": "-" if indexer else f"{layer.num_heads} / {layer.num_kv_heads}",
            "head_size": f"{layer.head_dim} / -" if indexer else f"{layer.head_dim} / {layer.v_head_dim}",
            "sliding_window": layer.sliding_window or "-",
            "soft_cap": layer.soft_cap or "-",
            "sinks": "-" if indexer else "yes" if _sinks(modules[name.rpartition(".")[0]]) else "no",
            "cache": (
                "indexer keys"
                if indexer
                else f"latent ({expanded} expanded)"
                if layer.latent_dim
                else "keys and values"
            ),
            "cache_values_per_token": k_heads * k_size + v_heads * v_size,
        }
        entry = rows.setdefault(tuple(row.values()), {"layers": 0, "first": name, **row})
        entry["layers"] += 1
    return list(rows.values())
