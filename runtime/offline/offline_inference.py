"""Offline batch inference: tokenize prompts, run the scheduler loop to completion, decode outputs."""
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed
from transformers import GenerationConfig

from runtime.config import InferenceConfig
from runtime.distributed import init_distributed
from runtime.engine.execution_engine import ExecutionEngine
from runtime.engine.request import Request, SamplingParams
from runtime.engine.scheduler import Scheduler
from runtime.layers.token_layout import any_rank, needs_sharded_layout

logger = logging.getLogger(__name__)


@dataclass
class GenerationOutput:
    prompt: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


class OfflineInference:
    def __init__(self, config: InferenceConfig, model_dir: Path):
        self.config = config
        self.dist = init_distributed()
        self.engine = ExecutionEngine(config, self.dist, model_dir)
        self.engine.init()
        self.engine.warm_up()
        self.tokenizer = self.engine.tokenizer
        self.eos_token_ids = self._eos_token_ids()
        self.prefill_ms: list[float] = []
        self.decode_ms: list[float] = []

    def _eos_token_ids(self) -> tuple[int, ...]:
        path = self.engine.worker.model_path
        try:
            eos = GenerationConfig.from_pretrained(path).eos_token_id
        except OSError:
            eos = self.engine.worker.hf_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))

    def tokenize(self, prompt: str, chat: bool) -> list[int]:
        if chat and self.tokenizer.chat_template:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                     add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
        else:
            ids = self.tokenizer(prompt)["input_ids"]
        limit = self.config.data_config.input_truncated_len
        if len(ids) > limit:
            logger.warning("prompt of %d tokens truncated to its last %d (data_config.input_truncated_len)",
                           len(ids), limit)
            ids = ids[-limit:]
        return list(ids)

    def default_sampling(self) -> SamplingParams:
        sc = self.config.scheduler_config
        return SamplingParams(max_new_tokens=sc.max_new_tokens, stop_token_ids=tuple(sc.stop_token_ids),
                              ignore_eos=sc.ignore_eos)

    def generate(self, prompts: list[str], sampling: SamplingParams | None = None,
                 chat: bool = True) -> list[GenerationOutput]:
        """All prompts' outputs, in order, on every rank. With attention DP each DP rank runs its share."""
        pc = self.config.parallel_config
        share = -(-len(prompts) // pc.attn_dp_size)
        dp_rank = self.dist.rank // pc.attn_tp_size
        mine = self._generate(prompts[dp_rank * share:(dp_rank + 1) * share], sampling, chat)
        if self.dist.world_size == 1:
            return mine
        gathered: list = [None] * self.dist.world_size
        torch.distributed.all_gather_object(gathered, mine)
        return [out for dp in range(pc.attn_dp_size) for out in gathered[dp * pc.attn_tp_size]]

    def param_bytes_per_rank(self) -> list[int]:
        """Parameter bytes every rank holds (a collective: all ranks call it)."""
        mine = self.engine.worker.param_bytes
        if self.dist.world_size == 1:
            return [mine]
        gathered: list = [None] * self.dist.world_size
        torch.distributed.all_gather_object(gathered, mine)
        return gathered

    def _generate(self, prompts: list[str], sampling: SamplingParams | None, chat: bool) -> list[GenerationOutput]:
        sampling = sampling or self.default_sampling()
        requests = [Request(self.tokenize(p, chat), sampling, prompt=p) for p in prompts]
        sc = self.config.scheduler_config
        scheduler = Scheduler(self.engine.kv, self.config.batch_size_per_dp_rank, sc.max_prefill_tokens,
                              self.eos_token_ids)
        for r in requests:
            scheduler.add_request(r)
        # Attention-DP ranks sharing TP collectives step together; one without work runs dummy steps.
        lockstep = needs_sharded_layout(self.config.parallel_config)
        while True:
            busy = scheduler.has_work()
            if not (any_rank(busy, self.dist.device) if lockstep else busy):
                break
            if not busy:
                self.engine.dummy_step()
                continue
            batch = scheduler.schedule()
            assert batch is not None, "scheduler has work but scheduled nothing"
            out = self.engine.forward_batch(batch)
            stage = "prefill" if batch.is_prefill else "decode"
            (self.prefill_ms if batch.is_prefill else self.decode_ms).append(out["infer_time_ms"])
            logger.info("[Main] Inference time (%s): %.2f ms", stage, out["infer_time_ms"])
            for r in scheduler.process_batch_output(batch, out["next_tokens"]):
                self.engine.sampler.release(r)
        results = [GenerationOutput(r.prompt, r.prompt_token_ids, r.output_token_ids,
                                    self.tokenizer.decode(r.output_token_ids, skip_special_tokens=True),
                                    r.finish_reason) for r in requests]
        for i, res in enumerate(results):
            logger.info("Request %d: outputs: %s", i, res.text)
        logger.info("%s decode average inference time cost is %.2f ms", self.config.model_name,
                    self.decode_avg_ms)
        return results

    @property
    def prefill_avg_ms(self) -> float:
        return _mean(self.prefill_ms)

    @property
    def decode_avg_ms(self) -> float:
        """Mean decode step time without the first (cold) step."""
        return _mean(self.decode_ms[1:] or self.decode_ms)
