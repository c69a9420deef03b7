"""Model-side weight loading: map checkpoint names onto parameters and their ``weight_loader``s."""
from collections.abc import Iterable

from torch import nn

from runtime.errors import UserError
from runtime.layers.linear import default_weight_loader


def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, object]],
                       stacked_params_mapping: Iterable[tuple[str, str, object]] = (),
                       skip_prefixes: Iterable[str] = ()) -> set[str]:
    """Load ``(name, weight)`` pairs; returns the canonical names of the parameters loaded.

    ``stacked_params_mapping`` holds ``(fused_param, checkpoint_part, shard_id)`` such as
    ``(".qkv_proj", ".q_proj", "q")``. A name no parameter takes is an error.
    """
    canonical = {id(p): n for n, p in model.named_parameters()}
    params = dict(model.named_parameters(remove_duplicate=False))
    mapping, skips = list(stacked_params_mapping), tuple(skip_prefixes)
    loaded: set[str] = set()
    for name, weight in weights:
        if skips and name.startswith(skips):
            continue
        target, shard_id = name, None
        for fused, part, sid in mapping:
            if part in name:
                target, shard_id = name.replace(part, fused), sid
                break
        param = params.get(target)
        if param is None:
            raise UserError(f"checkpoint weight {name!r} matches no parameter of {type(model).__name__}; "
                            "the checkpoint does not belong to this model code.")
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, weight, shard_id)
        except (UserError, ValueError) as e:
            raise UserError(f"loading {name!r} into {target!r}: {e}") from e
        loaded.add(canonical[id(param)])
    return loaded
