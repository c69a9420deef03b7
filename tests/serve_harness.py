"""Start `skill serve` on 127.0.0.1 in a subprocess and stop it; every wait is bounded."""

import asyncio
import json
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
from skill_process import Started, skill_json
from tiny_checkpoint import PARITY_PROMPTS

from runtime.launch import free_port

STARTUP_S = 240


class Server:
    def __init__(self, proc: Started, port: int, log: Path):
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"

    def metrics(self) -> dict[str, float]:
        """The unlabelled value of every sample, by metric name (labels dropped)."""
        out = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
                out[name] = out.get(name, 0.0) + value
        return out

    def wait_idle(self, timeout_s: float = 20) -> dict[str, float]:
        """Metrics once nothing runs, waits or holds KV blocks."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            keys = ("skill_num_requests_running", "skill_num_requests_waiting", "skill_kv_cache_used_blocks")
            if all(m[k] == 0 for k in keys) or time.monotonic() > deadline:
                return m
            time.sleep(0.2)

    def stop(self, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@contextmanager
def serving(model_dir: Path | None, log: Path, *args: str):
    port = free_port()
    where = [str(model_dir)] if model_dir else []
    proc = Started("serve", *where, "--port", port, *args, log=log)
    server = Server(proc, port, log)
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, (
                f"server not healthy after {STARTUP_S} s:\n{log.read_text()[-3000:]}"
            )
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        yield server
    finally:
        server.stop()


def offline_outputs(
    model_dir: Path, prompts: list[str], new_tokens: int, *flags: str, yaml: Path | None = None
):
    """`skill run --json` outputs for the prompts (the reference every served answer must equal)."""
    prompt_args = [a for p in prompts for a in ("--prompt", p)]
    yaml_args = ["--yaml", yaml] if yaml else []
    return skill_json(
        "run", model_dir, "--json", "--max-new-tokens", new_tokens, *flags, *prompt_args, *yaml_args
    )["outputs"]


def migrated_with_layouts(
    tmp_path_factory, layouts: dict[str, tuple[int, ...]]
) -> tuple[Path, dict[str, Path]]:
    """A migrated tiny llama parallelized for each named layout (world, attn_tp, dense_tp, embed_tp, lmhead_tp);
    its base YAML runs the parallel code on one rank."""
    from hf_reference import build_reference, migrate, parallel_yaml, parallelize

    reference = build_reference("llama", tmp_path_factory)
    root = tmp_path_factory.mktemp("served")
    model_dir = migrate(reference, root / "models")
    yamls = {}
    for name, sizes in layouts.items():
        proc = parallelize(model_dir, parallel_yaml(root / f"{name}.yaml", *sizes), "--json")
        assert proc.returncode == 0, proc.stderr[-3000:]
        yamls[name] = Path(json.loads(proc.stdout)["yaml"])
    return model_dir, yamls


def served_texts(url: str, model: str, new_tokens: int) -> list[str]:
    """The prompts twice over, all at once: streamed completions, then chat."""

    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

        async def complete(prompt: str) -> str:
            stream = await client.completions.create(
                model=model, prompt=prompt, max_tokens=new_tokens, temperature=0, stream=True
            )
            return "".join([c.choices[0].text async for c in stream])

        async def chat(prompt: str) -> str:
            r = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=new_tokens,
                temperature=0,
            )
            return r.choices[0].message.content

        jobs = [complete(p) for p in PARITY_PROMPTS * 2] + [chat(p) for p in PARITY_PROMPTS]
        return await asyncio.wait_for(asyncio.gather(*jobs), 240)

    return asyncio.run(main())
