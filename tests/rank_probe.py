"""A rank for tests/test_launch.py: `rank_probe DIR ACTION` writes what the launcher gave this rank to
DIR/rank<R>.json, then acts: `ok` returns, `fail` makes rank 1 exit 3 while the others wait for it (as a rank
waits in a collective), `say` makes every rank exit with a message."""

import json
import os
import sys
import time
from pathlib import Path

import torch

from runtime.launch import fork_ranks


def main() -> None:
    out, action = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    keys = (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMP_NUM_THREADS",
    )
    seen = {k: os.environ.get(k) for k in keys} | {"threads": torch.get_num_threads(), "argv0": sys.argv[0]}
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    if action == "fail":
        if rank == 1:
            sys.exit(3)
        time.sleep(120)
    if action == "say":
        sys.exit(f"rank {rank} says no")


def launch(world_size: int, args: list[str], env: dict[str, str], stderr: str) -> None:
    """fork_ranks from a process of its own (a forked child of the suite's preloaded server), stderr to a file."""
    os.environ.update(env)
    os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT), 2)
    sys.exit(fork_ranks(world_size, "rank_probe", args))
