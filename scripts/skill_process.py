"""`skill` commands for the test suite and the catalogue sweep: each runs `skills.cli.main()` in a process of its
own, as `python -m skills.cli` would, but forked from a server that imported torch, transformers and the project
once (a fresh interpreter spends ~5 s of a 2-core machine's time on those imports, and the suite runs hundreds of
commands). tests/test_cli_errors.py and the demo's test start the real `python -m skills.cli`. What the preloaded
modules read from the environment at import (huggingface_hub's HF_HUB_OFFLINE) keeps the server's value; the
project reads its own variables (SKILL_*) when a command runs."""

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from importlib.util import find_spec
from pathlib import Path

# imported by the fork server before any command; importing runs no torch work and reads no command's options
# (forking after `import torch` is what DataLoader workers do)
PRELOAD = [
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.generation",
    "skills.cli",
    "skills.migrator.pipeline",
    "skills.parallel_impl.pipeline",
    "runtime.engine.model_worker",
]
# also starts the gloo worlds of tests/dist_harness.py
CONTEXT = mp.get_context("forkserver")
CONTEXT.set_forkserver_preload(PRELOAD)
CLI_PATH = find_spec("skills.cli").origin


def _main(
    args: list[str], env: dict[str, str], cwd: str | None, stdin: str, stdout: str, stderr: str
) -> None:
    """The forked process: the command's environment, directory and standard streams, then the CLI."""
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    for fd, path, flags in ((0, stdin, os.O_RDONLY), (1, stdout, os.O_WRONLY), (2, stderr, os.O_WRONLY)):
        opened = os.open(path, flags | (os.O_APPEND if fd else 0))  # stdout and stderr may share a file
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 - fd 0 stays open for the process
    sys.argv = [CLI_PATH, *args]
    from skills.cli import main

    main()


def _process(args: tuple[object, ...], env: Mapping[str, str] | None, cwd, stdin: Path, out: Path, err: Path):
    argv = [str(a) for a in args]
    environment = dict(os.environ if env is None else env)
    process = CONTEXT.Process(
        target=_main,
        args=(argv, environment, None if cwd is None else str(cwd), str(stdin), str(out), str(err)),
    )
    process.start()
    return process, [sys.executable, "-m", "skills.cli", *argv]


def skill(
    *args: object,
    input: str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess:
    """`skill ARGS...` as `subprocess.run([sys.executable, "-m", "skills.cli", *args], capture_output=True,
    text=True, input=input, env=env, cwd=cwd, timeout=timeout)` returns it."""
    with tempfile.TemporaryDirectory(prefix="skill-") as tmp:
        streams = [Path(tmp, name) for name in ("stdin", "stdout", "stderr")]
        streams[0].write_text(input or "", encoding="utf-8")
        streams[1].touch()
        streams[2].touch()
        process, cmd = _process(args, env, cwd, *streams)
        process.join(timeout)
        timed_out = process.exitcode is None
        if timed_out:
            process.kill()
            process.join()
        out, err = (p.read_text(encoding="utf-8", errors="replace") for p in streams[1:])
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, out, err)
    return subprocess.CompletedProcess(cmd, process.exitcode, out, err)


class Started:
    """`skill ARGS...` started in the background with stdout and stderr to `log`: the methods of the
    subprocess.Popen it stands for that the tests call."""

    def __init__(self, *args: object, log: Path):
        log.write_text("")  # as Popen(stdout=log.open("w"), stderr=STDOUT)
        self._process, self.args = _process(args, None, None, Path(os.devnull), log, log)
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fresh(*args: object, input: str | None = None) -> subprocess.CompletedProcess:
    """The real `python -m skills.cli ARGS...` in a fresh interpreter, for the tests of the CLI as users start it."""
    cmd = [sys.executable, "-m", "skills.cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, check=False, input=input)


def process_gone(pid: int) -> bool:
    """No such process, or only its exit status left (a zombie its parent has not reaped)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return any(line.split()[:2] == ["State:", "Z"] for line in status.splitlines())


def skill_json(*args: object) -> dict:
    """The JSON a `skill` command prints, which must succeed."""
    proc = skill(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)
