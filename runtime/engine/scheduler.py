"""Continuous batching: prefill first (under a token budget), else one decode step of every running request."""

import logging
from collections import deque
from typing import Protocol

from runtime.engine.request import Batch, Request, Status
from runtime.engine.stopping import finish_reason
from runtime.errors import UserError

logger = logging.getLogger(__name__)


class SlotAllocator(Protocol):
    def allocate_slots(
        self, request_id, computed_tokens: int, num_new_tokens: int, lookahead_tokens: int = 0
    ) -> bool: ...

    def free(self, request_id) -> None: ...


class Scheduler:
    def __init__(
        self,
        kv: SlotAllocator,
        max_batch_size: int,
        max_prefill_tokens: int = 0,
        eos_token_ids: tuple[int, ...] = (),
    ):
        self.kv = kv
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens  # 0 = no limit
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch | None:
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self) -> Batch | None:
        batch: list[Request] = []
        tokens = 0
        while self.waiting and len(self.running) + len(batch) < self.max_batch_size:
            request = self.waiting[0]
            n = request.num_tokens
            if batch and self.max_prefill_tokens and tokens + n > self.max_prefill_tokens:
                break
            if not self.kv.allocate_slots(request.request_id, 0, n):
                if not batch and not self.running:
                    raise UserError(
                        f"request {request.request_id} needs KV space for {n} tokens, more than the whole "
                        "KV cache holds; raise scheduler_config.num_kv_blocks (or block_size) or lower "
                        "data_config.input_truncated_len / scheduler_config.max_new_tokens"
                    )
                break
            self.waiting.popleft()
            request.status = Status.RUNNING
            batch.append(request)
            tokens += n
        if not batch:
            return None
        self.running.extend(batch)
        return Batch(batch, is_prefill=True)

    def _schedule_decode(self) -> Batch | None:
        scheduled: list[Request] = []
        for request in list(self.running):
            if request.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            while not self.kv.allocate_slots(request.request_id, request.computed_len, 1):
                victim = self.running[-1]  # the newest request gives its blocks back
                self._preempt(victim)
                if victim is request:
                    break
            else:
                scheduled.append(request)
        if not scheduled:  # everything was preempted: re-admit (or report a request that can never fit)
            return self._schedule_prefill()
        return Batch(scheduled, is_prefill=False)

    def abort(self, request: Request) -> None:
        """Take a request out of the queue or the running batch, freeing its KV blocks at once."""
        if request.status is Status.FINISHED:
            return
        if request.status is Status.RUNNING:
            self.running.remove(request)
            self.kv.free(request.request_id)
        else:
            self.waiting.remove(request)
        request.finish_reason, request.status = "abort", Status.FINISHED

    def _preempt(self, request: Request) -> None:
        """Free the request's KV and queue it for recomputation from its tokens so far."""
        self.kv.free(request.request_id)
        self.running.remove(request)
        request.status = Status.WAITING
        request.computed_len = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.info("preempted request %s (KV cache full); it will be recomputed", request.request_id)

    def process_batch_output(self, batch: Batch, next_tokens: list[int]) -> list[Request]:
        batch.update_requests_from_batch(next_tokens)
        return [request for request in batch.requests if self.finish_if_done(request)]

    def admit_running(self, request: Request) -> bool:
        """A request whose prompt KV was computed elsewhere (and whose first token is in output_token_ids)
        joins the running batch; False while there is no batch slot or KV room for it."""
        n = len(request.prompt_token_ids)
        if len(self.running) >= self.max_batch_size or not self.kv.allocate_slots(request.request_id, 0, n):
            return False
        request.computed_len, request.status = n, Status.RUNNING
        self.running.append(request)
        return True

    def finish_if_done(self, request: Request) -> bool:
        reason = finish_reason(request.output_token_ids, request.sampling, self.eos_token_ids)
        if reason:
            request.finish_reason, request.status = reason, Status.FINISHED
            self.running.remove(request)
            self.release_finished(request)
        return reason is not None

    # whether finished requests keep what they hold (KV blocks, layer states) for their caller to take
    holds_finished = False

    def release_finished(self, request: Request) -> None:
        self.kv.free(request.request_id)
