"""unused_imports: imports nothing uses any more are removed."""

from textwrap import dedent

from skills.migrator.rules.unused_imports import UnusedImports as rule

BEFORE = dedent("""\
    from __future__ import annotations

    import math
    from collections.abc import Callable, Iterable

    import torch
    import torch.nn.functional as F
    from torch import nn

    from configuration_llama import LlamaConfig
    from transformers.cache_utils import Cache, DynamicCache
    from transformers.utils import auto_docstring as ad, logging
    from runtime.layers.attention import *


    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x, x), dim=-1)


    class LlamaMLP(nn.Module):
        def __init__(self, config: LlamaConfig, weights: Iterable[int]):
            super().__init__()
    """)

AFTER = dedent("""\
    from __future__ import annotations
    from collections.abc import Iterable

    import torch
    from torch import nn

    from configuration_llama import LlamaConfig
    from runtime.layers.attention import *


    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x, x), dim=-1)


    class LlamaMLP(nn.Module):
        def __init__(self, config: LlamaConfig, weights: Iterable[int]):
            super().__init__()
    """)


def test_unused_imports_removed(run_rule):
    # __future__ and star imports are never removed; partly used `from` imports lose their unused names.
    assert run_rule(rule, BEFORE) == AFTER


def test_idempotent(run_rule):
    assert run_rule(rule, AFTER) == AFTER


def test_used_imports_untouched(run_rule):
    code = dedent("""\
        import torch
        import torch.nn.functional as F
        from transformers.activations import ACT2FN
        from transformers.modeling_rope_utils import dynamic_rope_update


        class MLP(torch.nn.Module):
            @dynamic_rope_update
            def forward(self, x):
                return ACT2FN["silu"](F.linear(x, self.w))
        """)
    assert run_rule(rule, code) == code
