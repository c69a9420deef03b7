"""The decode instance's side of a worker. A request from the router waits (on the DP leader) until its KV
arrives from the prefill leader that owns its bootstrap_room; the leader hands the KV to its attn-TP peers
once (a KVArrived command), and every rank admits it into the running batch when there is room, writing its
own heads into fresh blocks. A request whose KV does not come within kv_timeout_s finishes with an error."""

import logging
import time
from dataclasses import dataclass

import httpx

from runtime.engine.request import StepOutput
from runtime.online.disagg.kv_pages import PagedKV
from runtime.online.disagg.transfer_engine import KVPayload, make_transfer_engine
from runtime.online.messages import AddRequest

logger = logging.getLogger(__name__)
RANK_TABLE_TIMEOUT_S = 1.0  # one try per second at most: the engine loop waits for it


@dataclass(frozen=True)
class KVArrived:
    add: AddRequest
    payload: KVPayload


@dataclass(frozen=True)
class KVFailed:
    rid: int
    reason: str


@dataclass
class _Pending:
    add: AddRequest
    deadline: float
    asked: bool = False


class DecodeSide:
    address = None  # decode leaders serve no KV

    def __init__(self, worker):
        self.worker, self.engine = worker, worker.engine
        cfg = worker.config.disagg_config
        self.default_bootstrap = f"http://{cfg.bootstrap_host}:{cfg.bootstrap_port}"
        self.timeout_s = cfg.kv_timeout_s
        self.pages = PagedKV(self.engine.worker.model, self.engine.kv)
        self.transfer = (
            make_transfer_engine(cfg.engine_backend, "decode", cfg.local_ip, cfg.kv_timeout_s)
            if worker.is_leader
            else None
        )
        self.rank_tables: dict[str, list[str]] = {}  # bootstrap URL -> KV endpoint of each prefill DP leader
        self._table_retry: dict[str, float] = {}
        self.pending: dict[int, _Pending] = {}  # leader: rid -> request whose KV has not come yet
        self.room_rid: dict[int, int] = {}
        self.ready: dict[int, KVArrived] = {}  # every rank: KV here, waiting for a batch slot or KV room

    @property
    def num_waiting(self) -> int:
        return len(self.pending) + len(self.ready)

    def take(self, add: AddRequest) -> None:
        """Leader: a request from the router; ask its prefill leader for the KV."""
        self.pending[add.rid] = _Pending(add, time.monotonic() + self.timeout_s)
        self.room_rid[add.bootstrap_room] = add.rid
        self._ask(self.pending[add.rid])

    def _bootstrap(self, add: AddRequest) -> str:
        return (add.bootstrap_url or self.default_bootstrap).rstrip("/")

    def _ask(self, p: _Pending) -> None:
        leaders = self._rank_table(self._bootstrap(p.add))
        if leaders:
            self.transfer.fetch(p.add.bootstrap_room, leaders[p.add.bootstrap_room % len(leaders)])
            p.asked = True

    def _rank_table(self, url: str) -> list[str] | None:
        if url not in self.rank_tables and time.monotonic() >= self._table_retry.get(url, 0.0):
            try:
                self.rank_tables[url] = (
                    httpx.get(f"{url}/bootstrap/rank_table", timeout=RANK_TABLE_TIMEOUT_S)
                    .raise_for_status()
                    .json()["leaders"]
                )
            except (httpx.HTTPError, ValueError, KeyError) as e:
                logger.warning("cannot read the prefill rank table at %s (%s); retrying", url, e)
                self._table_retry[url] = time.monotonic() + RANK_TABLE_TIMEOUT_S
        return self.rank_tables.get(url)

    def forget(self, rid: int) -> None:
        """Drop a request that waits for its KV or a batch slot (aborted)."""
        p = self.pending.pop(rid, None)
        if p is not None:
            self.room_rid.pop(p.add.bootstrap_room, None)
        self.ready.pop(rid, None)

    def poll(self) -> list:
        """Leader, each turn: commands for the TP group (arrived KV, requests that failed)."""
        for p in self.pending.values():
            if not p.asked:
                self._ask(p)
        commands: list = []
        for payload in self.transfer.poll():
            rid = self.room_rid.pop(payload.room, None)
            if rid in self.pending:
                commands.append(KVArrived(self.pending.pop(rid).add, payload))
        now = time.monotonic()
        for rid, p in list(self.pending.items()):
            if now > p.deadline:
                self.forget(rid)
                self.rank_tables.pop(self._bootstrap(p.add), None)  # the prefill instance may have restarted
                commands.append(KVFailed(rid, f"its KV did not arrive within {self.timeout_s:.0f} s"))
        return commands

    def apply(self, command) -> list[StepOutput]:
        """Every rank of the TP group, in the same order."""
        if isinstance(command, KVFailed):
            logger.error("request %d failed: %s", command.rid, command.reason)
            return [StepOutput(command.rid, [], True, "error")]
        add, kv = command.add, command.payload.kv
        problem = self.pages.check(kv, self.worker.tp_size)
        if problem is None and next(iter(kv.values()))[0].shape[0] != len(add.prompt_token_ids):
            problem = "the prefill instance computed KV for another prompt"
        if problem:
            logger.error("request %d failed: %s", add.rid, problem)
            return [StepOutput(add.rid, [], True, "error")]
        self.ready[add.rid] = command
        return []

    def admit_ready(self) -> list[StepOutput]:
        """Every rank, after the turn's commands: requests whose KV is here join the batch, oldest first."""
        tp, rank = self.worker.tp_size, self.worker.dist.rank % self.worker.tp_size
        outputs = []
        for rid, arrived in list(self.ready.items()):
            add, payload = arrived.add, arrived.payload
            out = self.engine.add_prefilled(
                add.prompt_token_ids,
                add.sampling,
                payload.first_token,
                lambda tables, kv=payload.kv: self.pages.write(tables, kv, tp, rank),
                payload.states,
            )
            if out is None:
                break  # no room yet; the same on every rank, so all try again next turn
            del self.ready[rid]
            self.worker.map_request(rid, out.request_id, out.finished)
            lp = (
                [payload.first_logprob]
                if payload.first_logprob and add.sampling.logprobs is not None
                else None
            )
            outputs.append(StepOutput(rid, out.new_token_ids, out.finished, out.finish_reason, lp))
        return outputs

    def on_abort(self, eid: int) -> None:
        pass

    def after_step(self, outputs: list[StepOutput]) -> None:
        pass

    def close(self) -> None:
        if self.transfer:
            self.transfer.close()
