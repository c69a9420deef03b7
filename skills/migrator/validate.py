"""Check a staged model directory before it replaces anything: the code imports, the model builds, and
every parameter gets a checkpoint tensor of the right shape (shapes from safetensors headers, weights
never read: the model is built on the meta device)."""

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from runtime.config import InferenceConfig
from runtime.engine.loader import checkpoint_weights, prepare_for_checkpoint
from runtime.engine.model_worker import ModelWorker
from runtime.errors import UserError
from runtime.layers.linear import weight_shape
from runtime.layers.weights import missing_weights
from skills.migrator.attention_layout import attention_layouts
from skills.migrator.expert_layout import expert_layouts


def _meta_weights(weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's names with empty tensors of its shapes: nothing is read beyond the headers."""
    for name, weight in weights:
        yield name, torch.empty(weight_shape(weight), device="meta")


def validate_model_dir(model_dir: Path, yaml_path: Path) -> tuple[list[dict], list[dict]]:
    """Raises UserError naming what is wrong; returns the model's attention and expert layouts (for its
    README)."""
    config = InferenceConfig.from_yaml(yaml_path)
    config.model_config.trust_remote_code = True  # the code was only parsed so far; nothing runs from it here
    worker = ModelWorker(config, None, model_dir)
    model_cls, hf_config = worker.model_class_and_config()
    try:
        with torch.device("meta"):
            model = model_cls(hf_config, config, None, prefix="").to(
                "meta"
            )  # torch.normal ignores the context
    except Exception as e:
        raise UserError(f"the converted {model_cls.__name__} does not build: {type(e).__name__}: {e}") from e
    scheme = prepare_for_checkpoint(model, worker.model_path)
    loaded = model.load_weights(_meta_weights(checkpoint_weights(worker.model_path, scheme)))
    missing = missing_weights(model, set(loaded))
    if missing:
        raise UserError(
            f"the checkpoint {worker.model_path} has no weights for {missing[:8]} of the converted "
            f"{model_cls.__name__}; check that it is complete (all shards present)."
        )
    return attention_layouts(model), expert_layouts(model)
