"""One node's CPU ranks forked from the launching process, which has imported what they run: torchrun's
environment and its failure handling, without a fresh interpreter per rank.

The launching process must not have run torch work on several threads: libgomp's thread pool does not survive a
fork, and a forked rank's next parallel region would hang (checked: a matmul on 2 threads in the parent, then one
in the child). `skill run` and `skill serve` fork before they compute anything."""

import contextlib
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence

from runtime.errors import UserError
from runtime.launch import SINGLE_NODE, NodeLayout, free_port

POLL_S = 0.05
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def import_modules(modules: tuple[str, ...]) -> None:
    for name in modules:
        importlib.import_module(name)


def fork_ranks(world_size: int, module: str, args: list[str], nodes: NodeLayout = SINGLE_NODE) -> int:
    """Each rank runs `module.main()` with sys.argv and the environment torchrun gives it (RANK, LOCAL_RANK,
    WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR / MASTER_PORT: the node's, or a free local port; one thread per rank
    of several unless OMP_NUM_THREADS says otherwise). When a rank fails the others are stopped, as torchrun does,
    since they would wait for it in a collective; so are they when this process gets SIGTERM or SIGINT.
    Returns 0, or the first failed rank's exit code (128 + N for a signal N)."""
    entry = importlib.import_module(module).main
    port = nodes.master_port or free_port(nodes.master_addr)
    ranks: set[int] = set()
    stopping = {"code": 0}

    def on_signal(sig: int, _frame) -> None:
        stopping["code"] = stopping["code"] or 128 + sig
        _stop(ranks)

    saved: dict = {}
    try:
        with _signals_held():  # a signal while forking would miss the ranks forked after it
            saved = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                for rank in range(world_size):
                    pid = os.fork()
                    if pid == 0:
                        _rank(rank, world_size, nodes.master_addr, port, entry, [module, *args], saved)
                    ranks.add(pid)
            except BaseException:
                _stop(ranks)
                _wait(ranks, stopping)
                raise
        return _wait(ranks, stopping)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _rank(
    rank: int,
    world_size: int,
    addr: str,
    port: int,
    entry: Callable[[], object],
    argv: list[str],
    handlers: dict,
) -> None:
    code = 1
    try:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world_size, "LOCAL_WORLD_SIZE": world_size}
        os.environ.update({k: str(v) for k, v in env.items()}, MASTER_ADDR=addr, MASTER_PORT=str(port))
        # torchrun's default for several ranks: they share the cores
        if world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
            import torch

            os.environ["OMP_NUM_THREADS"] = "1"
            torch.set_num_threads(1)
        sys.argv = argv
        entry()
        code = 0
    except SystemExit as stop:  # as the interpreter ends: sys.exit(None | int | message)
        code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
        if not isinstance(stop.code, int | None):
            print(stop.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - printed as the interpreter would print an uncaught error
        sys.excepthook(*sys.exc_info())
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(ranks: set[int], stopping: dict) -> int:
    """Polls the ranks' pids only: other children of this process are not reaped here."""
    failed = 0
    while ranks:
        for pid in list(ranks):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done:
                continue
            ranks.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            if code and not failed:
                failed = code if code > 0 else 128 - code
                _stop(ranks)
        time.sleep(POLL_S if ranks else 0)
    return stopping["code"] or failed


def _stop(ranks: set[int]) -> None:
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


class DeferredRanks:
    """fork_ranks run by a process forked now, before the caller starts threads or an event loop, once `start`
    names the module and its arguments (which may depend on what the caller sets up meanwhile: ports, sockets).
    The process imports `preload` meanwhile, leads a session of its own, as `Popen(start_new_session=True)`
    would, and stands in for that Popen (poll, wait, terminate, kill, returncode). Without `start` it leaves at
    `close` or when the caller exits (the pipe it waits on closes). The caller's `held` sockets are closed in the
    launcher at once: a port the caller holds must not outlive it in its workers."""

    def __init__(
        self,
        world_size: int,
        nodes: NodeLayout = SINGLE_NODE,
        preload: tuple[str, ...] = (),
        held: Sequence[socket.socket] = (),
    ):
        read, self._write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                os.close(self._write)
                for sock in held:
                    sock.close()
                os.setsid()
                import_modules(preload)
                with os.fdopen(read) as pipe:
                    order = pipe.read()
                code = fork_ranks(world_size, *json.loads(order), nodes) if order else 0
            except BaseException:  # noqa: BLE001 - never back into the caller's stack
                sys.excepthook(*sys.exc_info())
            finally:
                os._exit(code)
        os.close(read)
        self.returncode: int | None = None

    def start(self, module: str, args: list[str]) -> None:
        fd, self._write = self._write, None
        try:
            with os.fdopen(fd, "w") as pipe:
                pipe.write(json.dumps([module, args]))
        except OSError as e:
            raise UserError(
                f"the engine workers' launcher (pid {self.pid}) exited before it started them: {e}"
            ) from None

    def close(self, timeout_s: float = 10.0) -> None:
        """Lets the launcher leave if it was not started."""
        if self._write is not None:
            os.close(self._write)
            self._write = None
            self.wait(timeout_s)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere
                pid, status = self.pid, 0
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"ranks forked by {self.pid}", timeout)
            time.sleep(POLL_S)
        return self.returncode

    def terminate(self) -> None:
        """The launcher stops its ranks, then leaves."""
        if self.poll() is None:
            os.kill(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        """The launcher and its ranks (its process group, named by its pid while any member lives) at once."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
