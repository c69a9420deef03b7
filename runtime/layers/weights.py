"""Model-side weight loading: map checkpoint names onto parameters and their ``weight_loader``s."""

import functools
import logging
import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from runtime.errors import UserError
from runtime.layers.checkpoint_layout import CheckpointLayout, load_stacked_part
from runtime.layers.linear import default_weight_loader, materialize
from runtime.layers.prefix import join_prefix

logger = logging.getLogger(__name__)


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers a checkpoint carries besides parameters (a router's score-correction bias, a layer scalar)."""
    return {
        join_prefix(prefix, name): buffer
        for prefix, module in model.named_modules()
        for name, buffer in module.named_buffers(recurse=False)
        if name not in module._non_persistent_buffers_set
    }


def named_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Everything a checkpoint must provide: parameters (shared ones once) and persistent buffers."""
    return {**dict(model.named_parameters()), **persistent_buffers(model)}


def missing_weights(model: nn.Module, loaded: set[str]) -> list[str]:
    """Parameters the checkpoint did not provide. Persistent buffers it lacks keep their initial values, as in
    transformers, with a warning."""
    if unset := sorted(set(persistent_buffers(model)) - loaded):
        logger.warning(
            "the checkpoint has no values for buffers %s; they keep their initial values", unset[:8]
        )
    return sorted(set(dict(model.named_parameters())) - loaded)


def tie_declared_weights(model: nn.Module) -> int:
    """Shares parameters as modules declare in ``_tied_weights_keys`` (``{target: source}``, regexes over the
    module's parameter names, as transformers reads them: Zamba's hybrid layers all run the first one's shared
    transformer), when the config ties weights (``tie_word_embeddings``, transformers' switch for every tie).
    A checkpoint holds the sources only. Returns how many parameters became shared."""
    tied = 0
    for prefix, module in model.named_modules():
        declared = getattr(module, "_tied_weights_keys", None)
        config = getattr(module, "config", getattr(model, "config", None))
        if not isinstance(declared, dict) or not getattr(config, "tie_word_embeddings", False):
            continue
        names = sorted(n for n, _ in module.named_parameters(remove_duplicate=False))
        for target, source in declared.items():
            sources = [n for n in names if re.match(f"(?:{source})(?=\\.|$)", n)]
            targets = [n for n in names if re.match(f"(?:{target})(?=\\.|$)", n)]
            if not sources or not targets or len(targets) % len(sources):
                raise UserError(
                    f"{type(module).__name__} ({prefix or 'the model'}) ties {target!r} to {source!r} in "
                    f"_tied_weights_keys, but its parameters give {len(targets)} targets for {len(sources)} "
                    "sources: fix the pattern, or set tie_word_embeddings: false in config.json if the "
                    "checkpoint holds every copy."
                )
            for i, name in enumerate(targets):
                owner, _, attr = name.rpartition(".")
                shared, own = module.get_parameter(sources[i % len(sources)]), module.get_parameter(name)
                if shared.shape != own.shape:
                    raise UserError(
                        f"{type(module).__name__} ({prefix or 'the model'}) ties {name!r} "
                        f"{list(own.shape)} to {sources[i % len(sources)]!r} {list(shared.shape)}: their shapes "
                        "differ; fix _tied_weights_keys."
                    )
                if own is not shared:
                    setattr(module.get_submodule(owner), attr, shared)
                    tied += 1
    return tied


def _fused(name: str, mapping: list[tuple[str, str, object]]) -> tuple[str, object]:
    """(the fused parameter's name, shard id) for a part (`.q_proj` of `.qkv_proj`), else (name, None)."""
    for fused, piece, shard_id in mapping:
        if piece in name:
            return name.replace(piece, fused), shard_id
    return name, None


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, object]],
    stacked_params_mapping: Iterable[tuple[str, str, object]] = (),
    ignored: Iterable[str] = (),
) -> set[str]:
    """Load ``(name, weight)`` pairs; returns the canonical names of the parameters loaded. A name the model
    holds only under its ``base_model_prefix`` (the inner model a flat entry's trunk was moved into) loads there.

    ``stacked_params_mapping`` holds ``(fused_param, checkpoint_part, shard_id)`` such as
    ``(".qkv_proj", ".q_proj", "q")``. Persistent buffers load like parameters. Names that match no
    parameter go through transformers' checkpoint conversion for the model type (per-expert MoE tensors ->
    stacked 3-D parameters; experts outside a parameter's ``owned_experts`` are skipped unread). A name
    nothing takes is an error, unless it matches one of the ``ignored`` patterns (re.search, as transformers
    reads the model's ``_keys_to_ignore_on_load_unexpected``) or belongs to a multi-token-prediction layer
    past the model's own (``config.num_nextn_predict_layers``), which this runtime does not run: those are
    skipped unread, and a warning names them. A stacked parameter left with holes is an error too.
    """
    buffers = persistent_buffers(model)
    canonical = {id(p): n for n, p in [*model.named_parameters(), *buffers.items()]}
    params = {**dict(model.named_parameters(remove_duplicate=False)), **buffers}
    mapping = list(stacked_params_mapping)
    skips = _Skips(model, ignored)
    layout = functools.cache(
        lambda: CheckpointLayout(
            getattr(getattr(model, "config", None), "model_type", ""),
            type(model).__name__,
            [type(m).__name__ for m in model.modules()],
        )
    )
    stacked: dict[str, set[tuple[int, int]]] = {}
    loaded: set[str] = set()
    if prefix := getattr(model, "base_model_prefix", ""):  # a checkpoint of the trunk's names without it
        weights = ((_under(model, prefix, n), w) for n, w in weights)
    converted = _converted(weights, layout, params, model)
    for name, weight in _unfused(_joined(converted, layout, params), layout, params, mapping):
        # a parameter of this very name wins over a fused one (AFMoE's attention `gate_proj` beside the MLP's)
        (target, shard_id), part = (name, None) if name in params else _fused(name, mapping), None
        if target not in params:  # transformers' names for the type (Exaone's `transformer.h.*`), then fused
            target, part = layout().resolve(name)
            if part is None:
                target, shard_id = _fused(target, mapping)
        param = params.get(target)
        if param is None and skips.take(name):
            continue
        if param is None:
            raise UserError(
                f"checkpoint weight {name!r} matches no parameter of {type(model).__name__}; "
                "the checkpoint does not belong to this model code."
            )
        try:
            if part is not None:
                owned = getattr(param, "owned_experts", range(param.shape[0]))
                if part.expert not in owned:  # another rank's expert: never read
                    continue
                load_part = getattr(param, "expert_part_loader", None)
                if load_part is None:
                    load_stacked_part(param, materialize(weight), part, part.expert - owned.start)
                else:
                    load_part(param, weight, part, part.expert - owned.start)
                stacked.setdefault(target, set()).add((part.expert, part.part))
                if len(stacked[target]) < param.shape[0] * part.num_parts:
                    continue
            else:
                getattr(param, "weight_loader", default_weight_loader)(param, weight, shard_id)
        except (UserError, ValueError) as e:
            raise UserError(f"loading {name!r} into {target!r}: {e}") from e
        loaded.add(canonical[id(param)])
    skips.report(type(model).__name__)
    return loaded


def _converted(
    weights: Iterable[tuple[str, object]],
    layout: Callable[[], CheckpointLayout],
    params: dict[str, torch.Tensor],
    model: nn.Module,
) -> Iterable[tuple[str, object]]:
    """The checkpoint's tensors, those transformers converts on their own (Interleave, ...) converted."""
    for name, weight in weights:
        found = None if name in params else layout().conversion(name)
        if found is None:
            yield name, weight
            continue
        target, convert = found
        yield target, convert(materialize(weight), model)


def _joined(
    weights: Iterable[tuple[str, object]],
    layout: Callable[[], CheckpointLayout],
    params: dict[str, torch.Tensor],
) -> Iterable[tuple[str, object]]:
    """The checkpoint's tensors, those a parameter concatenates from several joined into it once all have come."""
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for name, weight in weights:
        if name in params or (found := layout().joined_part(name)) is None:
            yield name, weight
            continue
        target, part, parts, combine = found
        got = pending.setdefault(target, {})
        got[part] = materialize(weight)
        if len(got) == parts:
            yield target, combine([got[i] for i in range(parts)])
            del pending[target]
    if pending:
        raise UserError(
            f"the checkpoint holds only some of the tensors that {', '.join(sorted(pending))} concatenates: it "
            "does not belong to this model code."
        )


def _unfused(
    weights: Iterable[tuple[str, object]],
    layout: Callable[[], CheckpointLayout],
    params: dict[str, torch.Tensor],
    mapping: list[tuple[str, str, object]],
) -> Iterable[tuple[str, object]]:
    """The checkpoint's tensors, those that hold several parameters fused on disk split into them."""
    for name, weight in weights:
        if name in params or any(piece in name for _, piece, _ in mapping):
            yield name, weight
            continue
        if (found := layout().unfused(name)) is None:
            yield name, weight
            continue
        targets, sized = found
        tensor = materialize(weight)
        if not sized:
            sizes = [tensor.shape[0] // len(targets)] * len(targets)
        elif (sizes := _disk_sizes(targets, params, mapping)) is None:
            raise UserError(
                f"checkpoint weight {name!r} holds {', '.join(targets)} fused; it is split by their sizes, "
                "which needs each of them as a whole parameter of the model or a block of a fused layer (not "
                "sharded by tensor parallelism on its own). Run the migrated model unparallelized, or split the "
                "tensor in the checkpoint."
            )
        if sum(sizes) != tensor.shape[0]:
            raise UserError(
                f"checkpoint weight {name!r} has {tensor.shape[0]} rows; {', '.join(targets)} need {sizes}: the "
                "checkpoint does not belong to this model code."
            )
        yield from zip(targets, tensor.split(sizes), strict=True)


def _disk_sizes(
    targets: list[str], params: dict[str, torch.Tensor], mapping: list[tuple[str, str, object]]
) -> list[int] | None:
    """Rows each target has on disk: a whole unsharded parameter's, or its block of a fused layer (Sarvam-MoE's
    q / k / v of the migrated qkv_proj, on any TP size); None where neither tells."""
    sizes = []
    for target in targets:
        if target in params and getattr(_owner(params[target]), "tp_size", 1) == 1:
            sizes.append(params[target].shape[0])
            continue
        fused, shard_id = _fused(target, mapping)
        segment = getattr(_owner(params[fused]), "segments", {}).get(shard_id) if fused in params else None
        if segment is None:
            return None
        sizes.append(segment.src_size)
    return sizes


def _owner(param: torch.Tensor) -> object:
    """The layer whose bound weight_loader loads param (None for a plain parameter)."""
    return getattr(getattr(param, "weight_loader", None), "__self__", None)


def _under(model: nn.Module, prefix: str, name: str) -> str:
    """name under the model's `base_model_prefix` when what it starts with is held only there."""
    top = name.split(".", 1)[0]
    held = not hasattr(model, top) and hasattr(getattr(model, prefix, None), top)
    return f"{prefix}.{name}" if held else name


# a module class's tuple of the buffers its checkpoint holds that it no longer has (a causal-mask buffer the
# runtime's attention replaces: `skill migrate`'s MG021 writes it)
SKIPPED_BUFFERS = "_skipped_checkpoint_buffers"


class _Skips:
    """Checkpoint tensors the model does not use on purpose: names matching its ignore patterns, buffers a module
    names in its SKIPPED_BUFFERS, and the multi-token-prediction layers some checkpoints ship after the model's own
    layers."""

    def __init__(self, model: nn.Module, ignored: Iterable[str]):
        self.model = model
        self.patterns = [re.compile(p) for p in ignored]
        config = getattr(model, "config", None)
        mtp = getattr(config, "num_nextn_predict_layers", None) or getattr(config, "num_mtp_layers", None)
        first = getattr(config, "num_hidden_layers", None)
        self.mtp = (
            re.compile(rf"(^|\.)layers\.({'|'.join(str(first + i) for i in range(mtp))})\.")
            if isinstance(mtp, int) and mtp > 0 and isinstance(first, int)
            else None
        )
        self.mtp_layers = mtp
        self.skipped: dict[str, list[str]] = {}

    def take(self, name: str) -> bool:
        if self.mtp is not None and self.mtp.search(name):
            why = (
                f"multi-token-prediction layers (config.num_nextn_predict_layers = {self.mtp_layers}; this "
                "runtime predicts one token per step)"
            )
        elif hit := next((p for p in self.patterns if p.search(name)), None):
            why = f"ignored by the model as transformers ignores them ({hit.pattern!r})"
        elif self._skipped_buffer(name):
            why = "buffers the migrated model no longer has"
        else:
            return False
        self.skipped.setdefault(why, []).append(name)
        return True

    def _skipped_buffer(self, name: str) -> bool:
        owner, _, leaf = name.rpartition(".")
        try:
            module = self.model.get_submodule(owner)
        except AttributeError:
            return False
        return leaf in getattr(module, SKIPPED_BUFFERS, ())

    def report(self, model: str) -> None:
        for why, names in self.skipped.items():
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            logger.warning("%s skipped %d checkpoint tensors, %s: %s", model, len(names), why, shown)
