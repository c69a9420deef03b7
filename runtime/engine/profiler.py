"""`model_config.enable_profiler`: torch.profiler traces of the first prefill and the first decode steps.

Chrome trace JSON goes to ``<output dir>/prof/{prefill,decode}/``, and a table of the top ops by self time to
the log. CPU always, CUDA when the device is a GPU, torch_npu's profiler on an NPU.
"""

import contextlib
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DECODE_STEPS = 3


def _activities(device: torch.device) -> list:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


class StepProfiler:
    def __init__(self, out_dir: Path, device: torch.device, decode_steps: int = DECODE_STEPS):
        self.out_dir, self.device = out_dir / "prof", device
        self.left = {"prefill": 1, "decode": decode_steps}

    @contextlib.contextmanager
    def step(self, is_prefill: bool):
        stage = "prefill" if is_prefill else "decode"
        if not self.left[stage]:
            yield
            return
        self.left[stage] -= 1
        if self.device.type == "npu":
            import torch_npu

            prof = torch_npu.profiler.profile(
                on_trace_ready=torch_npu.profiler.tensorboard_trace_handler(str(self.out_dir / stage))
            )
        else:
            prof = torch.profiler.profile(activities=_activities(self.device), record_shapes=True)
        with prof:
            yield
        if self.device.type != "npu":
            target = self.out_dir / stage
            target.mkdir(parents=True, exist_ok=True)
            path = target / f"step_{len(list(target.glob('*.json')))}.json"
            prof.export_chrome_trace(str(path))
            sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            logger.info(
                "[Profiler] %s step, trace %s\n%s",
                stage,
                path,
                prof.key_averages().table(sort_by=sort, row_limit=15),
            )
