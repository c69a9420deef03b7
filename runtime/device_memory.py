"""Device helpers: free memory after the weights, zeroed KV buffers that cost only what is used, and a sync
for timing."""

import math
import os

import numpy as np
import torch


def free_memory_bytes(device: torch.device) -> int:
    """Bytes still free on ``device``: the allocator's view on CUDA / NPU, MemAvailable on the host."""
    if device.type in ("cuda", "npu"):
        return getattr(torch, device.type).mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the host it comes from calloc'd pages that the OS commits only when written, so a KV
    pool sized from memory makes resident just the blocks requests have used."""
    if device.type != "cpu" or not math.prod(shape):  # an empty one (a latent cache's values) has no pages
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = np.zeros(math.prod(shape) * dtype.itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


def return_cached_memory(device: torch.device) -> None:
    """Hand the allocator's cached free blocks back to the device, so free_memory_bytes counts them."""
    if device.type in ("cuda", "npu"):
        getattr(torch, device.type).empty_cache()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so host timers measure it (a no-op on the host)."""
    if device.type in ("cuda", "npu"):
        getattr(torch, device.type).synchronize(device)
