"""Checkpoints whose tensors are laid out differently from the model's parameters: per-expert MoE weights
stacked into one 3-D parameter (gate and up concatenated), renamed blocks, projections fused on disk
(`query_key_value` -> q, k, v) or apart on disk and joined in the model (q / k / v convolutions -> `conv1d`). The
rules come from transformers' own conversion mapping for the model type, so every architecture it knows is
covered."""

import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers.core_model_loading import WeightRenaming

# conversions of one tensor on its own, which the loader applies as transformers does (Inkling2-Loop's dequantization
# passes an unquantized tensor through)
TENSOR_OPS = {"Interleave", "Inkling2UnpadVocab", "Inkling2LoopDequantizeExperts"}


@dataclass(frozen=True)
class StackedPart:
    """A checkpoint tensor that fills `param[expert]`, rows [part * n, (part + 1) * n) of it."""

    target: str
    expert: int
    part: int
    num_parts: int


def _replaced(name: str, found: re.Match, target: str) -> str:
    """name with the part a rule's source pattern matched replaced by its target."""
    return name[: found.start()] + target + name[found.end() :]


class CheckpointLayout:
    def __init__(self, model_type: str, class_name: str = "", inner_classes: Sequence[str] = ()):
        """Rules registered for the class name take priority over the model type's, as in transformers; those
        registered for the classes of its inner modules apply too (Dots3's text model's, for its experts)."""
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        self.renames: list[Callable[[str], str]] = []  # in the order transformers applies them
        self._names: dict[str, str] = {}  # checkpoint name -> renamed
        self.converted: list[tuple[re.Pattern, str, list]] = []  # source, target, ops on the tensor alone
        self.stacks: list[tuple[re.Pattern, str, int, int]] = []  # source pattern, target suffix, part, parts
        # source, targets, sized like them (else even)
        self.fused: list[tuple[re.Pattern, list[str], bool]] = []
        # source, target, part, parts, what makes the parameter of its parts
        self.joined: list[tuple[re.Pattern, str, int, int, Callable[[list[torch.Tensor]], torch.Tensor]]] = []
        rules = get_checkpoint_conversion_mapping(class_name) or get_checkpoint_conversion_mapping(model_type)
        inner = (
            get_checkpoint_conversion_mapping(c) for c in dict.fromkeys(inner_classes) if c != class_name
        )
        seen = set()  # a rule two classes register alike applies once
        for rule in [*(rules or []), *(r for found in inner if found for r in found)]:
            key = (type(rule).__name__, *map(tuple, (rule.source_patterns, rule.target_patterns)))
            if key in seen:
                continue
            seen.add(key)
            ops = [(type(o).__name__, getattr(o, "dim", None)) for o in getattr(rule, "operations", [])]
            if not ops and type(rule).rename_source_key is not WeightRenaming.rename_source_key:
                self.renames.append(lambda name, rule=rule: rule.rename_source_key(name)[0])  # its own logic
            elif not ops:
                self.renames += [
                    functools.partial(re.compile(s).sub, t)
                    for s, t in zip(rule.source_patterns, rule.target_patterns)
                ]
            elif ops in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]):
                (target,) = rule.target_patterns
                for part, source in enumerate(rule.source_patterns):
                    # `*` is the expert's index, in a plain name or a regex (Kimi-Linear's `\.experts.*.w1.weight`)
                    plain = re.escape(source).replace(r"\*", r"(\d+)")
                    regex = (source.replace("*", r"(\d+)") if "\\" in source else plain) + "$"
                    self.stacks.append((re.compile(regex), target, part, len(rule.source_patterns)))
            elif ops in ([("Split", 0)], [("Chunk", 0)]) and len(rule.source_patterns) == 1:
                (source,) = rule.source_patterns
                self.fused.append((re.compile(source), list(rule.target_patterns), ops[0][0] == "Split"))
            elif all(o[0] in TENSOR_OPS for o in ops) and len(rule.target_patterns) == 1:
                # the tensor; further sources are its scales (Inkling2-Loop's quantized experts), which no
                # parameter takes
                (target,) = rule.target_patterns
                self.converted.append(
                    (re.compile(f"{rule.source_patterns[0]}$"), target, list(rule.operations))
                )
            elif len(ops) == 1 and len(rule.source_patterns) > 1 and len(rule.target_patterns) == 1:
                # several tensors into one, the op's own way: OLMo-Hybrid's q / k / v convolutions concatenated,
                # Inkling2-Loop's two tables of message queries interleaved
                (target,) = rule.target_patterns
                sources = list(rule.source_patterns)
                merge = functools.partial(_merged, rule.operations[0], sources, target)
                self.joined += [
                    (re.compile(f"{s}$"), target, i, len(sources), merge) for i, s in enumerate(sources)
                ]

    def _renamed(self, name: str) -> str:
        """name as transformers' renamings leave it; asked at each stage a tensor goes through (converted, joined,
        unfused, resolved), worked out once."""
        if name not in self._names:
            renamed = name
            for rename in self.renames:
                renamed = rename(renamed)
            self._names[name] = renamed
        return self._names[name]

    def conversion(
        self, name: str
    ) -> tuple[str, Callable[[torch.Tensor, torch.nn.Module], torch.Tensor]] | None:
        """(the parameter, what gives its tensor from the checkpoint's as transformers converts it: Interleave's gate /
        up rows, Inkling2's unpadded vocabulary) for a tensor a rule transforms on its own, else None."""
        name = self._renamed(name)
        for pattern, target, ops in self.converted:
            if found := pattern.search(name):
                full = _replaced(name, found, target)
                return full, functools.partial(_converted, ops, pattern.pattern, name, full)
        return None

    def unfused(self, name: str) -> tuple[list[str], bool] | None:
        """The names of the parameters a fused checkpoint tensor holds, in its row order, and whether their
        sizes differ (sized like the parameters) or not (equal chunks); None if it is not fused."""
        name = self._renamed(name)
        for pattern, targets, sized in self.fused:
            if found := pattern.search(name):
                return [_replaced(name, found, t) for t in targets], sized
        return None

    def joined_part(
        self, name: str
    ) -> tuple[str, int, int, Callable[[list[torch.Tensor]], torch.Tensor]] | None:
        """(the parameter, this tensor's place among its parts, their count, what makes the parameter of them) for
        a tensor the checkpoint keeps as one of several that make one parameter (OLMo-Hybrid's q / k / v
        convolutions concatenated into one `conv1d`), else None."""
        name = self._renamed(name)
        for pattern, target, part, parts, combine in self.joined:
            if found := pattern.search(name):
                return _replaced(name, found, target), part, parts, combine
        return None

    def resolve(self, name: str) -> tuple[str, StackedPart | None]:
        name = self._renamed(name)
        for pattern, target, part, parts in self.stacks:
            if found := pattern.search(name):
                full = name[: found.start()] + target
                return full, StackedPart(full, int(found.group(1)), part, parts)
        return name, None


def _merged(op, sources: list[str], target: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The parameter `target` that transformers' op makes of the checkpoint's tensors, one per source."""
    return op.convert(dict(zip(sources, parts, strict=True)), sources, [target])[target]


def _converted(
    ops: list, source: str, name: str, full: str, tensor: torch.Tensor, model: torch.nn.Module
) -> torch.Tensor:
    """tensor (the checkpoint's `name`) through transformers' conversion ops, as the parameter `full`."""
    for op in ops:
        kwargs = {"config": model.config, "model": model, "full_layer_name": full}
        tensor = op.convert({name: tensor}, [source], [full], **kwargs)[full]
    return tensor


def load_stacked_part(
    param: torch.nn.Parameter, weight: torch.Tensor, part: StackedPart, expert: int
) -> None:
    """`weight` into `param[expert]` (the expert's row of this rank's stack; part.expert is its global id)."""
    rows = weight.shape[0]
    dst = param.data[expert].narrow(0, part.part * rows, rows)
    if dst.shape != weight.shape:
        raise ValueError(
            f"{part.target}[{part.expert}]: checkpoint tensor of shape {list(weight.shape)} does not "
            f"fit part {part.part} of shape {list(dst.shape)}"
        )
    dst.copy_(weight)
