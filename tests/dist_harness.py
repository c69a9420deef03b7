"""Runs named checks on a small world of gloo CPU processes (forked from scripts/skill_process.py's preloaded
server) and reports each check's failures."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from collections.abc import Callable
from typing import Any

from skill_process import CONTEXT

from runtime.distributed import destroy_distributed, init_distributed
from runtime.launch import free_port

Setup = Callable[[int, int], Any]  # (rank, world_size) -> context handed to every check
Check = Callable[[Any], None]


def _child(
    rank: int, world_size: int, port: int, setup: Setup, checks: dict[str, Check], out: mp.Queue
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    failures: dict[str, str] = {}
    try:
        init_distributed("cpu")
        ctx = setup(rank, world_size)
        # Every rank runs every check in order, so collectives stay matched when one check fails.
        for name, check in checks.items():
            try:
                check(ctx)
            except Exception:  # noqa: BLE001 - reported to the parent
                failures[name] = f"rank {rank}: {traceback.format_exc()}"
    except Exception:  # noqa: BLE001 - reported to the parent
        failures["<setup>"] = f"rank {rank}: {traceback.format_exc()}"
    finally:
        destroy_distributed()
    out.put(failures)


def run_world(
    world_size: int, setup: Setup, checks: dict[str, Check], timeout: float = 60.0
) -> dict[str, list[str]]:
    """Check name (or "<setup>") -> failure tracebacks from every rank; empty lists mean passed everywhere."""
    out = CONTEXT.Queue()
    port = free_port()
    procs = [
        CONTEXT.Process(target=_child, args=(r, world_size, port, setup, checks, out), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[str, list[str]] = {name: [] for name in ["<setup>", *checks]}
    try:
        for _ in procs:
            try:
                failures = out.get(timeout=timeout)
            except queue.Empty:
                results["<setup>"].append(f"a rank reported nothing within {timeout}s (crash or hang)")
                break
            for name, failure in failures.items():
                results[name].append(failure)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return results


def distributed_tests(setup: Callable[[], Any], checks: dict[str, Callable]):
    """A module fixture running every check at world sizes 2 and 4, and one test per check reading it."""
    import pytest

    @pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
    def world_results(request):
        return run_world(request.param, setup, checks)

    @pytest.mark.parametrize("check", checks)
    def test_distributed(world_results, check):
        failures = world_results["<setup>"] + world_results[check]
        assert not failures, "\n".join(failures)

    return world_results, test_distributed
