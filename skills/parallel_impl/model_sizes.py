"""The sizes a parallel plan reads under transformers' standard config names, for a config that names them its own
way (Meta's reference Llama: `dim`, `n_heads`, `n_kv_heads`): read off the migrated model, built on the meta device
at one rank, from its runtime Attention layers and its token embedding."""

import copy

import torch
from torch import nn
from transformers import PretrainedConfig

from runtime.config import InferenceConfig
from runtime.config.comm_manager import CommManager
from runtime.engine.model_worker import default_dtype
from runtime.layers.attention import Attention

STANDARD = ("hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size")


def with_standard_sizes(
    hf_config: PretrainedConfig, model_cls: type[nn.Module], config: InferenceConfig
) -> PretrainedConfig:
    """hf_config where its text config has every STANDARD name, else a copy with the missing ones filled in from
    the model (the checkpoint's own config is left as it is)."""
    text = hf_config.get_text_config()
    missing = [n for n in STANDARD if getattr(text, n, None) is None]
    if not set(missing) - {"num_key_value_heads"}:  # the plan reads key heads off the weights first
        return hf_config
    with torch.device("meta"), default_dtype(config.model_config.torch_dtype):
        model = model_cls(hf_config, config, CommManager(1, 0, create_groups=False), prefix="")
    attention = next((m for m in model.modules() if isinstance(m, Attention)), None)
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    vocab = getattr(text, "vocab_size", None)  # the token embedding, not one of positions
    embedding = next(
        (e for e in embeddings if e.num_embeddings == vocab), embeddings[0] if embeddings else None
    )
    sizes = {}
    if attention is not None:
        sizes |= {"num_attention_heads": attention.num_heads, "num_key_value_heads": attention.num_kv_heads}
    if embedding is not None:
        sizes |= {"hidden_size": embedding.embedding_dim, "vocab_size": embedding.num_embeddings}
    filled = copy.deepcopy(hf_config)
    target = filled.get_text_config()
    for name in missing:
        if name in sizes:
            setattr(target, name, sizes[name])
    return filled
