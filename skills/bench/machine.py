"""What the machine can do: its read bandwidth (STREAM-style) and a description for the report."""

import os
import platform
import time

import torch


def read_bandwidth_gb_s(threads: int, size_mb: int = 1024, repeats: int = 5) -> float:
    """Best of `repeats` passes summing a float32 buffer of `size_mb` MB (far beyond any cache)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(size_mb * 2**20 // 4)
        buf.sum()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            buf.sum()
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
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
