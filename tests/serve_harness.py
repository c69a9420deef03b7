"""Start `skill serve` on 127.0.0.1 in a subprocess and stop it; every wait is bounded."""
import json
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from runtime.launch import free_port

STARTUP_S = 240


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path):
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
def serving(model_dir: Path, log: Path, *args: str):
    port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "skills.cli", "serve", str(model_dir), "--port", str(port),
                                 *args], stdout=out, stderr=subprocess.STDOUT)
    server = Server(proc, port, log)
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"server not healthy after {STARTUP_S} s:\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        yield server
    finally:
        server.stop()


def offline_outputs(model_dir: Path, prompts: list[str], new_tokens: int, *flags: str, yaml: Path | None = None):
    """`skill run --json` outputs for the prompts (the reference every served answer must equal)."""
    cmd = [sys.executable, "-m", "skills.cli", "run", str(model_dir), "--json", "--max-new-tokens", str(new_tokens),
           *flags, *[a for p in prompts for a in ("--prompt", p)]]
    if yaml:
        cmd += ["--yaml", str(yaml)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)["outputs"]
