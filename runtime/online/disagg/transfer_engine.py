"""TransferEngine: how a prompt's KV goes from the prefill DP leader that computed it to the decode DP leader
that asked for it, keyed by the request's bootstrap_room. The bundled backend is ZMQ over TCP; RDMA engines
(memfabric, mooncake) plug in behind the same interface through BACKENDS."""

import logging
import pickle
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import zmq

from runtime.engine.request import TokenLogprob
from runtime.errors import UserError
from runtime.layers.request_states import RequestStates
from runtime.online.disagg.kv_pages import RequestKV

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVPayload:
    room: int
    first_token: int
    first_logprob: TokenLogprob | None
    kv: RequestKV  # all heads
    states: RequestStates | None = None  # the layers' states after the prompt (hybrids)


@dataclass(frozen=True)
class _Pull:
    room: int


class TransferEngine(ABC):
    @property
    @abstractmethod
    def address(self) -> str | None:
        """Where decode leaders reach this prefill leader (None on the decode side)."""

    @abstractmethod
    def stage(self, payload: KVPayload) -> None:
        """Prefill side: hold a request's KV until its decode leader asks (or the timeout drops it)."""

    @abstractmethod
    def fetch(self, room: int, address: str) -> None:
        """Decode side: ask the prefill leader at `address` for a room's KV."""

    @abstractmethod
    def poll(self) -> list[KVPayload]:
        """Make progress without blocking; the decode side gets the payloads that arrived."""

    @abstractmethod
    def close(self) -> None: ...


class ZmqTransferEngine(TransferEngine):
    def __init__(self, role: str, host: str, timeout_s: float):
        self.ctx, self.timeout_s, self.role = zmq.Context(), timeout_s, role
        self._staged: dict[int, tuple[KVPayload, float]] = {}
        self._wanted: dict[int, tuple[bytes, float]] = {}  # room -> (decode leader that asked, when)
        self._dealers: dict[str, zmq.Socket] = {}
        self._address = None
        if role == "prefill":
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.sndhwm = 0
            self._address = f"tcp://{host}:{self.router.bind_to_random_port(f'tcp://{host}')}"

    @property
    def address(self) -> str | None:
        return self._address

    def stage(self, payload: KVPayload) -> None:
        wanted = self._wanted.pop(payload.room, None)
        if wanted is not None:
            self.router.send_multipart([wanted[0], zmq.Frame(_dump(payload))])
        else:
            self._staged[payload.room] = (payload, time.monotonic())

    def fetch(self, room: int, address: str) -> None:
        sock = self._dealers.get(address)
        if sock is None:
            sock = self._dealers[address] = self.ctx.socket(zmq.DEALER)
            sock.connect(address)
        sock.send_pyobj(_Pull(room))

    def poll(self) -> list[KVPayload]:
        if self.role == "prefill":
            self._serve_pulls()
            return []
        arrived = []
        for sock in self._dealers.values():
            while True:
                try:
                    arrived.append(sock.recv_pyobj(zmq.NOBLOCK))
                except zmq.Again:
                    break
        return arrived

    def _serve_pulls(self) -> None:
        while True:
            try:
                identity, body = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            room = pickle.loads(body).room
            staged = self._staged.pop(room, None)
            if staged is None:
                self._wanted[room] = (identity, time.monotonic())
            else:
                self.router.send_multipart([identity, zmq.Frame(_dump(staged[0]))])
        now = time.monotonic()
        for pending, what in (
            (self._staged, "no decode instance asked for its KV"),
            (self._wanted, "its KV was never staged"),
        ):
            for room, (_, since) in list(pending.items()):
                if now - since > self.timeout_s:
                    del pending[room]
                    logger.warning("room %d: %s its KV within %.0f s; dropped", room, what, self.timeout_s)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def _dump(obj) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


BACKENDS: dict[str, type[TransferEngine]] = {"zmq": ZmqTransferEngine}


def make_transfer_engine(backend: str, role: str, host: str, timeout_s: float) -> TransferEngine:
    if backend not in BACKENDS:
        raise UserError(
            f"KV transfer backend {backend!r} is not available here (bundled: {sorted(BACKENDS)}); "
            "RDMA engines such as memfabric or mooncake plug in as a TransferEngine subclass "
            "registered in runtime.online.disagg.transfer_engine.BACKENDS"
        )
    return BACKENDS[backend](role, host, timeout_s)
