"""A rank for tests/test_launch.py: `rank_probe DIR ACTION` writes what the launcher gave this rank to
DIR/rank<R>.json, then acts: `ok` returns, `fail` makes rank 1 exit 3 while the others wait for it (as a rank
waits in a collective), `say` makes every rank exit with a message, `sleep` waits."""

import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch

from runtime.fork_launch import DeferredRanks, fork_ranks

KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
)


def main() -> None:
    out, action = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    seen = {k: os.environ.get(k) for k in KEYS}
    seen |= {
        "threads": torch.get_num_threads(),
        "argv0": sys.argv[0],
        "pid": os.getpid(),
        "sid": os.getsid(0),
        "sockets": _socket_inodes(),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    if action == "sleep" or (action == "fail" and rank != 1):
        time.sleep(120)
    if action == "fail":
        sys.exit(3)
    if action == "say":
        sys.exit(f"rank {rank} says no")


def _socket_inodes() -> list[int]:
    inodes = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own descriptor, closed by now
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                inodes.append(int(link[len("socket:[") : -1]))
    return inodes


def _own_process(out: Path, env: dict[str, str]) -> None:
    """The environment (OMP_NUM_THREADS only if given), stderr to out/stderr, what the launching process has."""
    os.environ.pop("OMP_NUM_THREADS", None)
    os.environ.update(env)
    os.dup2(os.open(out / "stderr", os.O_WRONLY | os.O_CREAT), 2)
    (out / "launcher.json").write_text(json.dumps({"threads": torch.get_num_threads(), "pid": os.getpid()}))


def launch(world_size: int, args: list[str], env: dict[str, str]) -> None:
    """fork_ranks from a process of its own (a forked child of the suite's preloaded server)."""
    _own_process(Path(args[0]), env)
    sys.exit(fork_ranks(world_size, "rank_probe", args))


def deferred(world_size: int, args: list[str], then: str) -> None:
    """DeferredRanks made, then: `start`ed and waited for, `close`d unstarted, left unstarted (`exit`), or started
    and, once every rank is up, `terminate`d or `kill`ed; exits with the launcher's code (128 + a signal's). Of
    two sockets open when it is made, the `held` one is handed to it, the `kept` one is not."""
    out = Path(args[0])
    _own_process(out, {})
    held, kept = socket.socket(), socket.socket()
    ranks = DeferredRanks(world_size, held=[held])
    inodes = {name: os.fstat(s.fileno()).st_ino for name, s in (("held", held), ("kept", kept))}
    (out / "deferred.json").write_text(json.dumps({"pid": ranks.pid} | inodes))
    if then == "exit":
        sys.exit(0)
    if then == "close":
        ranks.close()
        sys.exit(ranks.returncode)
    ranks.start("rank_probe", args)
    if then in ("terminate", "kill"):
        while len(list(out.glob("rank*.json"))) < world_size:
            time.sleep(0.05)
        getattr(ranks, then)()
    code = ranks.wait(60)
    sys.exit(code if code >= 0 else 128 - code)
