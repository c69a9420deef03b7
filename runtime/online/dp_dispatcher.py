"""DPDispatcher: the parent's side of the ZMQ link to the DP leaders. It sends each request to the least
loaded DP group, routes step outputs back to one asyncio queue per request and keeps the workers' stats."""

import asyncio
import itertools
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from runtime.engine.request import SamplingParams, StepOutput
from runtime.online.messages import (
    AbortRequest,
    AddRequest,
    EngineStats,
    Shutdown,
    StepResult,
    WorkerAddresses,
    WorkerFailed,
    WorkerReady,
)

logger = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """The engine workers failed or went away; requests in flight cannot finish."""


class DPDispatcher:
    def __init__(self, dp_size: int, host: str = "127.0.0.1"):
        self.ctx = zmq.asyncio.Context()
        self.results = self.ctx.socket(zmq.PULL)
        port = self.results.bind_to_random_port(f"tcp://{host}")
        self.leaders = [self.ctx.socket(zmq.PUSH) for _ in range(dp_size)]
        for sock in self.leaders:
            sock.sndhwm = 0  # no send queue limit: admission (max_in_flight) bounds what can be queued
        ports = [s.bind_to_random_port(f"tcp://{host}") for s in self.leaders]
        self.addresses = WorkerAddresses([f"tcp://{host}:{p}" for p in ports], f"tcp://{host}:{port}")
        self.stats: list[EngineStats | None] = [None] * dp_size
        self.kv_addresses: list[str | None] = [None] * dp_size  # prefill leaders' KV transfer endpoints
        self.block_size = 0
        self.failure: str | None = None
        self._streams: dict[int, asyncio.Queue] = {}
        self._owner: dict[int, int] = {}  # rid -> DP rank
        self._load = [0] * dp_size
        self._reserved = 0  # admitted by the HTTP side, not yet submitted
        self._ids = itertools.count()
        self._ready = asyncio.Event()
        self._receiver: asyncio.Task | None = None

    @property
    def in_flight(self) -> int:
        return len(self._streams) + self._reserved

    def reserve(self) -> None:
        """Count a request admitted now and submitted later, so admission limits hold under bursts."""
        self._reserved += 1

    def release(self) -> None:
        """A reserved request that will never be submitted."""
        self._reserved -= 1

    async def wait_ready(self, is_alive: Callable[[], bool], timeout_s: float) -> None:
        """Wait for every DP leader's WorkerReady while the worker processes live."""
        self._receiver = asyncio.create_task(self._receive_loop())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self._ready.is_set():
            if self.failure or not is_alive():
                raise WorkerError(self.failure or "the engine workers exited before they were ready")
            if loop.time() > deadline:
                raise WorkerError(f"the engine workers were not ready after {timeout_s:.0f} s")
            try:
                await asyncio.wait_for(self._ready.wait(), 0.5)
            except asyncio.TimeoutError:  # not TimeoutError before Python 3.11
                pass

    def submit(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        bootstrap_room: int | None = None,
        bootstrap_url: str | None = None,
    ) -> tuple[int, asyncio.Queue]:
        """Send a reserved request to the least loaded DP group (DP group room % dp_size for a disaggregated
        request); its StepOutputs (or a WorkerError) arrive on the queue."""
        if self.failure:
            self._reserved -= 1
            raise WorkerError(self.failure)
        self._reserved -= 1
        rid = next(self._ids)
        dp = (
            min(range(len(self._load)), key=self._load.__getitem__)
            if bootstrap_room is None
            else bootstrap_room % len(self._load)
        )
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid], self._owner[rid] = queue, dp
        self._load[dp] += 1
        if not self._send(
            dp, AddRequest(rid, list(prompt_token_ids), sampling, bootstrap_room, bootstrap_url)
        ):
            self._forget(rid)
            raise WorkerError(f"the engine worker of DP group {dp} is not connected")
        return rid, queue

    def _send(self, dp: int, message) -> bool:
        """Queue a message for a DP leader without waiting; False when no worker is connected to take it."""
        error = self.leaders[dp].send_pyobj(message, zmq.NOBLOCK).exception()  # a finished future
        if isinstance(error, zmq.Again):
            return False
        if error is not None:
            raise error
        return True

    def abort(self, rid: int) -> None:
        """Stop a request that has not finished (its KV blocks are freed on the worker)."""
        dp = self._forget(rid)
        if dp is not None and not self.failure:
            self._send(dp, AbortRequest(rid))

    def _forget(self, rid: int) -> int | None:
        self._streams.pop(rid, None)
        dp = self._owner.pop(rid, None)
        if dp is not None:
            self._load[dp] -= 1
        return dp

    async def _receive_loop(self) -> None:
        while True:
            msg = await self.results.recv_pyobj()
            if isinstance(msg, StepResult):
                self.stats[msg.dp_rank] = msg.stats
                for out in msg.outputs:
                    self._deliver(out)
            elif isinstance(msg, WorkerReady):
                self.stats[msg.dp_rank], self.block_size = msg.stats, msg.block_size
                self.kv_addresses[msg.dp_rank] = msg.kv_address
                if all(s is not None for s in self.stats):
                    self._ready.set()
            else:
                assert isinstance(msg, WorkerFailed), f"unknown worker message {msg!r}"
                self.fail(f"engine worker of DP group {msg.dp_rank} failed: {msg.error}")

    def _deliver(self, out: StepOutput) -> None:
        queue = self._streams.get(out.request_id)
        if queue is None:
            return  # aborted meanwhile
        queue.put_nowait(out)
        if out.finished:
            self._forget(out.request_id)

    def fail(self, reason: str) -> None:
        """Fail every request in flight; later submissions fail at once."""
        if self.failure is None:
            logger.error("%s", reason)
            self.failure = reason
        for rid, queue in list(self._streams.items()):
            queue.put_nowait(WorkerError(reason))
            self._forget(rid)

    def shutdown(self) -> None:
        if not self.failure:
            for dp in range(len(self.leaders)):
                self._send(dp, Shutdown())
        if self._receiver:
            self._receiver.cancel()

    def close(self) -> None:
        self.ctx.destroy(linger=500)
