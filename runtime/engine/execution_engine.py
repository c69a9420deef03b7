"""The long-lived engine: requests in (`add_request`), one scheduler step at a time out (`step`).

Offline inference adds every prompt and steps until done; a server drives the same object from its own loop.
"""

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed

from runtime.config import InferenceConfig
from runtime.distributed import DistInfo
from runtime.engine.forward_metadata import ForwardMetaData
from runtime.engine.model_worker import ModelWorker
from runtime.engine.profiler import StepProfiler
from runtime.engine.request import Batch, Request, SamplingParams, StepOutput
from runtime.engine.sampler import Sampler, token_logprobs
from runtime.engine.scheduler import Scheduler
from runtime.engine.step_inputs import build_step_inputs
from runtime.engine.step_stats import StepStats
from runtime.engine.stopping import eos_token_ids
from runtime.layers.attention import probed_cache_keys
from runtime.layers.request_states import RequestStates, StateStore
from runtime.layers.token_layout import ATTN_GROUP, any_rank, needs_sharded_layout, step_layout, use_layout

logger = logging.getLogger(__name__)


def _long(device, values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


class ExecutionEngine:
    def __init__(
        self,
        config: InferenceConfig,
        dist: DistInfo,
        model_dir=None,
        scheduler_cls: type[Scheduler] = Scheduler,
    ):
        self.config, self.device = config, dist.device
        self.scheduler_cls = scheduler_cls
        self.worker = ModelWorker(config, dist, model_dir)
        self.sampler = Sampler()
        self.states = StateStore()
        self.kv = None
        self.tokenizer = None
        self.scheduler: Scheduler | None = None
        self.eos_token_ids: tuple[int, ...] = ()
        self.requests: dict[int, Request] = {}  # unfinished requests by id
        self.stats = StepStats()
        self.profiler: StepProfiler | None = None
        # Attention-DP ranks share the collectives of TP modules: they step together (dummy steps when idle).
        self.lockstep = needs_sharded_layout(config.parallel_config)

    def init(self) -> None:
        self.worker.init()
        self.tokenizer = self.worker.load_tokenizer()
        self.kv = self.worker.init_kvcache()
        held = self.worker.held_bytes()
        probe = self.dummy_step(probe=True)
        # the probe may also build weights (MLA's absorbed maps) and states, which the pool must leave room for
        keys, state_bytes = probed_cache_keys(probe), probe.request_states[0].nbytes()
        del probe
        reserved = self._reserve_states(state_bytes)
        if self.worker.fit_cache_keys(keys, resize=reserved or self.worker.held_bytes() != held):
            self.kv = self.worker.init_kvcache()
        self.eos_token_ids = eos_token_ids(self.worker.model_path, self.worker.hf_config, self.tokenizer)
        sc = self.config.scheduler_config
        self.scheduler = self.scheduler_cls(
            self.kv, self.config.batch_size_per_dp_rank, sc.max_prefill_tokens, self.eos_token_ids
        )
        mc = self.config.model_config
        if mc.enable_profiler:
            out = Path(mc.output_path).expanduser() if mc.output_path else Path(self.worker.model_dir or ".")
            self.profiler = StepProfiler(out, self.device)

    def _reserve_states(self, per_request: int) -> bool:
        """Sets aside, outside the KV pool, the states layers keep per request (as the probe's one-token request
        left them: a convolution's window and a recurrence have a fixed size) for the most requests the scheduler
        holds at once; True when there are any."""
        if not per_request:
            return False
        requests = self.config.batch_size_per_dp_rank
        self.worker.state_bytes = per_request * requests
        logger.info(
            "[Main] per-request states: %.1f KiB a request, %.1f MiB set aside for %d requests",
            per_request / 2**10,
            self.worker.state_bytes / 2**20,
            requests,
        )
        return True

    # --- the request API -------------------------------------------------------------------------------------
    def add_request(
        self, prompt_token_ids: list[int], sampling: SamplingParams | None = None, prompt: str = ""
    ) -> int:
        """Queue a request; returns its id. It joins the running batch at the next step that has room."""
        if not prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        request = Request(list(prompt_token_ids), sampling or SamplingParams(), prompt=prompt)
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)
        return request.request_id

    def add_prefilled(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        first_token: int,
        write_kv: Callable[[dict[str, list[list[int]]]], None],
        states: RequestStates | None = None,
    ) -> StepOutput | None:
        """A request prefilled elsewhere joins the running batch with its first token; write_kv(block tables)
        fills its fresh blocks with the prompt's KV; ``states``: its layers' states after the prompt (hybrids).
        None while there is no room (try again later)."""
        request = Request(list(prompt_token_ids), sampling)
        request.output_token_ids.append(first_token)
        if not self.scheduler.admit_running(request):
            return None
        write_kv(self.kv.block_tables([request.request_id]))
        finished = self.scheduler.finish_if_done(request)
        if not finished:
            self.requests[request.request_id] = request
            if states is not None:
                self.states.adopt(request.request_id, states, self.device)
        return StepOutput(request.request_id, [first_token], finished, request.finish_reason)

    def abort(self, request_id: int) -> bool:
        """Drop a request now and free its KV blocks; False if it is unknown or already finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.abort(request)
        self.sampler.release(request)
        self.states.release(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def any_unfinished(self) -> bool:
        """has_unfinished() on any rank that steps with this one (a collective in lock-step: all ranks call it)."""
        busy = self.has_unfinished()
        return any_rank(busy, self.device) if self.lockstep else busy

    def step(self) -> list[StepOutput]:
        """One scheduler step: a prefill of newly admitted requests or one decode token for every running one.
        A lock-step rank without work runs a dummy step and returns nothing."""
        if not self.scheduler.has_work():
            if self.lockstep:
                self.dummy_step()
            return []
        batch = self.scheduler.schedule()
        assert batch is not None, "scheduler has work but scheduled nothing"
        with self.profiler.step(batch.is_prefill) if self.profiler else contextlib.nullcontext():
            out = self.forward_batch(batch)
        self.stats.record(batch.is_prefill, out["infer_time_ms"])
        logger.info(
            "[Main] Inference time (%s): %.2f ms",
            "prefill" if batch.is_prefill else "decode",
            out["infer_time_ms"],
        )
        logprobs = token_logprobs(out["logits"][:, -1, :], batch.requests, out["next_tokens"])
        finished = {r.request_id for r in self.scheduler.process_batch_output(batch, out["next_tokens"])}
        outputs = []
        for r, token, lp in zip(batch.requests, out["next_tokens"], logprobs):
            done = r.request_id in finished
            outputs.append(
                StepOutput(r.request_id, [token], done, r.finish_reason, None if lp is None else [lp])
            )
            if done:
                self.sampler.release(r)
                if not self.scheduler.holds_finished:  # else its states go with its KV (StateStore.take)
                    self.states.release(r.request_id)
                self.requests.pop(r.request_id, None)
        return outputs

    # --- one forward --------------------------------------------------------------------------------------------
    def _run(self, input_ids: torch.Tensor, position_ids: torch.Tensor, md: ForwardMetaData):
        layout = step_layout(
            self.config.parallel_config, self.worker.comm_manager, input_ids.numel(), self.device
        )
        with use_layout(layout):
            return self.worker.inference(input_ids, position_ids, md)

    @torch.inference_mode()
    def forward_batch(self, batch: Batch, min_rows: int = 1) -> dict:
        tables = self.kv.block_tables([r.request_id for r in batch.requests])
        # a compiled decode graph serves any block-table width from 2 (torch.compile specialises sizes of 1)
        min_blocks = 1 if batch.is_prefill or self.config.model_config.exe_mode == "eager" else 2
        input_ids, position_ids, md = build_step_inputs(
            batch, tables, self.kv.block_size, self.device, min_rows, min_blocks
        )
        md.request_states = self.states.for_step(
            [r.request_id for r in batch.requests], batch.is_prefill, md.batch_size
        )
        logits, infer_ms = self._run(input_ids, position_ids, md)
        logits = logits[: len(batch)]  # rows padded for a compiled graph carry no request
        next_tokens = self._agree(self.sampler(logits[:, -1, :], batch.requests)).tolist()
        return {"next_tokens": next_tokens, "logits": logits, "infer_time_ms": infer_ms}

    def _agree(self, tokens: torch.Tensor) -> torch.Tensor:
        """The attn-TP ranks serve the same requests: all take the first rank's sample (unseeded sampling draws
        from each rank's own generator)."""
        cm = self.worker.comm_manager
        if cm is None or not cm.has_group(ATTN_GROUP) or cm.get_group(ATTN_GROUP) is None:
            return tokens
        torch.distributed.broadcast(tokens, src=cm.get_ranks(ATTN_GROUP)[0], group=cm.get_group(ATTN_GROUP))
        return tokens

    @torch.inference_mode()
    def dummy_step(self, probe: bool = False) -> ForwardMetaData:
        """A one-token forward whose KV goes to slot 0 (the null block; a free legacy row): a rank without work
        runs it while its peers step, because attention-DP ranks share the collectives of TP modules. With
        ``probe`` it records the cache keys each attention layer is called with (in its step metadata's memo)."""
        one, zero = _long(self.device, [1]), _long(self.device, [0])
        slot = _long(self.device, [[0]])
        md = ForwardMetaData(
            is_prefill=True,
            kv_len=zero,
            actual_seq_lengths_q=one,
            actual_seq_lengths_kv=one,
            actual_seq_lengths_cu_q=_long(self.device, [0, 1]),
            positions=zero,
            max_seq_len_q=1,
            max_seq_len_kv=1,
            prompt_tokens=[1],
            block_table=dict.fromkeys(self.kv.group_keys, slot),
            slot_mapping=dict.fromkeys(self.kv.group_keys, zero),
            probe=probe,
            request_states=[RequestStates()],
        )
        self._run(zero, zero, md)
        return md

    def warm_up(self) -> None:
        """A dummy prefill and decode so kernels and allocators are ready before timing starts. A compiled decode
        graph is traced here twice, on one row and on two: torch.compile specialises sizes of 1, so neither
        serves the other, and padding one request to two rows would cost float32 a second pass over every weight
        (its one-row products are matrix-vector ones)."""
        compiled = self.config.model_config.exe_mode != "eager"
        decode_rows = (1, 2) if compiled else (1,)
        request = Request([0, 1, 2], SamplingParams(max_new_tokens=1 + len(decode_rows)))
        if not self.kv.allocate_slots(request.request_id, 0, request.num_tokens + len(decode_rows)):
            return
        steps = [(True, 1), *((False, rows) for rows in decode_rows)]
        for is_prefill, rows in steps:
            batch = Batch([request], is_prefill=is_prefill)
            batch.update_requests_from_batch(self.forward_batch(batch, rows)["next_tokens"])
        self.kv.free(request.request_id)
        self.states.release(request.request_id)
