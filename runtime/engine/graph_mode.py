"""`model_config.exe_mode`: the decode step as a compiled graph (prefill stays eager).

``compile`` is ``torch.compile`` with dynamic shapes (batch size and context length are symbols, so one graph
serves every decode step after warm-up) and, on the host, inductor's freezing, which folds the weights in and
prepacks them for oneDNN. The Ascend modes go through torchair's NPU backend (untested here: no NPU).
"""

from collections.abc import Callable

import torch

from runtime.errors import UserError


def compile_decode(model: torch.nn.Module, exe_mode: str, device: torch.device) -> Callable:
    if exe_mode == "eager":
        return model
    if exe_mode == "compile":
        return torch.compile(model, dynamic=True, options={"freezing": device.type == "cpu"})
    try:
        import torchair
    except ImportError as e:
        raise UserError(
            f"exe_mode {exe_mode!r} needs torchair (shipped with torch_npu); install it or use "
            'exe_mode: "compile".'
        ) from e
    config = torchair.CompilerConfig()
    if exe_mode == "npugraph_ex":
        config.mode = "reduce-overhead"
    return torch.compile(model, dynamic=True, backend=torchair.get_npu_backend(compiler_config=config))
