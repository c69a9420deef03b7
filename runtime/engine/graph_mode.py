"""`model_config.exe_mode`: the decode step as a compiled graph (prefill stays eager).

``compile`` is ``torch.compile`` with dynamic shapes: batch size and context length are symbols, so the two
graphs warm-up traces (one row, and more) serve every decode step after it. On the host, 16-bit linears keep the weights
oneDNN-packed at load (``swap_host_linears``) and attention reads the paged cache with the host kernel, both
operators of ours that the graph calls as they are; inductor fuses the small operations between them, keeping
eager's roundings to 16 bits (``emulate_precision_casts``: the same greedy tokens). The Ascend modes go through
torchair's NPU backend (untested here: no NPU).
"""

from collections.abc import Callable

import torch
import torch.fx.experimental._config

from runtime.errors import UserError
from runtime.kernels import host_decode_attention


def compile_decode(model: torch.nn.Module, exe_mode: str, device: torch.device) -> Callable:
    if exe_mode == "eager":
        return model
    if exe_mode == "compile":
        if device.type == "cpu":
            host_decode_attention()  # built now: the traced graph only looks it up
        # no duck shapes: sizes that happen to be equal when the graph is traced (the batch, block-table width,
        # KV heads) would otherwise share one symbol, and the graph be traced again as soon as they differ
        torch.fx.experimental._config.use_duck_shape = False
        return torch.compile(model, dynamic=True, options={"emulate_precision_casts": True})
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
