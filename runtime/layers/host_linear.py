"""Linear layers on the host, faster than ``F.linear``'s.

Where oneDNN prepacks 16-bit weights (AVX-512 or AVX-NE-CONVERT), they are reordered once, after loading:
``F.linear`` on a CPU bf16 weight re-lays the weight out on every call, and oneDNN's prepacked form skips that
(measured on the bench's decode1: the GEMV work drops by about a third, results bit-identical). They are laid
out for long inputs where that costs one-row products nothing on this host (``pack_rows``, timed once per
process): a layout for one row can make long prefills much slower (2.9x for one weight shape on a Xeon with
AMX). From ``FLOAT32_ROWS`` rows on (long prefills) the product may run in float32 instead, where that is
measurably faster on this host (``float32_pays``, timed once per process), since which path wins differs between
hosts:
on an Intel Xeon with AVX512_BF16 MKL's float32 GEMM did about 290 GFLOP/s against oneDNN bf16's 170 (a
4096-row prefill GEMM: 90 -> 69 ms in float32); on an AMD EPYC with AVX512_BF16 float32 does 120-150 GFLOP/s
and oneDNN bf16 330-380.

Elsewhere (AVX2 hosts), ``F.linear`` in bf16 costs about the same per row at any row count (a [1536, 576] weight:
98 us for one row, 46 ms for 512). Up to ``KERNEL_ROWS`` rows the host C++ kernel reads the weight once in its
own format (40 us for one row, 0.5 ms for 16); above, the product runs in float32 (5.4 ms for 512 rows, weight
converted each call).

The kernel can also beat the library where it has one (``kernel_beats_library``, timed once per process), and
then runs the decode rows of an engine (``swap_host_linears``' ``decode_rows``), the library the longer inputs.
On an AMD EPYC with AVX512_BF16, 2 threads, the 30 layers of a SmolLM2 decode step took: in float32, 7.9 ms
against MKL's 23.7 ms for one row (and no more than MKL's up to 64 rows); in bf16 (AVX512_BF16 dot products), 4.0
against 5.3 ms for oneDNN's prepacked products, but 6.4 against 5.9 ms at 4 rows, so 16-bit weights keep their own
layout only for engines whose decode steps have at most ``SMALL_BATCH`` rows, and are packed for larger batches.
"""

import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from runtime.kernels import KERNEL_ROWS, host_linear_kernel

FLOAT32_ROWS = 1024
FLOAT32_MARGIN = 1.25  # float32 must be this much faster: a close call keeps one path for every row count
PACK_ROWS = 4096  # the long-input layout of packed weights (prefill), where it costs one-row products nothing
ONE_ROW_TOLERANCE = 1.05
SMALL_BATCH = 2  # decode rows up to which the host kernel may take the place of prepacked 16-bit weights
KERNEL_MARGIN = 1.1  # the kernel must be this much faster at one row: a close call keeps oneDNN


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this host's oneDNN prepacks ``dtype`` weights: it needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT;
    on an AVX2-only CPU the reorder raises, and the linears stay ``nn.Linear``."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in oneDNN's blocked layout (where ``onednn_packs`` its dtype), laid out for
    ``pack_rows`` rows."""
    return _reorder(weight, pack_rows(weight.dtype))


def _reorder(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


@functools.cache
def pack_rows(dtype: torch.dtype) -> int:
    """The rows oneDNN lays packed ``dtype`` weights out for (its reorder's batch-size hint): PACK_ROWS, unless
    that layout makes one-row products (decode) more than ONE_ROW_TOLERANCE times slower than the one-row layout,
    timed once per process with its threads on eight [1024, 1024] weights (16 MB, beyond the L2 cache, as a
    decode step's weights are). On a Xeon with AMX the one-row layout made 4096-row products of a [960, 576]
    weight 2.9x slower (5.05 against 1.75 ms), with one-row products no faster."""
    values = torch.Generator().manual_seed(0)  # leaves the global RNG as it was
    weights = [torch.randn(1024, 1024, generator=values).to(dtype) for _ in range(8)]
    x = torch.randn(1, 1024, generator=values).to(dtype)

    def one_row_time(rows: int) -> float:
        packed = [_reorder(w, rows) for w in weights]
        return _best_time(_onednn_product, x, packed)

    return PACK_ROWS if one_row_time(PACK_ROWS) <= ONE_ROW_TOLERANCE * one_row_time(1) else 1


def _best_time(product: Callable, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """The shortest of three passes of ``product`` over ``weights``, after one warm-up pass (oneDNN picks its
    kernel on first use)."""
    times = []
    for _ in range(4):
        start = time.perf_counter()
        for weight in weights:
            product(x, weight, None)
        times.append(time.perf_counter() - start)
    return min(times[1:])


@functools.cache
def kernel_beats_library(dtype: torch.dtype) -> bool:
    """Whether the host kernel's one-row products with ``dtype`` weights run KERNEL_MARGIN times faster than the
    library's (oneDNN's prepacked ones where it packs ``dtype``, ``F.linear`` elsewhere), timed once per process
    with its threads on 64 MB of [1024, 1024] weights (read from memory, as a decode step's weights are)."""
    kernel = host_linear_kernel()
    if kernel is None:
        return False
    values = torch.Generator().manual_seed(0)  # leaves the global RNG as it was
    count = (64 << 20) // (1024 * 1024 * dtype.itemsize)
    weights = [torch.randn(1024, 1024, generator=values).to(dtype) for _ in range(count)]
    x = torch.randn(1, 1024, generator=values).to(dtype)
    if onednn_packs(dtype):
        library, library_weights = _onednn_product, [pack_weight(w) for w in weights]
    else:
        library, library_weights = F.linear, weights
    kernel_time = _best_time(kernel.float_linear, x, weights)
    return kernel_time * KERNEL_MARGIN < _best_time(library, x, library_weights)


def _kernel_serves(dtype: torch.dtype, compiled: bool, decode_rows: int | None) -> bool:
    """Whether the host kernel takes the library's place for an engine whose decode steps have at most
    ``decode_rows`` rows: float32 weights wherever it wins at one row (a compiled step calls it at any row count,
    so there up to KERNEL_ROWS), 16-bit ones where oneDNN would pack them, for up to SMALL_BATCH rows."""
    if decode_rows is None or host_linear_kernel() is None:
        return False
    if dtype == torch.float32:
        most = KERNEL_ROWS if compiled else decode_rows
    elif onednn_packs(dtype):
        most = SMALL_BATCH
    else:
        return False
    return decode_rows <= most and kernel_beats_library(dtype)


def _float32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` computed in float32 and rounded once to x's dtype."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


def _float32_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _float32_linear(x, packed.to_dense(), bias)


def _onednn_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if torch.compiler.is_compiling():  # inductor cannot lower mkldnn's operator on a weight packed beforehand
        return torch.ops.skill.onednn_linear(x, packed, bias)  # host_linear_kernel's (swap_host_linears)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@functools.cache
def float32_pays(dtype: torch.dtype) -> bool:
    """Whether a FLOAT32_ROWS-row product with a packed ``dtype`` weight runs FLOAT32_MARGIN times faster in
    float32 (weight unpacked and converted per call, as ``packed_linear`` does) than in oneDNN, timed once per
    process on a [1024, 1024] weight with this process's threads (about 0.1 s)."""
    values = torch.Generator().manual_seed(0)  # leaves the global RNG as it was
    x = torch.randn(FLOAT32_ROWS, 1024, generator=values).to(dtype)
    packed = [pack_weight(torch.randn(1024, 1024, generator=values).to(dtype))]
    return _best_time(_float32_product, x, packed) * FLOAT32_MARGIN < _best_time(_onednn_product, x, packed)


def _long_input_in_float32(rows: int, dtype: torch.dtype) -> bool:
    """Whether a product of ``rows`` rows with a 16-bit weight runs in float32 (``float32_pays``)."""
    return rows >= FLOAT32_ROWS and float32_pays(dtype)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """``F.linear`` with a ``pack_weight`` weight: oneDNN, or float32 from FLOAT32_ROWS rows where that pays."""
    rows = x.reshape(-1, x.shape[-1])
    if _long_input_in_float32(rows.shape[0], x.dtype):
        out = _float32_product(rows, packed, bias)
    else:
        out = _onednn_product(rows, packed, bias)
    return out.view(*x.shape[:-1], out_features)


class HostPackedLinear(nn.Module):
    """Inference-only stand-in for an ``nn.Linear`` whose weight lives in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack_weight(linear.weight)
        self.bias = linear.bias
        self._meta = torch.empty(linear.weight.shape, dtype=linear.weight.dtype, device="meta")

    @property
    def weight(self) -> torch.Tensor:
        """Shape and dtype of the original weight (on the meta device: the values live in ``packed``)."""
        return self._meta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


@functools.cache
def _kernel_dtype(dtype: torch.dtype) -> bool:
    return (
        dtype in (torch.bfloat16, torch.float16)
        and not onednn_packs(dtype)
        and host_linear_kernel() is not None
    )


def kernel_applies(weight: torch.Tensor) -> bool:
    """Whether ``host_linear`` beats ``F.linear`` for this weight: 16-bit, on a host oneDNN cannot prepack it for."""
    return (
        not torch.compiler.is_compiling()  # first: a graph must not trace the checks below (mkldnn's query breaks it)
        and weight.device.type == "cpu"
        and _kernel_dtype(weight.dtype)
        and weight.is_contiguous()
    )


def host_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` where ``kernel_applies`` or ``swap_host_linears`` chose the kernel: the host kernel up to
    KERNEL_ROWS rows (and in a compiled decode step); above them oneDNN's product where it runs 16-bit weights
    natively (in float32 from FLOAT32_ROWS rows where ``float32_pays``), float32 elsewhere, which is F.linear for a
    float32 weight (all sum in float32 and round the output once)."""
    rows = x.reshape(-1, weight.shape[1])
    if torch.compiler.is_compiling():
        out = torch.ops.skill.float_linear(rows, weight, bias)
    elif rows.shape[0] <= KERNEL_ROWS:
        out = host_linear_kernel().float_linear(rows, weight, bias)
    elif onednn_packs(weight.dtype) and not _long_input_in_float32(rows.shape[0], weight.dtype):
        out = F.linear(rows, weight, bias)
    else:
        out = _float32_linear(rows, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


class HostKernelLinear(nn.Module):
    """An ``nn.Linear`` (its weight shared, so a tied head stays tied) that ``host_linear`` applies: decode rows
    through the host kernel, longer inputs through the library or in float32."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return host_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def swap_host_linears(
    model: nn.Module, compiled: bool = False, decode_rows: int | None = None
) -> tuple[int, str]:
    """Swap every plain ``nn.Linear`` of a host model for a ``HostKernelLinear`` where the host kernel serves an
    engine whose decode steps have at most ``decode_rows`` rows (None: unknown) or oneDNN cannot prepack 16-bit
    weights, else for a ``HostPackedLinear`` where oneDNN packs them; the runtime's unquantized parallel linears
    are marked for the kernel (``host_kernel``) or packed (``pack_parallel_linear``) the same way. Returns how
    many layers and which path. For a model that runs ``compiled`` only the kernel's and oneDNN's operators
    apply.

    A weight another module shares (the embedding of a tied LM head) is packed too: the packed copy costs its
    size once more in memory and saves about 2 ms of the 3.4 ms SmolLM2's head takes per decode step."""
    first = next(model.parameters(), None)
    if first is None or first.device.type != "cpu" or not first.is_floating_point():
        return 0, ""
    dtype = first.dtype
    if _kernel_serves(dtype, compiled, decode_rows):
        library = "oneDNN's prepacked products" if onednn_packs(dtype) else "F.linear"
        kind, what = (
            HostKernelLinear,
            f"the host kernel up to {KERNEL_ROWS} rows (faster than {library} here), F.linear above",
        )
    elif onednn_packs(dtype) and not (compiled and host_linear_kernel() is None):
        kind, what = HostPackedLinear, "oneDNN with prepacked weights"
        if float32_pays(dtype):
            what += f", float32 from {FLOAT32_ROWS} rows (faster on this host)"
    elif kernel_applies(first) and not compiled:
        kind, what = HostKernelLinear, f"the host kernel up to {KERNEL_ROWS} rows, float32 above"
    else:
        return 0, ""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.dtype == dtype and child.weight.is_contiguous()
    ]
    for parent, name, child in swaps:
        setattr(parent, name, kind(child))
    parallel = [m for m in model.modules() if _unquantized_parallel(m, dtype)]
    for layer in parallel:
        if kind is HostPackedLinear:
            pack_parallel_linear(layer)
        else:
            layer.host_kernel = True
    return len(swaps) + len(parallel), what


def _unquantized_parallel(module: nn.Module, dtype: torch.dtype) -> bool:
    method, weight = getattr(module, "quant_method", None), getattr(module, "weight", None)
    return (
        getattr(method, "name", None) == "none"
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 2
        and weight.dtype == dtype
        and weight.is_contiguous()  # the host kernel reads rows in place
    )


def pack_parallel_linear(layer: nn.Module) -> None:
    """A parallel linear's weight in oneDNN's layout (``packed_weight``, which the unquantized ``apply`` reads);
    ``weight`` keeps its shape and dtype on the meta device, as ``HostPackedLinear``'s does."""
    weight = layer.weight
    layer.packed_weight = pack_weight(weight)
    layer.weight = nn.Parameter(
        torch.empty(weight.shape, dtype=weight.dtype, device="meta"), requires_grad=False
    )
