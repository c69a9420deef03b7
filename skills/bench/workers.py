"""Parent side of the worker protocol: start an engine process, send it commands, read its answers."""

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from runtime.errors import UserError


class Worker:
    def __init__(self, engine: str, args: list[str], timeout_s: float):
        self.engine, self.timeout_s = engine, timeout_s
        # kept open for the life of the worker: its stderr goes there
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"bench-{engine}-", suffix=".log", delete=False)  # noqa: SIM115
        env = {**os.environ, "SKILL_LOG_LEVEL": os.environ.get("SKILL_LOG_LEVEL", "WARNING")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "skills.bench.worker", engine, *args],
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
        )
        self.info = self._expect("READY")

    def _expect(self, tag: str) -> dict:
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise UserError(
                    f"bench worker '{self.engine}' gave no {tag} within {self.timeout_s:.0f} s; "
                    f"its log is {self.log.name}. Use --quick or fewer --repeats on a slow machine."
                )
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            line = self.proc.stdout.readline() if ready else ""
            if ready and not line:  # the process ended
                self.proc.wait()
                tail = Path(self.log.name).read_text(errors="replace")[-2000:]
                raise UserError(
                    f"bench worker '{self.engine}' exited with code {self.proc.returncode} before "
                    f"{tag}; the end of its log ({self.log.name}):\n{tail}"
                )
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1 :])

    def _send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def run(self) -> dict:
        self._send("run")
        return self._expect("RESULT")

    def reference(self, n: int) -> dict:
        self._send(f"reference {n}")
        return self._expect("RESULT")

    def quit(self) -> dict:
        self._send("quit")
        done = self._expect("DONE")
        self.close()
        return done

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()
