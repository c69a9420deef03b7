"""Offline batch inference on the persistent engine: tokenize prompts, add them all, step until done."""

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed

from runtime.config import InferenceConfig
from runtime.distributed import init_distributed
from runtime.engine.execution_engine import ExecutionEngine
from runtime.engine.request import SamplingParams, TokenLogprob
from runtime.engine.scheduler import Scheduler
from runtime.offline.prompts import encode_prompt

logger = logging.getLogger(__name__)


@dataclass
class GenerationOutput:
    prompt: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None  # one per token when the sampling parameters asked for them

    def to_dict(self) -> dict:
        out = asdict(self)
        if self.logprobs is None:
            del out["logprobs"]
        return out


class OfflineInference:
    def __init__(self, config: InferenceConfig, model_dir: Path, scheduler_cls: type[Scheduler] = Scheduler):
        self.config = config
        self.dist = init_distributed()
        self.engine = ExecutionEngine(config, self.dist, model_dir, scheduler_cls)
        self.engine.init()
        self.engine.warm_up()
        self.tokenizer = self.engine.tokenizer

    def tokenize(self, prompt: str, chat: bool) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, chat, self.config.data_config.input_truncated_len)

    def default_sampling(self) -> SamplingParams:
        sc = self.config.scheduler_config
        return SamplingParams(
            max_new_tokens=sc.max_new_tokens,
            stop_token_ids=tuple(sc.stop_token_ids),
            ignore_eos=sc.ignore_eos,
        )

    def generate(
        self,
        prompts: list[str],
        sampling: SamplingParams | list[SamplingParams] | None = None,
        chat: bool = True,
    ) -> list[GenerationOutput]:
        """All prompts' outputs, in order, on every rank. With attention DP each DP rank runs its share.
        ``sampling`` is one set of parameters for all prompts or one per prompt."""
        pc = self.config.parallel_config
        params = (
            sampling if isinstance(sampling, list) else [sampling or self.default_sampling()] * len(prompts)
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling parameter sets for {len(prompts)} prompts")
        share = -(-len(prompts) // pc.attn_dp_size)
        dp_rank = self.dist.rank // pc.attn_tp_size
        mine = slice(dp_rank * share, (dp_rank + 1) * share)
        outputs = self.generate_ids(
            [self.tokenize(p, chat) for p in prompts[mine]], params[mine], prompts[mine]
        )
        if self.dist.world_size == 1:
            return outputs
        gathered: list = [None] * self.dist.world_size
        torch.distributed.all_gather_object(gathered, outputs)
        return [out for dp in range(pc.attn_dp_size) for out in gathered[dp * pc.attn_tp_size]]

    def param_bytes_per_rank(self) -> list[int]:
        """Parameter bytes every rank holds (a collective: all ranks call it)."""
        mine = self.engine.worker.param_bytes
        if self.dist.world_size == 1:
            return [mine]
        gathered: list = [None] * self.dist.world_size
        torch.distributed.all_gather_object(gathered, mine)
        return gathered

    def generate_ids(
        self, prompts_ids: list[list[int]], params: list[SamplingParams], prompts: list[str] | None = None
    ) -> list[GenerationOutput]:
        """This rank's requests from token ids: add them all, step the engine until every rank is done."""
        engine = self.engine
        prompts = prompts or [""] * len(prompts_ids)
        ids = [
            engine.add_request(p, s, prompt=text)
            for p, s, text in zip(prompts_ids, params, prompts, strict=True)
        ]
        tokens: dict[int, list[int]] = {i: [] for i in ids}
        logprobs: dict[int, list[TokenLogprob]] = {
            i: [] for i, s in zip(ids, params) if s.logprobs is not None
        }
        reasons: dict[int, str] = {}
        while engine.any_unfinished():
            for out in engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
                if out.logprobs:
                    logprobs[out.request_id].extend(out.logprobs)
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
        results = [
            GenerationOutput(
                text,
                p,
                tokens[i],
                self.tokenizer.decode(tokens[i], skip_special_tokens=True),
                reasons[i],
                logprobs.get(i),
            )
            for i, p, text in zip(ids, prompts_ids, prompts)
        ]
        for i, res in enumerate(results):
            logger.info("Request %d: outputs: %s", i, res.text)
        logger.info(
            "%s decode average inference time cost is %.2f ms", self.config.model_name, self.decode_avg_ms
        )
        logger.info("[Main] %s", engine.kv.usage_summary())
        return results

    @property
    def prefill_avg_ms(self) -> float:
        return self.engine.stats.prefill.mean()

    @property
    def decode_avg_ms(self) -> float:
        """Mean decode step time without the first (cold) step."""
        return self.engine.stats.decode.mean(skip_first=True)
