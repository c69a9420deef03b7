"""Starting one process per local rank: forked from this process for one node's CPU ranks, else under torchrun
(its static rendezvous, across nodes too)."""

import os
import socket
import subprocess
import sys
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


def forks_ranks(nodes: NodeLayout) -> bool:
    """Whether this node's ranks are forked from this process (runtime/fork_launch.py) rather than started by
    torchrun: one node whose ranks run on the CPU. Ranks on an accelerator, whose runtime must not be initialised
    in a process that forks, and several nodes use torchrun; SKILL_LAUNCHER=torchrun asks for it everywhere."""
    launcher = os.environ.get(LAUNCHER_ENV, "fork")
    if launcher not in LAUNCHERS:
        raise UserError(f"{LAUNCHER_ENV}={launcher!r} is not a launcher; use one of {', '.join(LAUNCHERS)}")
    from runtime.distributed import select_device

    return launcher == "fork" and nodes.nnodes == 1 and select_device(0).type == "cpu"


def launch_ranks(
    world_size: int,
    module: str,
    args: list[str],
    nodes: NodeLayout = SINGLE_NODE,
    preload: tuple[str, ...] = (),
) -> int:
    """`python -m module args` once per rank of this node; the exit code: 0, or the first failed rank's. Forked
    ranks start once this process has imported `module` and `preload` (what every rank imports: torch,
    transformers), in milliseconds instead of seconds."""
    if forks_ranks(nodes):
        from runtime.fork_launch import fork_ranks, import_modules

        import_modules(preload)
        return fork_ranks(world_size, module, args, nodes)
    return subprocess.call(torchrun_command(world_size, [module, *args], nodes))
