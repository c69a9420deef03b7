"""WorkerManager: starts the engine workers (one process per rank) and stops them."""

import logging
import os
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

from runtime.config import DisaggConfig
from runtime.fork_launch import DeferredRanks
from runtime.launch import SINGLE_NODE, NodeLayout, forks_ranks, torchrun_command
from runtime.online.messages import WorkerAddresses

logger = logging.getLogger(__name__)
WORKER_MODULE = "runtime.online.online_inference"


class WorkerManager:
    """Made before the server starts threads, sockets or an event loop: one node's CPU ranks are forked from a
    launcher forked here (runtime/fork_launch.py), which has the engine imported; other ranks run under torchrun.
    Either way the workers lead a session of their own: a terminal's Ctrl-C reaches the server, which stops them
    in order."""

    def __init__(
        self,
        model_dir: Path,
        yaml_path: Path,
        world_size: int,
        max_model_len: int | None = None,
        nodes: NodeLayout = SINGLE_NODE,
        disagg: DisaggConfig | None = None,
        held: Sequence[socket.socket] = (),
    ):
        """held: the server's sockets, which the workers must not keep open."""
        self.args = [
            "--model-dir",
            str(model_dir),
            "--yaml",
            str(yaml_path),
            "--parent-pid",
            str(os.getpid()),
        ]
        if max_model_len is not None:
            self.args += ["--max-model-len", str(max_model_len)]
        if disagg is not None:
            self.args += ["--disagg", disagg.model_dump_json()]
        self.world_size, self.nodes = world_size, nodes
        preload = (WORKER_MODULE, "transformers.modeling_utils")
        self.forked = DeferredRanks(world_size, nodes, preload, held) if forks_ranks(nodes) else None
        self.proc: subprocess.Popen | DeferredRanks | None = None

    def start(self, addresses: WorkerAddresses | None) -> None:
        """addresses: node 0's; the ranks of other nodes get them from global rank 0."""
        args = list(self.args)
        if addresses is not None:
            args += ["--requests", ",".join(addresses.requests), "--results", addresses.results]
        if self.forked is not None:
            logger.info(
                "starting %d engine worker(s), forked by launcher %d", self.world_size, self.forked.pid
            )
            self.forked.start(WORKER_MODULE, args)
            self.proc = self.forked
            return
        cmd = torchrun_command(self.world_size, [WORKER_MODULE, *args], self.nodes)
        logger.info("starting the engine workers: %s", " ".join(cmd))
        self.proc = subprocess.Popen(cmd, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Wait for the workers to leave (after a Shutdown), then terminate, then kill."""
        if self.proc is None:
            if self.forked is not None:
                self.forked.close()
            return None
        for action in (None, self.proc.terminate, self.proc.kill):
            if action:
                action()
            try:
                return self.proc.wait(timeout_s if action is None else 10)
            except subprocess.TimeoutExpired:
                logger.warning(
                    "engine workers still running after %s; stopping them",
                    "shutdown" if action is None else "SIGTERM",
                )
        return self.proc.wait()
