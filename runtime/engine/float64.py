"""float64 throughout, for code written with float32 in mind.

Models pin parts of their computation to float32 for bfloat16 runs: routers, softmaxes, gates
(``x.float()``, ``torch.softmax(..., dtype=torch.float32)``, ``nn.Parameter(..., dtype=torch.float32)``). Run
in float64, such code mixes the two dtypes, which fails (``expected scalar type Float but found Double``) or
rounds the pinned parts to float32. A float64 run is a precision check (`skill verify` settles float32 drift with
one), so under ``Float64`` every float32 the code names, and the default dtype, is float64 instead; transformers'
reference and the migrated model run under it alike."""

import contextlib

import torch
from torch.overrides import TorchFunctionMode


def _widened(value):
    return torch.float64 if value is torch.float32 else value


class Float64(TorchFunctionMode):
    def __enter__(self):
        self._saved = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.set_default_dtype(self._saved)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        args = tuple(_widened(a) for a in args)
        kwargs = {k: _widened(v) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


def in_dtype(dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Float64 for a float64 run; nothing to change for any other dtype."""
    return Float64() if dtype == torch.float64 else contextlib.nullcontext()
