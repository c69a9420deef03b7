"""WorkerManager: starts the engine workers (one process per rank, under torchrun) and stops them."""

import logging
import os
import subprocess
from pathlib import Path

from runtime.config import DisaggConfig
from runtime.launch import SINGLE_NODE, NodeLayout, torchrun_command
from runtime.online.messages import WorkerAddresses

logger = logging.getLogger(__name__)


class WorkerManager:
    def __init__(
        self,
        model_dir: Path,
        yaml_path: Path,
        world_size: int,
        addresses: WorkerAddresses | None,
        max_model_len: int | None = None,
        nodes: NodeLayout = SINGLE_NODE,
        disagg: DisaggConfig | None = None,
    ):
        args = [
            "runtime.online.online_inference",
            "--model-dir",
            str(model_dir),
            "--yaml",
            str(yaml_path),
            "--parent-pid",
            str(os.getpid()),
        ]
        if addresses is not None:  # node 0; the ranks of other nodes get them from global rank 0
            args += ["--requests", ",".join(addresses.requests), "--results", addresses.results]
        if max_model_len is not None:
            args += ["--max-model-len", str(max_model_len)]
        if disagg is not None:
            args += ["--disagg", disagg.model_dump_json()]
        self.cmd = torchrun_command(world_size, args, nodes)
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        logger.info("starting the engine workers: %s", " ".join(self.cmd))
        # A session of their own: a terminal's Ctrl-C reaches the server, which stops the workers in order.
        self.proc = subprocess.Popen(self.cmd, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Wait for the workers to leave (after a Shutdown), then terminate, then kill."""
        if self.proc is None:
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
