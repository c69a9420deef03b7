"""The engines the bench times on one workload: the runtime (`Ours`), the same runtime behind `skill serve`
over HTTP (`Served`) and transformers `generate` (`Peer`).

All take token-id prompts and per-request output lengths and return a `RunResult`: the wall time of the
whole workload, each request's time to first token and finish time (from submission), and its tokens.
"""

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
import yaml

from runtime.distributed import select_device
from runtime.errors import UserError
from runtime.launch import free_port

SERVER_STARTUP_S = 600


@dataclass
class RunResult:
    seconds: float
    ttft_s: list[float]
    finish_s: list[float]
    outputs: list[list[int]]


def bench_config(
    yaml_file: Path, dtype: str, exe_mode: str | None, num_requests: int, max_prompt: int, max_output: int
):
    """The model directory's YAML, sized for the workload (every request in one batch)."""
    from runtime.config import InferenceConfig

    config = InferenceConfig.from_yaml(yaml_file)
    if config.world_size > 1:
        raise UserError(
            f"{yaml_file} runs {config.world_size} ranks; skill bench measures one rank, "
            "pass a single-rank YAML with --yaml."
        )
    config.model_config.dtype = dtype
    config.model_config.exe_mode = exe_mode or config.model_config.exe_mode
    config.scheduler_config.batch_size = num_requests
    config.scheduler_config.max_new_tokens = max_output
    config.data_config.input_truncated_len = max_prompt
    return config


class Ours:
    """The runtime's persistent engine, configured from the model directory's YAML for this workload."""

    def __init__(self, model_dir: Path, config):
        from runtime.offline import OfflineInference

        self.llm = OfflineInference(config, model_dir)
        self.engine = self.llm.engine

    @property
    def vocab_size(self) -> int:
        return self.engine.worker.hf_config.vocab_size

    def bytes_per_token(self) -> tuple[int, int]:
        """(weight bytes read per decode step, KV bytes each cached token costs across all layers)."""
        kv = sum(
            2 * m.k_cache[0, 0].numel() * m.k_cache.element_size()
            for m in self.engine.worker.model.modules()
            if getattr(m, "k_cache", None) is not None
        )
        return self.engine.worker.param_bytes, kv

    def run(self, prompts: list[list[int]], output_lens: list[int]) -> RunResult:
        from runtime.engine.request import SamplingParams

        engine, n = self.engine, len(prompts)
        start = time.perf_counter()
        index = {
            engine.add_request(p, SamplingParams(max_new_tokens=o, ignore_eos=True)): i
            for i, (p, o) in enumerate(zip(prompts, output_lens))
        }
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


class Served:
    """`skill serve` on the workload's configuration, every request sent at once as a streamed completion."""

    def __init__(self, model_dir: Path, config, threads: int):
        from transformers import AutoConfig

        self.vocab_size = AutoConfig.from_pretrained(config.model_config.model_path).vocab_size
        self.dir = tempfile.TemporaryDirectory(prefix="bench-serve-")
        yaml_file = Path(self.dir.name) / "served.yaml"
        yaml_file.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
        self.url = f"http://127.0.0.1:{free_port()}"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "skills.cli",
                "serve",
                str(model_dir),
                "--yaml",
                str(yaml_file),
                "--port",
                self.url.rsplit(":", 1)[1],
                "--max-queue",
                str(config.scheduler_config.batch_size),
            ],
            env=env,
            stdout=sys.stderr,
        )
        deadline = time.monotonic() + SERVER_STARTUP_S
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise UserError(
                    f"`skill serve` did not come up for the bench (exit code {self.proc.returncode})"
                )
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def peak_rss_mb(self) -> float:
        """High-water RSS of the server and every process under it (HTTP parent, the workers' launcher, the
        ranks), summed: pages a forked process shares with its parent count in both."""

        def tree(pid: int) -> list[int]:
            kids = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
            return [pid] + [p for k in kids for p in tree(k)]

        total = 0.0
        for pid in tree(self.proc.pid):
            status = Path(f"/proc/{pid}/status").read_text()
            total += next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
        return total / 1024

    def run(self, prompts: list[list[int]], output_lens: list[int]) -> RunResult:
        return asyncio.run(self._run(prompts, output_lens))

    async def _run(self, prompts: list[list[int]], output_lens: list[int]) -> RunResult:
        n = len(prompts)
        ttft, finish, outputs = [0.0] * n, [0.0] * n, [[] for _ in range(n)]
        limits = httpx.Limits(max_connections=n + 1)
        async with httpx.AsyncClient(timeout=SERVER_STARTUP_S, limits=limits) as client:
            start = time.perf_counter()

            async def one(i: int) -> None:
                body = {
                    "model": "default",
                    "prompt": prompts[i],
                    "max_tokens": output_lens[i],
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "return_token_ids": True,
                }
                async with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        raise UserError(f"the bench's server answered {r.status_code}: {await r.aread()}")
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        ids = json.loads(line[6:])["choices"][0]["token_ids"]
                        if ids and not outputs[i]:
                            ttft[i] = time.perf_counter() - start
                        outputs[i] += ids
                finish[i] = time.perf_counter() - start

            await asyncio.gather(*(one(i) for i in range(n)))
            return RunResult(time.perf_counter() - start, ttft, finish, outputs)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.dir.cleanup()


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
        self.device = select_device(0)  # the device the runtime picks for a single rank
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype))
        self.model = model.to(self.device).eval()
        config = self.model.config
        eos = config.eos_token_id
        self.pad = (
            config.pad_token_id
            if config.pad_token_id is not None
            else ((eos[0] if isinstance(eos, list) else eos) or 0)
        )
        self.batch = batch
        self._generate([[1, 2, 3]], 2, time.perf_counter())  # warm-up

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @torch.inference_mode()
    def _generate(
        self, prompts: list[list[int]], new_tokens: int, start: float
    ) -> tuple[torch.Tensor, list[float]]:
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        clock = _StepClock(start)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=self.pad,
            streamer=clock,
        )
        return out[:, width:], clock.times

    @torch.inference_mode()
    def reference(self, prompt: list[int], new_tokens: int) -> tuple[list[int], list[bool]]:
        """Greedy tokens of one unpadded request and, per step, whether its top two logits tie within the
        dtype's rounding (where any other kernel may rightly pick the other token)."""
        out = self.model.generate(
            input_ids=torch.tensor([prompt], device=self.device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=self.pad,
            output_logits=True,
            return_dict_in_generate=True,
        )
        eps = torch.finfo(self.model.dtype).eps
        ties = []
        for logits in out.logits:
            top = logits[0].float().topk(2).values
            ties.append(bool(top[0] - top[1] <= 2 * eps * max(1.0, abs(float(top[0])))))
        return out.sequences[0, len(prompt) :].tolist(), ties

    def run(self, prompts: list[list[int]], output_lens: list[int]) -> RunResult:
        start = time.perf_counter()
        ttft, finish, outputs = [], [], []
        for k in range(0, len(prompts), self.batch):
            lens = output_lens[k : k + self.batch]
            tokens, times = self._generate(prompts[k : k + self.batch], max(lens), start)
            for row, n in zip(tokens.tolist(), lens):
                ttft.append(times[1])
                finish.append(times[n])
                outputs.append(row[:n])
        return RunResult(time.perf_counter() - start, ttft, finish, outputs)
