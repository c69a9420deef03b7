"""Per-step metadata handed explicitly to the model's forward (no module-level singleton)."""

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardMetaData:
    """What attention needs for one packed step of B requests and T tokens.

    Names follow the seed executor: ``actual_seq_lengths_q`` are the new tokens per request,
    ``actual_seq_lengths_kv`` the tokens each request attends to after this step, and the
    ``_cu_`` variants their cumulative sums with a leading 0.
    """

    is_prefill: bool
    kv_len: torch.Tensor  # [B] tokens already in the cache before this step
    actual_seq_lengths_q: torch.Tensor  # [B]
    actual_seq_lengths_kv: torch.Tensor  # [B]
    actual_seq_lengths_cu_q: torch.Tensor  # [B + 1]
    positions: torch.Tensor  # [T] position of each packed token in its request
    max_seq_len_q: int
    max_seq_len_kv: int
    prompt_tokens: list[int] = field(default_factory=list)  # prompt length per request
    block_table: dict[str, torch.Tensor] = field(default_factory=dict)  # cache group -> [B, blocks]
    slot_mapping: dict[str, torch.Tensor] = field(default_factory=dict)  # cache group -> [T]
    # per row: its RequestStates (runtime.layers.request_states)
    request_states: list = field(default_factory=list)
    probe: bool = False  # the engine's start-up forward that collects each attention layer's cache keys
    _cache: dict = field(default_factory=dict, repr=False)  # masks / indices built once per step

    @property
    def batch_size(self) -> int:
        return self.actual_seq_lengths_q.numel()

    @property
    def num_tokens(self) -> int:
        return self.positions.numel()

    @property
    def last_token_indices(self) -> torch.Tensor:
        """Index of each request's last token in the packed input: ``cu_q[1:] - 1``."""
        return self.memo("last_token_indices", lambda: self.actual_seq_lengths_cu_q[1:] - 1)

    def memo(self, key, build):
        """Compute something once per step and share it across layers. Inside a compiled graph a key that holds
        sizes is not looked up: the lookup would make the graph specialise on those sizes and trace again whenever
        one changes; the graph computes the value where it is used (and merges the identical computations)."""
        if isinstance(key, tuple) and torch.compiler.is_compiling():
            return build()
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]
