"""One node's CPU ranks forked from the launching process, which has imported what they run: torchrun's
environment and its failure handling, without a fresh interpreter per rank.

The launching process must not have run torch work on several threads: libgomp's thread pool does not survive a
fork, and a forked rank's next parallel region would hang (checked: a matmul on 2 threads in the parent, then one
in the child). `skill run` and `skill serve` fork before they compute anything."""

import importlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

from runtime.launch import free_port


def fork_ranks(world_size: int, module: str, args: list[str]) -> int:
    """Each rank runs `module.main()` with sys.argv and the environment torchrun would give it (RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR / MASTER_PORT, one thread unless OMP_NUM_THREADS says otherwise). When a rank fails
    the others are stopped, as torchrun does, since they would wait for it in a collective."""
    entry = importlib.import_module(module).main
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    ranks = set()
    # a SIGTERM to the launcher reaches the ranks (a rank puts the default back)
    forward = signal.signal(signal.SIGTERM, lambda *_: _stop(ranks))
    try:
        for rank in range(world_size):
            pid = os.fork()
            if pid == 0:
                _rank(rank, world_size, port, entry, [module, *args])
            ranks.add(pid)
        return _wait(ranks)
    finally:
        signal.signal(signal.SIGTERM, forward)


def _rank(rank: int, world_size: int, port: int, entry: Callable[[], object], argv: list[str]) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world_size, "LOCAL_WORLD_SIZE": world_size}
    os.environ.update({k: str(v) for k, v in env.items()}, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun's default: the ranks share the cores
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    sys.argv = argv
    code = 0
    try:
        entry()
    except SystemExit as stop:  # as the interpreter ends: sys.exit(None | int | message)
        code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
        if not isinstance(stop.code, int | None):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what the interpreter would print for an uncaught error
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _wait(ranks: set[int]) -> int:
    failed = 0
    while ranks:
        try:
            pid, status = os.wait()
        except KeyboardInterrupt:
            failed = failed or 128 + signal.SIGINT
            _stop(ranks)
            continue
        if pid not in ranks:
            continue
        ranks.remove(pid)
        code = os.waitstatus_to_exitcode(status)
        if code and not failed:
            failed = code if code > 0 else 128 - code
            _stop(ranks)
    return failed


def _stop(ranks: set[int]) -> None:
    for pid in ranks:
        os.kill(pid, signal.SIGTERM)


class DeferredRanks:
    """fork_ranks run by a process forked now, before the caller starts threads or an event loop, once `start`
    names the module and its arguments (which may depend on what the caller sets up meanwhile: ports, sockets).
    The process leads a session of its own, as `Popen(start_new_session=True)` would, and stands in for that
    Popen (poll, wait, terminate, kill, returncode). Without `start` it leaves at `close` or when the caller exits."""

    def __init__(self, world_size: int, preload: tuple[str, ...] = ()):
        for name in preload:
            importlib.import_module(name)
        read, self._write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self._write)
            os.setsid()
            with os.fdopen(read) as pipe:
                order = pipe.read()
            os._exit(fork_ranks(world_size, *json.loads(order)) if order else 0)
        os.close(read)
        self.returncode: int | None = None

    def start(self, module: str, args: list[str]) -> None:
        with os.fdopen(self._write, "w") as pipe:
            pipe.write(json.dumps([module, args]))
        self._write = None

    def close(self) -> None:
        """Lets the launcher leave if it was not started."""
        if self._write is not None:
            os.close(self._write)
            self._write = None
            self.wait()

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"ranks forked by {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
