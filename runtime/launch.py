"""Starting one process per local rank: forked from this process for one node's CPU ranks, else under torchrun
(its static rendezvous, across nodes too)."""

import importlib
import os
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from runtime.errors import UserError

DEFAULT_MASTER_PORT = 29500


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class NodeLayout:
    """Where this launch sits among the nodes of one world (one machine: the defaults)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free local port (single node only)

    @classmethod
    def of(cls, nnodes: int, node_rank: int, master_addr: str, master_port: int | None) -> "NodeLayout":
        if not 0 <= node_rank < nnodes:
            raise UserError(f"--node-rank {node_rank} is outside --nnodes {nnodes} (0 .. {nnodes - 1})")
        if nnodes > 1 and master_port is None:
            master_port = DEFAULT_MASTER_PORT  # every node must name the same one
        return cls(nnodes, node_rank, master_addr, master_port)

    def check(self, world_size: int) -> None:
        if world_size % self.nnodes:
            raise UserError(
                f"world_size {world_size} does not split evenly over {self.nnodes} nodes; use a "
                "node count that divides it"
            )


SINGLE_NODE = NodeLayout()
LAUNCHER_ENV = "SKILL_LAUNCHER"
LAUNCHERS = ("fork", "torchrun")


def torchrun_command(world_size: int, module_args: list[str], nodes: NodeLayout = SINGLE_NODE) -> list[str]:
    """`python -m <module_args>` once per local rank; world_size ranks spread evenly over the nodes."""
    assert world_size % nodes.nnodes == 0, (
        f"world_size {world_size} is not a multiple of {nodes.nnodes} nodes"
    )
    port = nodes.master_port or free_port(nodes.master_addr)
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nodes.nnodes),
        "--node-rank",
        str(nodes.node_rank),
        "--nproc-per-node",
        str(world_size // nodes.nnodes),
        "--master-addr",
        nodes.master_addr,
        "--master-port",
        str(port),
        "-m",
        *module_args,
    ]


def launch_ranks(
    world_size: int,
    module: str,
    args: list[str],
    nodes: NodeLayout = SINGLE_NODE,
    preload: tuple[str, ...] = (),
) -> int:
    """`python -m module args` once per rank of this node; the exit code: 0, or the first failed rank's.

    One node's CPU ranks are forked from this process once it has imported `module` and `preload` (what every
    rank imports: torch, transformers), so a rank starts in milliseconds instead of seconds. torchrun starts the
    ranks of several nodes and ranks on an accelerator, whose runtime must not be initialised in a process that
    forks; SKILL_LAUNCHER=torchrun asks for it everywhere."""
    launcher = os.environ.get(LAUNCHER_ENV, "fork")
    if launcher not in LAUNCHERS:
        raise UserError(f"{LAUNCHER_ENV}={launcher!r} is not a launcher; use one of {', '.join(LAUNCHERS)}")
    from runtime.distributed import select_device

    if launcher == "fork" and nodes.nnodes == 1 and select_device(0).type == "cpu":
        for name in preload:
            importlib.import_module(name)
        return fork_ranks(world_size, module, args)
    return subprocess.call(torchrun_command(world_size, [module, *args], nodes))


def fork_ranks(world_size: int, module: str, args: list[str]) -> int:
    """Each rank runs `module.main()` with sys.argv and the environment torchrun would give it (RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR / MASTER_PORT, one thread unless OMP_NUM_THREADS says otherwise). When a rank fails
    the others are stopped, as torchrun does, since they would wait for it in a collective."""
    entry = importlib.import_module(module).main
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    ranks = set()
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            _rank(rank, world_size, port, entry, [module, *args])
        ranks.add(pid)
    return _wait(ranks)


def _rank(rank: int, world_size: int, port: int, entry: Callable[[], object], argv: list[str]) -> None:
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
