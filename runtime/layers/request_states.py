"""State that layers carry from token to token besides keys and values (a short convolution's last inputs, a
linear-attention or state-space recurrence), kept per request.

transformers' hybrid models read and write it through their cache: ``get_conv_state`` / ``update_conv_state``,
``get_recurrent_state`` / ``update_recurrent_state``, for one batch whose rows advance together. The runtime's step
packs requests of different lengths and ages, so a layer decorated with ``@per_request(states=...)`` runs once
per request of the step on that request's tokens (HF's ``[1, L, ...]``), with that request's ``RequestStates``
in place of the cache. A request's states live from its prefill (which starts them afresh, so a preempted
request recomputes them) until it finishes or is aborted (``StateStore.release``)."""

import functools
import inspect
from collections.abc import Callable, Hashable
from typing import Any

import torch

from runtime.engine.forward_metadata import ForwardMetaData
from runtime.errors import UserError


class RequestStates:
    """One request's states, by layer and state index, with the methods HF's layers call on their cache."""

    def __init__(self) -> None:
        self.conv: dict[tuple[int, int], torch.Tensor] = {}
        self.recurrent: dict[tuple[int, int], torch.Tensor] = {}
        self.conv_width: dict[tuple[int, int], int] = {}

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv.get((layer_idx, state_idx))

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        layer_idx: int,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """Keeps the last ``conv_kernel_size`` inputs (the first call's width if not given); returns the inputs a
        causal convolution of the new ones reads: the kept ones before them, or zeros for a fresh request."""
        key = (layer_idx, state_idx)
        width = self.conv_width.setdefault(key, conv_kernel_size or conv_states.shape[-1])
        previous = self.conv.get(key)
        if previous is None:
            full = torch.nn.functional.pad(conv_states, (max(width - conv_states.shape[-1], 0), 0))
        else:
            full = torch.cat([previous, conv_states], dim=-1)
        self.conv[key] = full[..., -width:].clone()
        return full

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.recurrent.get((layer_idx, state_idx))

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs
    ) -> torch.Tensor:
        self.recurrent[(layer_idx, state_idx)] = recurrent_states.clone()
        return self.recurrent[(layer_idx, state_idx)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.conv.values(), *self.recurrent.values()))

    def is_recording_past(self, layer_idx: int | None = None) -> bool:
        """The runtime never rolls a request back (no speculative tokens), so it keeps no past beyond the state."""
        return False


class _Stacked(RequestStates):
    """The states of a decode step's requests stacked along the batch (HF's ``[B, ...]`` cache rows), so that a
    layer runs once on all of them; ``unstack`` hands each request its row back. A row that has no state yet for
    a key while others do (a row padded past the batch) reads zeros; a request prefilled elsewhere is refused."""

    def __init__(self, rows: list[RequestStates]) -> None:
        super().__init__()
        for row in rows:
            if isinstance(row, _NotCarried):
                row.get_conv_state(0)  # refuses
        self.rows = rows

    def _stacked(self, kept: str, key: tuple[int, int]) -> torch.Tensor | None:
        own = getattr(self, kept)
        if key not in own:
            parts = [getattr(r, kept).get(key) for r in self.rows]
            like = next((p for p in parts if p is not None), None)
            if like is None:
                return None
            own[key] = torch.cat([torch.zeros_like(like) if p is None else p for p in parts])
            if kept == "conv":
                self.conv_width[key] = next(r.conv_width[key] for r in self.rows if key in r.conv_width)
        return own[key]

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._stacked("conv", (layer_idx, state_idx))

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        layer_idx: int,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs,
    ) -> torch.Tensor:
        self._stacked("conv", (layer_idx, state_idx))
        return super().update_conv_state(conv_states, layer_idx, state_idx, conv_kernel_size, **kwargs)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._stacked("recurrent", (layer_idx, state_idx))

    def unstack(self) -> None:
        for i, row in enumerate(self.rows):
            for key, state in self.conv.items():
                row.conv[key] = state[i : i + 1].clone()
                row.conv_width[key] = self.conv_width[key]
            for key, state in self.recurrent.items():
                row.recurrent[key] = state[i : i + 1].clone()


class _NotCarried(RequestStates):
    """The states of a request whose prefill ran elsewhere and sent none: a layer that reads them cannot go on."""

    def __init__(self, request_id: Hashable) -> None:
        super().__init__()
        self.request_id = request_id

    def _refuse(self, *args, **kwargs):
        raise UserError(
            f"request {self.request_id} was prefilled by another engine, which handed over keys and values but not "
            "the conv / recurrent states of this model's layers (an older prefill instance?); run the same "
            "version on both sides, or serve this model without prefill-decode disaggregation."
        )

    get_conv_state = update_conv_state = get_recurrent_state = update_recurrent_state = _refuse


class StateStore:
    """Every live request's ``RequestStates``, owned by the engine."""

    def __init__(self) -> None:
        self._states: dict[Hashable, RequestStates] = {}

    def for_step(self, request_ids: list[Hashable], is_prefill: bool, rows: int) -> list[RequestStates]:
        """The states of a step's rows: fresh ones for a prefill, throwaway ones for rows padded past the batch.
        A request prefilled by another engine (prefill-decode disaggregation) brought no states."""
        if is_prefill:
            self._states.update((r, RequestStates()) for r in request_ids)
        known = [self._states.get(r) or _NotCarried(r) for r in request_ids]
        return known + [RequestStates() for _ in range(rows - len(request_ids))]

    def release(self, request_id: Hashable) -> None:
        self._states.pop(request_id, None)

    def take(self, request_id: Hashable) -> "RequestStates | None":
        """A finished request's states, handed over (prefill-decode disaggregation sends them with its KV)."""
        return self._states.pop(request_id, None)

    def adopt(self, request_id: Hashable, states: RequestStates, device: torch.device) -> None:
        """The states of a request prefilled elsewhere, moved to this engine's device."""
        own = RequestStates()
        own.conv = {k: t.to(device) for k, t in states.conv.items()}
        own.recurrent = {k: t.to(device) for k, t in states.recurrent.items()}
        own.conv_width = dict(states.conv_width)
        self._states[request_id] = own

    def __len__(self) -> int:
        return len(self._states)

    def nbytes(self) -> dict[Hashable, int]:
        """Each live request's states, in bytes."""
        return {r: s.nbytes() for r, s in self._states.items()}


def _request_bounds(md: ForwardMetaData) -> list[int]:
    return md.memo("request_bounds", lambda: md.actual_seq_lengths_cu_q.tolist())


def _map_laid_out(x: Any, layout: tuple[int, int], fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """fn of each tensor laid out ``layout`` in its first two dimensions, in tuples and keyword dicts too; anything
    else as it is."""
    if isinstance(x, tuple):
        return tuple(_map_laid_out(e, layout, fn) for e in x)
    if isinstance(x, dict):
        return {k: _map_laid_out(v, layout, fn) for k, v in x.items()}
    return fn(x) if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[:2] == layout else x


def _rows(x: Any, start: int, end: int, tokens: int) -> Any:
    """A request's slice [1, start:end] of each argument laid out in HF's packed [1, T, ...]."""
    return _map_laid_out(x, (1, tokens), lambda t: t[:, start:end])


def _one_row_each(x: Any, tokens: int) -> Any:
    """Arguments laid out [1, T, ...] as [T, 1, ...]: a decode step's requests as HF's batch rows."""
    return _map_laid_out(x, (1, tokens), lambda t: t.transpose(0, 1))


def _packed(x: Any, tokens: int) -> Any:
    """Outputs [T, 1, ...] of a decode step's requests back as [1, T, ...]."""
    return _map_laid_out(x, (tokens, 1), lambda t: t.transpose(0, 1))


def _holds_tokens(x: Any, tokens: int) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[:2] == (1, tokens)


def _joined(outputs: list[Any]) -> Any:
    first = outputs[0]
    if isinstance(first, tuple):
        return tuple(_joined(list(parts)) for parts in zip(*outputs))
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs, dim=1)
    return first


def per_request(states: str) -> Callable:
    """Decorates a layer's forward that keeps state in its ``states`` parameter (HF's cache API, above): the
    forward runs once per request of the step, on that request's tokens, with its ``RequestStates`` as ``states``;
    the outputs are put back in the step's packed order."""

    def decorate(forward: Callable) -> Callable:
        signature = inspect.signature(forward)
        if "forward_metadata" in signature.parameters:
            raise UserError(
                f"{forward.__qualname__} takes forward_metadata, which describes the whole step, but runs per "
                "request under @per_request: leave the parameter out (the decorator reads the step's requests)."
            )

        @functools.wraps(forward)
        def run(self, *args, forward_metadata: ForwardMetaData, **kwargs):
            given = signature.bind(self, *args, **kwargs)
            if given.arguments.get(states) is not None:
                raise UserError(
                    f"{type(self).__name__}.forward is given `{states}`, which the runtime fills in per request: "
                    f"remove it from the call."
                )
            rows = forward_metadata.request_states
            tokens = forward_metadata.num_tokens
            if not any(_holds_tokens(v, tokens) for v in given.arguments.values()):
                raise UserError(
                    f"{type(self).__name__} keeps state per request and runs on the whole step's {tokens} tokens "
                    "laid out [1, T, ...], but none of its inputs is: a token layout split across ranks "
                    "(attention data parallelism beside dense TP) is not supported for such layers."
                )
            assert len(rows) == forward_metadata.batch_size, "the step carries one RequestStates per row"
            if not forward_metadata.is_prefill and tokens == len(rows) > 1:  # a token each: HF's [B, 1, ...]
                call = signature.bind(self, *_one_row_each(args, tokens), **_one_row_each(kwargs, tokens))
                call.arguments[states] = stacked = _Stacked(rows)
                out = forward(*call.args, **call.kwargs)
                stacked.unstack()
                return _packed(out, tokens)
            bounds = _request_bounds(forward_metadata)
            outputs = []
            for request, start, end in zip(rows, bounds, bounds[1:]):
                call = signature.bind(
                    self, *_rows(args, start, end, tokens), **_rows(kwargs, start, end, tokens)
                )
                call.arguments[states] = request
                outputs.append(forward(*call.args, **call.kwargs))
            return _joined(outputs)

        return run

    return decorate
