"""Process bootstrap: picks this rank's device and collective backend from the environment its launcher (the fork
launcher of runtime/launch.py, or torchrun) gives it."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from runtime.errors import UserError

_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError:
        return False
    return torch.npu.is_available()


def select_device(local_rank: int) -> torch.device:
    if _npu_available():
        return torch.device("npu", local_rank)
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _device_type(device: torch.device | str) -> str:
    # torch.device("npu") only parses once torch_npu is imported, so strings are split by hand.
    return device.split(":")[0] if isinstance(device, str) else device.type


def backend_for(device: torch.device | str) -> str:
    kind = _device_type(device)
    if kind not in _BACKENDS:
        raise UserError(f"no collective backend for device type {kind!r}; use one of {sorted(_BACKENDS)}")
    return _BACKENDS[kind]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    try:
        return int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer") from None


def _resolve_device(device_override: str | None, local_rank: int) -> torch.device:
    if device_override is None:
        return select_device(local_rank)
    if _device_type(device_override) == "npu" and not _npu_available():
        raise UserError("device 'npu' requested but torch_npu is not installed or sees no NPU")
    device = torch.device(device_override)
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, local_rank)
    return device


def init_distributed(device_override: str | None = None) -> DistInfo:
    """Reads RANK / WORLD_SIZE / LOCAL_RANK; joins the default group (env://) when WORLD_SIZE > 1."""
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", rank)
    if not 0 <= rank < world_size:
        raise UserError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
    device = _resolve_device(device_override, local_rank)
    backend = backend_for(device)
    if device.type != "cpu":
        getattr(torch, device.type).set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return DistInfo(rank, world_size, local_rank, device, backend)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def leave_worker(code: int = 0) -> None:
    """Ends a rank after its output is flushed, skipping interpreter teardown: freeing the gloo
    groups' threads there now and then aborts the process ("terminate called without an active exception")."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
