"""`model_config.exe_mode`: the decode step as a compiled graph (prefill stays eager).

``compile`` is ``torch.compile`` with dynamic shapes: batch size and context length are symbols, so the two
graphs warm-up traces (one row, and more) serve every decode step after it. On the host, the linears run oneDNN's
products on weights packed at load or the host kernel (``swap_host_linears`` picks), and attention reads the paged
cache with the host kernel, all operators of ours that the graph calls as they are; inductor fuses the small
operations between them, keeping eager's roundings to 16 bits (``emulate_precision_casts``: the same greedy tokens). The Ascend modes go through
torchair's NPU backend (untested here: no NPU).
"""

from collections.abc import Callable

import torch
import torch.fx.experimental._config

from runtime.errors import UserError
from runtime.kernels import host_decode_attention

# guards on what a module is made of, which the runtime fixes at load: hook dicts, attribute presence, types
_STRUCTURE_GUARDS = {"EMPTY_NN_MODULE_HOOKS_DICT", "NOT_PRESENT_IN_GENERIC_DICT", "HASATTR"}


def skip_module_structure_guards(entries: list) -> list[bool]:
    """``torch.compile``'s ``guard_filter_fn``: drops the guards on what the model's modules are made of (their
    hook dicts, which attributes they have, the types of their dicts and submodules), which nothing changes once
    the weights are loaded, and keeps the rest: values (a module's ints, bools, buffers), the parameters' dtypes
    and shapes (two models of one class share dynamo's cache of its code) and aliasing. A model that changes a
    guarded value is still traced again. SmolLM2's decode step checked 6925 guards in ~1.4 ms; it keeps 2449
    (0.6-0.9 ms)."""
    return [
        not (
            entry.orig_guard.source.is_unspecialized_nn_module()
            and (
                entry.guard_type in _STRUCTURE_GUARDS
                or (entry.guard_type == "TYPE_MATCH" and isinstance(entry.value, (dict, torch.nn.Module)))
            )
        )
        for entry in entries
    ]


def compile_decode(model: torch.nn.Module, exe_mode: str, device: torch.device) -> Callable:
    if exe_mode == "eager":
        return model
    if exe_mode == "compile":
        if device.type == "cpu":
            host_decode_attention()  # built now: the traced graph only looks it up
        # no duck shapes: sizes that happen to be equal when the graph is traced (the batch, block-table width,
        # KV heads) would otherwise share one symbol, and the graph be traced again as soon as they differ
        torch.fx.experimental._config.use_duck_shape = False
        return torch.compile(
            model,
            dynamic=True,
            options={"emulate_precision_casts": True, "guard_filter_fn": skip_module_structure_guards},
        )
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
