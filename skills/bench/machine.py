"""What the machine can do: its read bandwidth (STREAM-style) and a description for the report."""

import os
import platform
import time

import torch

from runtime.device_memory import synchronize
from runtime.distributed import select_device


def read_bandwidth_gb_s(threads: int, size_mb: int = 1024, repeats: int = 5) -> float:
    """Best of `repeats` passes summing a float32 buffer of `size_mb` MB (far beyond any cache) on the device
    the engines run on: host memory on a CPU machine, the accelerator's memory where one is present."""
    device = select_device(0)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(size_mb * 2**20 // 4, device=device)
        buf.sum()
        best = float("inf")
        for _ in range(repeats):
            synchronize(device)
            start = time.perf_counter()
            buf.sum()
            synchronize(device)
            best = min(best, time.perf_counter() - start)
        return buf.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(saved)


def describe(threads: int) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    device = select_device(0)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": threads,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
