"""Expert parallelism for a model's own experts module (seed 002's MoE EP).

The migrated experts module keeps its math: stacked per-expert parameters ``[num_experts, ...]`` and a forward
``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` that applies the routing weights.
Under ``moe_ep_group`` each rank builds only its ``num_experts / ep`` experts (a contiguous block; their loaders
read only those from the checkpoint) and ``ExpertParallel`` runs the module on the (token, expert) pairs routed
to them:

* tokens replicated over the group (attention DP 1): each rank runs its experts on its pairs, the partial
  sums are all_reduced;
* tokens sharded (each rank its own rows, the TP+DP layout): pairs are dispatched to their owners with
  ``all_to_all_single`` (uneven splits) and the weighted outputs come back the same way to be summed per token
  (``moe_dispatch: all_to_all``, the default); or every rank's rows are all_gathered, run as above and
  reduce_scattered back (``moe_dispatch: all_gather``); parallel_config.moe_dispatch picks one.

Under ``moe_tp_group`` (expert TP) each rank also keeps its share of every expert's intermediate size; the
group's partial sums are all_reduced (tokens replicated) or, when each rank holds its own rows, the group
all_gathers its rows first and reduce_scatters the sums back.

Every rank runs the same collectives in every step, also when no pair reaches it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from runtime.config.comm_manager import EP_GROUP
from runtime.errors import ConfigError
from runtime.layers.checkpoint_layout import StackedPart, load_stacked_part
from runtime.layers.comm import tp_info
from runtime.layers.linear import (
    LoadedWeight,
    ShardId,
    check_shape,
    materialize,
    read_narrow,
    set_weight_attrs,
)
from runtime.layers.token_layout import TPRegion, current_layout

if TYPE_CHECKING:
    from runtime.config import InferenceConfig
    from runtime.config.comm_manager import CommManager

ExpertsForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ExpertParallel:
    """This rank's block of experts in ``ep_group`` (and its share of each expert's intermediate size in
    ``tp_group``), and the dispatch / combine around them."""

    def __init__(
        self,
        num_experts: int,
        infer_config: InferenceConfig | None,
        comm_manager: CommManager | None,
        ep_group: str = EP_GROUP,
        tp_group: str | None = None,
        prefix: str = "",
    ):
        self.ep_size, self.ep_rank, self.group = tp_info(comm_manager, ep_group)
        if num_experts % self.ep_size:
            raise ConfigError(
                f"{prefix}: {num_experts} experts cannot be split evenly over {ep_group} of {self.ep_size} ranks"
            )
        self.tp_size, self.tp_rank, _ = tp_info(comm_manager, tp_group)
        # partial sums over a group: all_reduced where it holds the same tokens, else its rows gathered in and
        # the sums reduce_scattered back (the token layout decides, as for every TP unit)
        self.tp_region = TPRegion(comm_manager, tp_group)
        self.ep_region = TPRegion(comm_manager, ep_group)
        self.num_experts = num_experts
        self.local_experts = num_experts // self.ep_size
        self.first_expert = self.ep_rank * self.local_experts
        self.dispatch = infer_config.parallel_config.moe_dispatch if infer_config else "all_to_all"
        self.prefix = prefix

    @property
    def owned(self) -> range:
        """Global ids of this rank's experts."""
        return range(self.first_expert, self.first_expert + self.local_experts)

    def tp_part(self, size: int) -> int:
        """This rank's share of an expert's intermediate size (the whole size without expert TP)."""
        if size % self.tp_size:
            raise ConfigError(
                f"{self.prefix}: the experts' intermediate size {size} is not divisible by moe_tp_size "
                f"{self.tp_size}"
            )
        return size // self.tp_size

    def shard(
        self, *params: nn.Parameter, tp_dim: int | None = None, halves: bool = False, once: bool = False
    ) -> None:
        """Stacked parameters ``[local_experts, ...]`` that read only this rank's experts from the checkpoint:
        a packed ``[num_experts, ...]`` tensor through their loader, per-expert tensors by expert id
        (``owned_experts``: the checkpoint layout skips the others unread). Under expert TP, ``tp_dim`` is the
        intermediate dimension each rank keeps its contiguous share of (of each of two ``halves``, [gate; up],
        when set); ``once``: a bias added after the intermediate sum, kept by moe_tp rank 0 only (zero
        elsewhere) so that the reduced output holds it once."""
        for param in params:
            assert param.shape[0] == self.local_experts, (
                f"a stacked expert parameter has {param.shape[0]} experts, expected {self.local_experts}"
            )

            def load(p: nn.Parameter, loaded: LoadedWeight, shard_id: ShardId = None) -> None:
                assert shard_id is None, f"a stacked expert parameter takes no shard_id, got {shard_id!r}"
                self._load(p, loaded, tp_dim, halves, once)

            def load_part(p: nn.Parameter, loaded: LoadedWeight, part: StackedPart, expert: int) -> None:
                self._load_part(p, loaded, part, expert, tp_dim, once)

            set_weight_attrs(
                param, weight_loader=load, expert_part_loader=load_part, owned_experts=self.owned
            )

    def _load(
        self, param: nn.Parameter, loaded: LoadedWeight, tp_dim: int | None, halves: bool, once: bool
    ) -> None:
        full = [self.num_experts, *param.shape[1:]]
        if tp_dim is not None:
            full[tp_dim] *= self.tp_size
        check_shape(param, loaded, tuple(full), tuple(param.shape))
        if once and self.tp_rank:
            param.data.zero_()
            return
        experts = read_narrow(loaded, 0, self.first_expert, self.local_experts)
        if tp_dim is None or self.tp_size == 1:
            param.data.copy_(experts)
            return
        local = param.shape[tp_dim] // (2 if halves else 1)
        blocks = experts.chunk(2, dim=tp_dim) if halves else (experts,)
        own = [b.narrow(tp_dim, self.tp_rank * local, local) for b in blocks]
        param.data.copy_(torch.cat(own, dim=tp_dim))

    def _load_part(
        self,
        param: nn.Parameter,
        loaded: LoadedWeight,
        part: StackedPart,
        expert: int,
        tp_dim: int | None,
        once: bool,
    ) -> None:
        """One per-expert checkpoint tensor (part ``part.part`` of ``part.num_parts`` stacked along the expert's
        first dimension) into this rank's expert number ``expert``, only its TP share."""
        if tp_dim is None or self.tp_size == 1:
            load_stacked_part(param, materialize(loaded), part, expert)
            return
        if once or (part.num_parts > 1 and tp_dim != 1):
            raise ValueError(
                f"{part.target}: per-expert tensors cannot be split for expert TP in this layout (a bias added "
                "after the expert sum, or parts stacked along another dimension than the one split)"
            )
        local = param.shape[tp_dim] // part.num_parts
        weight = read_narrow(loaded, tp_dim - 1, self.tp_rank * local, local)
        param.data[expert].narrow(tp_dim - 1, part.part * local, local).copy_(weight)

    def __call__(
        self,
        experts: ExpertsForward,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """The experts' weighted outputs summed per token, for this rank's tokens."""
        routed = [self.tp_region.enter(t) for t in (hidden, top_k_index, top_k_weights)]
        return self.tp_region.exit(self._over_experts(experts, *routed))

    def _over_experts(self, experts: ExpertsForward, *routed: torch.Tensor) -> torch.Tensor:
        """Every expert's share of this rank's intermediate slice, summed over moe_ep_group's experts."""
        if self.group is None:
            return experts(*routed)
        if self.dispatch == "all_to_all" and current_layout().sharded:
            return self._all_to_all(experts, *routed)
        routed = [self.ep_region.enter(t) for t in routed]
        return self.ep_region.exit(self._run_owned(experts, *routed))

    def _run_owned(
        self,
        experts: ExpertsForward,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """This rank's experts' weighted outputs summed per token ([T, H]; zero rows where none was chosen)."""
        local = top_k_index - self.first_expert
        token, slot = torch.nonzero((local >= 0) & (local < self.local_experts), as_tuple=True)
        out = torch.zeros_like(hidden)
        if token.numel():
            rows = experts(hidden[token], local[token, slot, None], top_k_weights[token, slot, None])
            out.index_add_(0, token, rows.to(out.dtype))
        return out

    def _all_to_all(
        self,
        experts: ExpertsForward,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """Each (token, expert) pair to the expert's owner and its weighted output back, summed per token."""
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        owner = flat // self.local_experts
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=self.ep_size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        sent, received = send_counts.tolist(), recv_counts.tolist()
        token = order // k

        def exchange(t: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
            out = t.new_empty((sum(out_splits), *t.shape[1:]))
            dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, group=self.group)
            return out

        rows = exchange(hidden[token], received, sent)
        ids = exchange(flat[order], received, sent) - self.first_expert
        weights = exchange(top_k_weights.reshape(-1)[order], received, sent)
        done = experts(rows, ids[:, None], weights[:, None]) if rows.shape[0] else rows
        back = exchange(done.to(hidden.dtype), sent, received)
        return torch.zeros_like(hidden).index_add_(0, token, back)
