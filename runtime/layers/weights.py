"""Model-side weight loading: map checkpoint names onto parameters and their ``weight_loader``s."""

from collections.abc import Iterable

from torch import nn

from runtime.errors import UserError
from runtime.layers.checkpoint_layout import CheckpointLayout, load_stacked_part
from runtime.layers.linear import default_weight_loader, materialize


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, object]],
    stacked_params_mapping: Iterable[tuple[str, str, object]] = (),
    skip_prefixes: Iterable[str] = (),
) -> set[str]:
    """Load ``(name, weight)`` pairs; returns the canonical names of the parameters loaded.

    ``stacked_params_mapping`` holds ``(fused_param, checkpoint_part, shard_id)`` such as
    ``(".qkv_proj", ".q_proj", "q")``. Names that match no parameter go through transformers' checkpoint
    conversion for the model type (per-expert MoE tensors -> stacked 3-D parameters); a name nothing
    takes is an error, and so is a stacked parameter left with holes.
    """
    canonical = {id(p): n for n, p in model.named_parameters()}
    params = dict(model.named_parameters(remove_duplicate=False))
    mapping, skips = list(stacked_params_mapping), tuple(skip_prefixes)
    layout = None
    stacked: dict[str, set[tuple[int, int]]] = {}
    loaded: set[str] = set()
    for name, weight in weights:
        if skips and name.startswith(skips):
            continue
        target, shard_id, part = name, None, None
        for fused, piece, sid in mapping:
            if piece in name:
                target, shard_id = name.replace(piece, fused), sid
                break
        if target not in params:
            model_type = getattr(getattr(model, "config", None), "model_type", "")
            layout = layout or CheckpointLayout(model_type, type(model).__name__)
            target, part = layout.resolve(name)
        param = params.get(target)
        if param is None:
            raise UserError(
                f"checkpoint weight {name!r} matches no parameter of {type(model).__name__}; "
                "the checkpoint does not belong to this model code."
            )
        try:
            if part is not None:
                load_stacked_part(param, materialize(weight), part)
                stacked.setdefault(target, set()).add((part.expert, part.part))
                if len(stacked[target]) < param.shape[0] * part.num_parts:
                    continue
            else:
                getattr(param, "weight_loader", default_weight_loader)(param, weight, shard_id)
        except (UserError, ValueError) as e:
            raise UserError(f"loading {name!r} into {target!r}: {e}") from e
        loaded.add(canonical[id(param)])
    return loaded
