"""The prefill instance's side of a worker: after each step, finished requests' KV is copied out of the
cache (gathered from the attn-TP ranks into all heads), staged for the decode leader, and its blocks freed."""

import torch.distributed as dist

from runtime.engine.request import StepOutput
from runtime.errors import UserError
from runtime.online.disagg.kv_pages import PagedKV, merge_heads
from runtime.online.disagg.transfer_engine import KVPayload, make_transfer_engine


def total_kv_heads(hf_config, local: dict[str, int], tp: int) -> dict[str, int]:
    """Each layer's KV heads before sharding (from the model config), checked against what this rank holds."""
    if tp == 1:
        return dict(local)
    total = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    for name, heads in local.items():
        if heads != max(total // tp, 1):
            raise UserError(
                f"{name} holds {heads} KV heads on each of {tp} ranks, which does not match the "
                f"model's {total}; prefill-decode transfer cannot re-shard this model's KV"
            )
    return dict.fromkeys(local, total)


class PrefillSide:
    def __init__(self, worker):
        self.worker, self.engine = worker, worker.engine
        cfg = worker.config.disagg_config
        self.pages = PagedKV(self.engine.worker.model, self.engine.kv)
        self.total_heads = total_kv_heads(
            self.engine.worker.hf_config, self.pages.local_heads(), worker.tp_size
        )
        self.transfer = (
            make_transfer_engine(cfg.engine_backend, "prefill", cfg.local_ip, cfg.kv_timeout_s)
            if worker.is_leader
            else None
        )
        self.rooms: dict[int, int] = {}  # engine request id -> bootstrap_room

    @property
    def address(self) -> str | None:
        return self.transfer.address if self.transfer else None

    num_waiting = 0  # nothing arrives from elsewhere

    def on_add(self, eid: int, room: int | None) -> None:
        if room is None:
            raise ValueError("a prefill instance takes requests from the router only (no bootstrap_room)")
        self.rooms[eid] = room

    def on_abort(self, eid: int) -> None:
        self.rooms.pop(eid, None)

    def admit_ready(self) -> list[StepOutput]:
        return []

    def after_step(self, outputs: list[StepOutput]) -> None:
        """On every rank, in the same order: stage and free what finished this step."""
        logprobs = {o.request_id: o.logprobs[0] if o.logprobs else None for o in outputs}
        for request in self.engine.scheduler.take_held():
            tables = self.engine.kv.block_tables([request.request_id])
            local = self.pages.read(tables, len(request.prompt_token_ids))
            if self.worker.tp_group is not None:
                gathered = [None] * self.worker.tp_size if self.worker.is_leader else None
                dist.gather_object(local, gathered, dst=self.worker.tp_leader, group=self.worker.tp_group)
                local = merge_heads(gathered, self.total_heads) if self.worker.is_leader else None
            self.engine.kv.free(request.request_id)
            states = self.engine.states.take(request.request_id)  # every rank's are whole and alike
            room = self.rooms.pop(request.request_id)
            if self.transfer:
                first, lp = request.output_token_ids[0], logprobs.get(request.request_id)
                self.transfer.stage(KVPayload(room, first, lp, local, states))

    def poll(self) -> list:
        if self.transfer:
            self.transfer.poll()
        return []

    def close(self) -> None:
        if self.transfer:
            self.transfer.close()
