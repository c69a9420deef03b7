"""The worker side of `skill serve`: every rank runs the engine loop; DP leaders talk ZMQ to the parent.

Each loop turn a DP leader drains its request queue, the DP leaders agree over `dp_leader_group` whether any
of them has work (attention-DP ranks step in lock-step) or must stop, and each leader broadcasts the commands
and that verdict to its attn-TP peers over `tp_cpu_group`. Then every rank steps (a dummy step when idle in
lock-step) and the leader sends the step's outputs back. With prefill-decode disaggregation a PrefillSide or
DecodeSide adds the KV hand-over to the turn.
"""

import argparse
import dataclasses
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import zmq

from runtime.config import DisaggConfig
from runtime.distributed import leave_worker
from runtime.engine.request import StepOutput
from runtime.engine.scheduler import Scheduler
from runtime.logging_config import setup_logging
from runtime.offline import OfflineInference
from runtime.online.disagg.decode import DecodeSide, KVArrived, KVFailed
from runtime.online.disagg.prefill import PrefillSide
from runtime.online.disagg.schedulers import PrefillDisaggScheduler
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
from runtime.online.serving_config import serving_config

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50  # how long an idle leader waits for a request before the next turn (one DP group)
BUSY_POLL_MS = 2  # the same with several DP groups (their leaders meet every turn) or KV on its way
PARENT_CHECK_S = 1.0
SIDES = {"PREFILL": (PrefillSide, PrefillDisaggScheduler), "DECODE": (DecodeSide, Scheduler)}


class OnlineInference(OfflineInference):
    def __init__(
        self, config, model_dir: Path, addresses: WorkerAddresses | None, parent_pid: int | None = None
    ):
        """`addresses` on global rank 0 at least: ranks of other nodes take them from it."""
        side_cls, scheduler_cls = SIDES.get(config.disagg_config.disaggregation_mode, (None, Scheduler))
        super().__init__(config, model_dir, scheduler_cls)
        self.parent_pid, self._parent_checked = parent_pid, time.monotonic()
        self.tp_size = tp = config.parallel_config.attn_tp_size
        self.dp_rank, self.is_leader = self.dist.rank // tp, self.dist.rank % tp == 0
        self.tp_group = self.dp_group = None
        cm = self.engine.worker.comm_manager
        if self.dist.world_size > 1:
            cm.init_cpu_groups(tp)
            self.tp_group, self.dp_group = cm.get_group("tp_cpu_group"), cm.get_group("dp_leader_group")
            self.tp_leader = cm.get_ranks("tp_cpu_group")[0]
        self.engine_ids: dict[int, int] = {}  # parent rid -> engine request id
        self.rids: dict[int, int] = {}  # engine request id -> parent rid
        self.side = side_cls(self) if side_cls else None
        if self.dist.world_size > 1:
            box = [addresses]
            dist.broadcast_object_list(box, src=0)
            addresses = box[0]
        self.ctx = zmq.Context()
        if self.is_leader:
            self.inbox = self.ctx.socket(zmq.PULL)
            self.inbox.connect(addresses.requests[self.dp_rank])
            self.outbox = self.ctx.socket(zmq.PUSH)
            self.outbox.sndhwm = 0  # never drop a step's tokens while the server is there
            self.outbox.connect(addresses.results)
            self._send(
                WorkerReady(
                    self.dp_rank,
                    self.engine_stats(),
                    self.engine.kv.block_size,
                    self.side.address if self.side else None,
                )
            )

    def engine_stats(self) -> EngineStats:
        kv, sched = self.engine.kv.stats(), self.engine.scheduler
        waiting = len(sched.waiting) + (self.side.num_waiting if self.side else 0)
        return EngineStats(len(sched.running), waiting, kv["used_blocks"], kv["num_blocks"])

    def _send(self, message) -> None:
        """To the server, without blocking: with no server connected (it was killed) the message is dropped."""
        try:
            self.outbox.send_pyobj(message, zmq.NOBLOCK)
        except zmq.Again:
            pass

    def map_request(self, rid: int, eid: int, finished: bool) -> None:
        if not finished:
            self.engine_ids[rid], self.rids[eid] = eid, rid

    def _receive(self, wait_ms: int) -> list:
        commands = []
        if self.inbox.poll(wait_ms):
            while True:
                try:
                    commands.append(self.inbox.recv_pyobj(zmq.NOBLOCK))
                except zmq.Again:
                    return commands
        return commands

    def _apply(self, commands: list) -> tuple[bool, list[StepOutput]]:
        """Apply the turn's commands; (a command asks to stop, outputs they produced)."""
        stop, outputs = False, []
        for c in commands:
            if isinstance(c, AddRequest) and isinstance(self.side, DecodeSide):
                if self.is_leader:
                    self.side.take(c)  # runs once its KV is here (KVArrived)
            elif isinstance(c, AddRequest):
                eid = self.engine.add_request(c.prompt_token_ids, c.sampling)
                self.map_request(c.rid, eid, False)
                if self.side:
                    self.side.on_add(eid, c.bootstrap_room)
            elif isinstance(c, AbortRequest):
                eid = self.engine_ids.pop(c.rid, None)
                if eid is not None:
                    self.engine.abort(eid)
                    del self.rids[eid]
                    if self.side:
                        self.side.on_abort(eid)
                elif isinstance(self.side, DecodeSide):
                    self.side.forget(c.rid)  # still waiting for its KV or a batch slot
            elif isinstance(c, (KVArrived, KVFailed)):
                outputs += self.side.apply(c)
            else:
                assert isinstance(c, Shutdown), f"unknown command {c!r}"
                stop = True
        return stop, outputs

    def _wait_ms(self, idle: bool) -> int:
        if not idle:
            return 0
        return (
            BUSY_POLL_MS
            if self.dp_group is not None or (self.side and self.side.num_waiting)
            else IDLE_POLL_MS
        )

    def _turn(self, idle: bool) -> tuple[list, list[StepOutput], bool, bool]:
        """This turn's commands, the outputs they produced and the agreed (busy, stop)."""
        commands, outputs, busy, stop = [], [], False, False
        if self.is_leader:
            commands = self._receive(self._wait_ms(idle))
            stop, outputs = self._apply(commands)
            if self.side is not None:
                extra = self.side.poll()
                outputs += self._apply(extra)[1] + self.side.admit_ready()
                commands += extra
            stop = stop or not self._parent_alive()
            busy = self.engine.has_unfinished()
            if self.dp_group is not None:
                flags = torch.tensor([int(busy), int(stop)])
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.dp_group)
                busy, stop = bool(flags[0]), bool(flags[1])
        if self.tp_group is not None:
            box = [(commands, busy, stop)]
            dist.broadcast_object_list(box, src=self.tp_leader, group=self.tp_group)
            commands, busy, stop = box[0]
            if not self.is_leader:
                self._apply(commands)
                if self.side is not None:
                    self.side.admit_ready()  # what the leader admitted before broadcasting
        return commands, outputs, busy, stop

    def _parent_alive(self) -> bool:
        """False once the server process is gone (killed without a chance to stop its workers)."""
        if self.parent_pid is None or time.monotonic() - self._parent_checked < PARENT_CHECK_S:
            return True
        self._parent_checked = time.monotonic()
        try:
            os.kill(self.parent_pid, 0)
        except ProcessLookupError:
            logger.error("the server process %d is gone; stopping", self.parent_pid)
            return False
        return True

    def serve_forever(self) -> None:
        idle = True
        while True:
            commands, outputs, busy, stop = self._turn(idle)
            if stop:
                return
            stepped = self.engine.step() if busy else []
            if self.side is not None:
                self.side.after_step(stepped)
            outputs += self._to_parent(stepped)
            idle = not busy
            if self.is_leader and (outputs or commands):
                self._send(StepResult(self.dp_rank, outputs, self.engine_stats()))

    def _to_parent(self, outputs: list[StepOutput]) -> list[StepOutput]:
        mine = []
        for out in outputs:
            rid = self.rids[out.request_id]
            if out.finished:
                del self.rids[out.request_id], self.engine_ids[rid]
            mine.append(dataclasses.replace(out, request_id=rid))
        return mine

    def report_failure(self, error: BaseException) -> None:
        if self.is_leader:
            self._send(WorkerFailed(self.dp_rank, f"{type(error).__name__}: {error}"))

    def close(self) -> None:
        if self.side is not None:
            self.side.close()
        self.ctx.destroy(linger=1000)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="An engine worker of `skill serve` (launched by the server)."
    )
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--yaml", type=Path, required=True)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--requests", help="comma-separated ZMQ endpoints, one per DP leader (node 0 only)")
    parser.add_argument("--results")
    parser.add_argument("--parent-pid", type=int, help="stop when this process (the server) is gone")
    parser.add_argument("--disagg", help="DisaggConfig as JSON (prefill-decode disaggregation)")
    args = parser.parse_args(argv)
    config = serving_config(args.yaml, args.max_model_len)
    if args.disagg:
        config.disagg_config = DisaggConfig.model_validate_json(args.disagg)
    addresses = WorkerAddresses(args.requests.split(","), args.results) if args.requests else None
    setup_logging()
    worker = OnlineInference(config, args.model_dir, addresses, args.parent_pid)
    logging.getLogger("runtime.engine.execution_engine").setLevel(logging.WARNING)  # no line per step
    try:
        worker.serve_forever()
    except BaseException as e:
        worker.report_failure(e)
        raise
    finally:
        worker.close()
    leave_worker()


if __name__ == "__main__":
    main()
