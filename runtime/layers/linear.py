"""Tensor-parallel linear layers: y = F.linear(x, weight[out, in], bias), each rank holding its shard.

Every parameter carries `weight_loader(param, loaded_weight, shard_id=None)`. `loaded_weight` is a tensor or a
lazy safetensors slice (`safe_open(...).get_slice(name)`), so each rank reads only the rows it keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from runtime.errors import ConfigError
from runtime.layers.comm import all_gather, all_reduce, tp_info
from runtime.layers.quantization.base import UNQUANTIZED, UnquantizedLinearMethod

if TYPE_CHECKING:
    from runtime.config.comm_manager import CommManager


class LazySlice(Protocol):
    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


LoadedWeight = torch.Tensor | LazySlice
ShardId = int | str | None


def weight_shape(loaded: LoadedWeight) -> tuple[int, ...]:
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def read_narrow(loaded: LoadedWeight, dim: int, start: int, length: int) -> torch.Tensor:
    """loaded[start:start + length] along `dim`; a lazy slice reads only those elements from disk."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    return loaded[(slice(None),) * dim + (slice(start, start + length),)]


def materialize(loaded: LoadedWeight) -> torch.Tensor:
    """The whole tensor (reads a lazy slice from disk)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded[...]  # `[:]` fails on 0-dim tensors


def set_weight_attrs(param: nn.Parameter, **attrs: Any) -> None:
    for key, value in attrs.items():
        assert not hasattr(param, key), f"parameter attribute {key!r} is already set"
        setattr(param, key, value)


def check_shape(
    param: nn.Parameter, loaded: LoadedWeight, expected: tuple[int, ...], shard: tuple[int, ...] | None = None
) -> None:
    """Raises ValueError naming the parameter when the checkpoint tensor doesn't have the `expected` shape."""
    got = weight_shape(loaded)
    if got != tuple(expected):
        kept = f" (this rank keeps a {list(shard)} shard of it)" if shard is not None else ""
        raise ValueError(
            f"{getattr(param, 'param_name', 'parameter')}: checkpoint tensor has shape {list(got)}, "
            f"expected {list(expected)}{kept}"
        )


def default_weight_loader(param: nn.Parameter, loaded: LoadedWeight, shard_id: ShardId = None) -> None:
    """Loader for unsharded parameters: the checkpoint tensor must match the parameter's shape."""
    assert shard_id is None, (
        f"{getattr(param, 'param_name', 'parameter')} takes no shard_id, got {shard_id!r}"
    )
    check_shape(param, loaded, tuple(param.shape))
    param.data.copy_(materialize(loaded))


class TPModule(nn.Module):
    """This layer's TP size / rank / group, and parameters that know how to load themselves."""

    def __init__(
        self,
        prefix: str,
        params_dtype: torch.dtype | None,
        comm_manager: CommManager | None = None,
        tp_group: str = "",
        transposed_on_disk: bool = False,
    ):
        super().__init__()
        self.transposed_on_disk = transposed_on_disk
        self.tp_group_name = tp_group
        self.tp_size, self.tp_rank, self.group = tp_info(comm_manager, tp_group)
        self.prefix = prefix
        self.params_dtype = params_dtype or torch.get_default_dtype()

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: ShardId = None) -> None:
        default_weight_loader(param, self._as_stored(param, loaded), shard_id)

    def _as_stored(self, param: nn.Parameter, loaded: LoadedWeight) -> LoadedWeight:
        """The checkpoint tensor laid out as param is: [out, in] for a weight the checkpoint stores [in, out]."""
        if not self.transposed_on_disk or param is not getattr(self, "weight", None):
            return loaded
        return loaded.t() if isinstance(loaded, torch.Tensor) else _TransposedSlice(loaded)

    def _add_param(self, name: str, *shape: int, dtype: torch.dtype | None = None) -> None:
        param = nn.Parameter(torch.empty(shape, dtype=dtype or self.params_dtype), requires_grad=False)
        set_weight_attrs(
            param,
            weight_loader=self.weight_loader,
            param_name=f"{self.prefix}.{name}" if self.prefix else name,
        )
        self.register_parameter(name, param)

    def _create_weights(
        self, quant_method: UnquantizedLinearMethod | None, output_size: int, input_size: int
    ) -> None:
        self.quant_method = quant_method or UNQUANTIZED
        self.quant_method.create_weights(self, output_size, input_size)

    def _add_bias(self, bias: bool, size: int) -> None:
        if bias:
            self._add_param("bias", size)
        else:
            self.register_parameter("bias", None)

    def _split(self, total: int, what: str, offset: int = 0, unit: int = 1) -> _Segment:
        """This rank's even share of `total` units of `unit` rows each, placed at `offset` in its parameter."""
        if total % self.tp_size:
            raise ConfigError(
                f"{self.prefix or type(self).__name__}: {what} ({total}) is not divisible by the "
                f"size of {self.tp_group_name} ({self.tp_size})"
            )
        size = total // self.tp_size * unit
        return _Segment(offset, size, self.tp_rank * size, total * unit)


class _TransposedSlice:
    """A lazy 2-D slice read as its transpose (rows of the view are columns on disk)."""

    def __init__(self, stored: LazySlice):
        self.stored = stored

    def get_shape(self) -> list[int]:
        return self.stored.get_shape()[::-1]

    def __getitem__(self, index: Any) -> torch.Tensor:
        if index is Ellipsis:
            return self.stored[...].t()
        rows, cols = (*(index if isinstance(index, tuple) else (index,)), slice(None), slice(None))[:2]
        return self.stored[cols, rows].t()


@dataclass(frozen=True)
class _Segment:
    """A block of rows (e.g. q, k or v): where this rank's share sits in its parameter and on disk."""

    offset: int  # first row in this rank's parameter
    size: int  # rows this rank holds
    src_start: int  # first row this rank reads from the block's checkpoint tensor (from each run's first)
    src_size: int  # rows of the whole block on disk
    runs: int = 1  # equal runs of rows on disk, of each of which this rank holds its share, in order


class ReplicatedLinear(TPModule):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
        quant_method: UnquantizedLinearMethod | None = None,
        transposed_on_disk: bool = False,
    ):
        super().__init__(prefix, params_dtype, transposed_on_disk=transposed_on_disk)
        self._create_weights(quant_method, output_size, input_size)
        self._add_bias(bias, output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(TPModule):
    """Output features split across ranks: weight [output_size / tp, input_size]."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        gather_output: bool = False,
        comm_manager: CommManager | None = None,
        tp_group: str = "dense_tp_group",
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
        quant_method: UnquantizedLinearMethod | None = None,
        transposed_on_disk: bool = False,
    ):
        super().__init__(prefix, params_dtype, comm_manager, tp_group, transposed_on_disk)
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        self.segments = self._make_segments()
        self.output_partition_sizes = [
            s.size for s in self.segments.values()
        ]  # per-rank block sizes, for split
        self.output_size_per_partition = sum(self.output_partition_sizes)
        self._create_weights(quant_method, self.output_size_per_partition, input_size)
        self._add_bias(bias, self.output_size_per_partition)

    def _make_segments(self) -> dict[ShardId, _Segment]:
        """Output blocks keyed by the shard_id that loads each one alone."""
        return {None: self._split(self.output_size, "output size")}

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: ShardId = None) -> None:
        """shard_id None: the checkpoint tensor holds every block back to back (fused on disk)."""
        loaded = self._as_stored(param, loaded)
        if shard_id is None:
            blocks = list(self.segments.values())
        elif shard_id in self.segments:
            blocks = [self.segments[shard_id]]
        else:
            raise ValueError(
                f"{param.param_name}: unknown shard_id {shard_id!r}, expected one of {list(self.segments)}"
            )
        rest = tuple(param.shape[1:])
        check_shape(
            param, loaded, (sum(b.src_size for b in blocks), *rest), (sum(b.size for b in blocks), *rest)
        )
        disk_offset = 0
        for b in blocks:
            size, run = b.size // b.runs, b.src_size // b.runs
            for i in range(b.runs):
                param.data.narrow(0, b.offset + i * size, size).copy_(
                    read_narrow(loaded, 0, disk_offset + i * run + b.src_start, size)
                )
            disk_offset += b.src_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, self.bias)
        return all_gather(out, self.group, dim=-1) if self.gather_output else out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column layers fused along the output dim (gate_up): each rank holds its share of every block."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        comm_manager: CommManager | None = None,
        tp_group: str = "dense_tp_group",
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
        quant_method: UnquantizedLinearMethod | None = None,
        transposed_on_disk: bool = False,
    ):
        self.output_sizes = list(output_sizes)
        super().__init__(
            input_size,
            sum(output_sizes),
            bias,
            False,
            comm_manager,
            tp_group,
            params_dtype,
            prefix,
            quant_method,
            transposed_on_disk,
        )

    def _make_segments(self) -> dict[ShardId, _Segment]:
        segments: dict[ShardId, _Segment] = {}
        offset = 0
        for i, size in enumerate(self.output_sizes):
            segments[i] = self._split(size, f"output_sizes[{i}]", offset)
            offset += segments[i].size
        return segments


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split by heads; rows on disk are [q; k; v].

    With tp >= num_kv_heads every rank keeps one kv head, replicated over tp / num_kv_heads consecutive ranks.
    ``head_groups`` n: the model combines head h with h + H/n (DiffLlama's two softmaxes pair the halves of the
    head axis), so each of q, k and v is split as n equal runs of heads, of each of which a rank holds its share
    in order: its local halves pair up as the whole model's do.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        comm_manager: CommManager | None = None,
        tp_group: str = "attn_tp_group",
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
        quant_method: UnquantizedLinearMethod | None = None,
        transposed_on_disk: bool = False,
        head_groups: int = 1,
    ):
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_groups = head_groups
        output_size = (total_num_heads + 2 * self.total_num_kv_heads) * head_size
        super().__init__(
            hidden_size,
            output_size,
            bias,
            False,
            comm_manager,
            tp_group,
            params_dtype,
            prefix,
            quant_method,
            transposed_on_disk,
        )
        self.q_size = self.segments["q"].size
        self.kv_size = self.segments["k"].size
        self.num_heads = self.q_size // head_size
        self.num_kv_heads = self.kv_size // head_size

    def _make_segments(self) -> dict[ShardId, _Segment]:
        tp, n, d = self.tp_size, self.head_groups, self.head_size
        where = self.prefix or type(self).__name__
        if self.total_num_heads % n or self.total_num_kv_heads % n:
            raise ConfigError(
                f"{where}: num_attention_heads ({self.total_num_heads}) and num_key_value_heads "
                f"({self.total_num_kv_heads}) must both split into the model's {n} groups of heads"
            )
        q = self._split(
            self.total_num_heads // n,
            f"num_attention_heads / {n}" if n > 1 else "num_attention_heads",
            unit=d,
        )
        kv_heads = self.total_num_kv_heads // n
        if kv_heads % tp and tp % kv_heads:
            raise ConfigError(
                f"{where}: num_key_value_heads{f' / {n}' if n > 1 else ''} ({kv_heads}) and the size "
                f"of {self.tp_group_name} ({tp}) must divide one another"
            )
        per_rank = max(kv_heads // tp, 1) * d
        first_row = self.tp_rank // max(tp // kv_heads, 1) * per_rank
        q_size, kv_size = q.size * n, per_rank * n
        return {
            "q": _Segment(0, q_size, q.src_start, q.src_size * n, n),
            "k": _Segment(q_size, kv_size, first_row, self.total_num_kv_heads * d, n),
            "v": _Segment(q_size + kv_size, kv_size, first_row, self.total_num_kv_heads * d, n),
        }


class RowParallelLinear(TPModule):
    """Input features split across ranks: weight [output_size, input_size / tp]; partial outputs are summed."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        comm_manager: CommManager | None = None,
        tp_group: str = "dense_tp_group",
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
        quant_method: UnquantizedLinearMethod | None = None,
        transposed_on_disk: bool = False,
    ):
        super().__init__(prefix, params_dtype, comm_manager, tp_group, transposed_on_disk)
        self.input_size = input_size
        self.output_size = output_size
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.shard = self._split(input_size, "input size")
        self._create_weights(quant_method, output_size, self.shard.size)
        self._add_bias(bias, output_size)

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: ShardId = None) -> None:
        """The weight, and parameters marked ``input_dim = 1`` (group scales), keep this rank's share of columns."""
        if param is not self.weight and getattr(param, "input_dim", None) != 1:
            return default_weight_loader(param, loaded, shard_id)
        loaded = self._as_stored(param, loaded)
        cols = param.shape[1]
        check_shape(param, loaded, (param.shape[0], cols * self.tp_size), tuple(param.shape))
        param.data.copy_(read_narrow(loaded, 1, self.tp_rank * cols, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = x.narrow(-1, self.shard.src_start, self.shard.size)
        out, finish = self.quant_method.apply_partial(self, x)
        if self.reduce_results:
            out, bias = finish(all_reduce(out, self.group)), self.bias
        else:  # the caller sums the partial outputs: only one rank adds the bias
            out, bias = finish(out), self.bias if self.tp_rank == 0 else None
        return out if bias is None else out + bias
