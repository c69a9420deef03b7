"""The two engines the bench times on one workload: the runtime (`Ours`) and transformers `generate` (`Peer`).

Both take token-id prompts and per-request output lengths and return a `RunResult`: the wall time of the
whole workload, each request's time to first token and finish time (from submission), and its tokens.
"""
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.errors import UserError


@dataclass
class RunResult:
    seconds: float
    ttft_s: list[float]
    finish_s: list[float]
    outputs: list[list[int]]


class Ours:
    """The runtime's persistent engine, configured from the model directory's YAML for this workload."""

    def __init__(self, model_dir: Path, yaml_file: Path, dtype: str, exe_mode: str | None, num_requests: int,
                 max_prompt: int, max_output: int):
        from runtime.config import InferenceConfig
        from runtime.offline import OfflineInference

        config = InferenceConfig.from_yaml(yaml_file)
        if config.world_size > 1:
            raise UserError(f"{yaml_file} runs {config.world_size} ranks; skill bench measures one rank, "
                            "pass a single-rank YAML with --yaml.")
        config.model_config.dtype = dtype
        config.model_config.exe_mode = exe_mode or config.model_config.exe_mode
        config.scheduler_config.batch_size = num_requests
        config.scheduler_config.max_new_tokens = max_output
        config.data_config.input_truncated_len = max_prompt
        self.llm = OfflineInference(config, model_dir)
        self.engine = self.llm.engine

    @property
    def vocab_size(self) -> int:
        return self.engine.worker.hf_config.vocab_size

    def bytes_per_token(self) -> tuple[int, int]:
        """(weight bytes read per decode step, KV bytes each cached token costs across all layers)."""
        kv = sum(2 * m.k_cache[0, 0].numel() * m.k_cache.element_size()
                 for m in self.engine.worker.model.modules() if getattr(m, "k_cache", None) is not None)
        return self.engine.worker.param_bytes, kv

    def run(self, prompts: list[list[int]], output_lens: list[int]) -> RunResult:
        from runtime.engine.request import SamplingParams

        engine, n = self.engine, len(prompts)
        start = time.perf_counter()
        index = {engine.add_request(p, SamplingParams(max_new_tokens=o, ignore_eos=True)): i
                 for i, (p, o) in enumerate(zip(prompts, output_lens))}
        ttft, finish, outputs = [0.0] * n, [0.0] * n, [[] for _ in range(n)]
        while engine.has_unfinished():
            for out in engine.step():
                now, i = time.perf_counter() - start, index[out.request_id]
                if not outputs[i]:
                    ttft[i] = now
                outputs[i] += out.new_token_ids
                if out.finished:
                    finish[i] = now
        return RunResult(time.perf_counter() - start, ttft, finish, outputs)


class _StepClock:
    """A `generate` streamer that only notes when each step's tokens arrive (the first put is the prompt)."""

    def __init__(self, start: float):
        self.start, self.times = start, []

    def put(self, value) -> None:
        self.times.append(time.perf_counter() - self.start)

    def end(self) -> None:
        pass


class Peer:
    """transformers `generate`, greedy, on left-padded batches in arrival order."""

    def __init__(self, checkpoint: Path, dtype: str, batch: int):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).eval()
        config = self.model.config
        eos = config.eos_token_id
        self.pad = config.pad_token_id if config.pad_token_id is not None else (
            (eos[0] if isinstance(eos, list) else eos) or 0)
        self.batch = batch
        self._generate([[1, 2, 3]], 2, time.perf_counter())  # warm-up

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], new_tokens: int, start: float) -> tuple[torch.Tensor, list[float]]:
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        clock = _StepClock(start)
        out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=self.pad,
                                  streamer=clock)
        return out[:, width:], clock.times

    @torch.inference_mode()
    def reference(self, prompt: list[int], new_tokens: int) -> tuple[list[int], list[bool]]:
        """Greedy tokens of one unpadded request and, per step, whether its top two logits tie within the
        dtype's rounding (where any other kernel may rightly pick the other token)."""
        out = self.model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=self.pad,
                                  output_logits=True, return_dict_in_generate=True)
        eps = torch.finfo(self.model.dtype).eps
        ties = []
        for logits in out.logits:
            top = logits[0].float().topk(2).values
            ties.append(bool(top[0] - top[1] <= 2 * eps * max(1.0, abs(float(top[0])))))
        return out.sequences[0, len(prompt):].tolist(), ties

    def run(self, prompts: list[list[int]], output_lens: list[int]) -> RunResult:
        start = time.perf_counter()
        ttft, finish, outputs = [], [], []
        for k in range(0, len(prompts), self.batch):
            lens = output_lens[k:k + self.batch]
            tokens, times = self._generate(prompts[k:k + self.batch], max(lens), start)
            for row, n in zip(tokens.tolist(), lens):
                ttft.append(times[1])
                finish.append(times[n])
                outputs.append(row[:n])
        return RunResult(time.perf_counter() - start, ttft, finish, outputs)
