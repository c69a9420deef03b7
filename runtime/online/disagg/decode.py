"""The decode instance's side of a worker. A request from the router waits (on the DP leader) until its KV
arrives from the prefill leader that owns its bootstrap_room; the leader then hands it to its attn-TP peers
as a KVArrived command and every rank writes its heads into fresh blocks and lets it join the running batch.
A request whose KV does not come within kv_timeout_s finishes with an error."""
import logging
import time
from dataclasses import dataclass

import httpx

from runtime.engine.request import StepOutput
from runtime.online.disagg.kv_pages import PagedKV
from runtime.online.disagg.transfer_engine import KVPayload, make_transfer_engine
from runtime.online.messages import AddRequest

logger = logging.getLogger(__name__)
RANK_TABLE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class KVArrived:
    add: AddRequest
    payload: KVPayload


@dataclass(frozen=True)
class KVFailed:
    rid: int
    reason: str


class DecodeSide:
    def __init__(self, worker):
        self.worker, self.engine = worker, worker.engine
        cfg = worker.config.disagg_config
        self.bootstrap = f"http://{cfg.bootstrap_host}:{cfg.bootstrap_port}"
        self.timeout_s = cfg.kv_timeout_s
        self.pages = PagedKV(self.engine.worker.model, self.engine.kv)
        self.transfer = (make_transfer_engine(cfg.engine_backend, "decode", cfg.local_ip, cfg.kv_timeout_s)
                         if worker.is_leader else None)
        self.rank_table: dict | None = None
        self.pending: dict[int, tuple[AddRequest, float]] = {}  # rid -> (request, deadline): KV not here yet
        self.ready: dict[int, KVArrived] = {}  # KV here, waiting for a batch slot or KV room
        self.room_rid: dict[int, int] = {}

    address = None

    @property
    def waiting(self) -> bool:
        return bool(self.pending or self.ready)

    def take(self, add: AddRequest) -> None:
        """Leader: a request from the router; ask its prefill leader for the KV."""
        self.pending[add.rid] = (add, time.monotonic() + self.timeout_s)
        self.room_rid[add.bootstrap_room] = add.rid
        address = self._prefill_leader(add.bootstrap_room)
        if address:
            self.transfer.fetch(add.bootstrap_room, address)

    def _prefill_leader(self, room: int) -> str | None:
        if self.rank_table is None:
            try:
                self.rank_table = httpx.get(f"{self.bootstrap}/bootstrap/rank_table",
                                            timeout=RANK_TABLE_TIMEOUT_S).json()
            except (httpx.HTTPError, ValueError) as e:
                logger.error("cannot read the prefill rank table at %s: %s", self.bootstrap, e)
                return None
        leaders = self.rank_table["leaders"]
        return leaders[room % len(leaders)]

    def forget(self, rid: int) -> None:
        """Leader: drop a request that waits for its KV (aborted or failed)."""
        entry = self.pending.pop(rid, None)
        add = entry[0] if entry else self.ready.pop(rid).add if rid in self.ready else None
        if add is not None:
            self.room_rid.pop(add.bootstrap_room, None)

    def poll(self) -> list:
        """Leader, each turn: commands for the TP group (requests whose KV is here, requests that failed)."""
        for payload in self.transfer.poll():
            rid = self.room_rid.pop(payload.room, None)
            if rid in self.pending:
                self.ready[rid] = KVArrived(self.pending.pop(rid)[0], payload)
        now = time.monotonic()
        failed = [KVFailed(rid, f"the KV of this request did not arrive from the prefill instance within "
                                f"{self.timeout_s:.0f} s") for rid, (_, deadline) in self.pending.items()
                  if now > deadline]
        for f in failed:
            self.forget(f.rid)
        return [*self.ready.values(), *failed]

    def apply(self, command) -> list[StepOutput]:
        """Every rank of the TP group, in the same order."""
        if isinstance(command, KVFailed):
            return [StepOutput(command.rid, [], True, "error")]
        add, payload = command.add, command.payload
        tp, rank = self.worker.tp_size, self.worker.dist.rank % self.worker.tp_size
        problem = self.pages.check(payload.kv, tp)
        if problem is None and next(iter(payload.kv.values()))[0].shape[0] != len(add.prompt_token_ids):
            problem = "the prefill instance computed KV for another prompt"
        if problem:
            logger.error("request %d: %s", add.rid, problem)
            self.ready.pop(add.rid, None)
            return [StepOutput(add.rid, [], True, "error")]
        out = self.engine.add_prefilled(add.prompt_token_ids, add.sampling, payload.first_token,
                                        lambda tables: self.pages.write(tables, payload.kv, tp, rank))
        if out is None:
            return []  # no room yet: the leader offers it again next turn
        self.ready.pop(add.rid, None)
        self.worker.map_request(add.rid, out.request_id, out.finished)
        lp = [payload.first_logprob] if payload.first_logprob and add.sampling.logprobs is not None else None
        return [StepOutput(add.rid, out.new_token_ids, out.finished, out.finish_reason, lp)]

    def on_add(self, eid: int, room: int | None) -> None:
        pass

    def after_step(self, outputs: list[StepOutput]) -> None:
        pass

    def close(self) -> None:
        if self.transfer:
            self.transfer.close()
