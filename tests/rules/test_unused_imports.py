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


GUARDED = dedent("""\
    import torch
    from transformers.utils import is_flash_attn_available, is_torch_available

    if is_flash_attn_available():
        from transformers.modeling_flash_attention_utils import flash_fn

    if is_torch_available():
        from torch import nn


    class LlamaMLP(nn.Module):
        pass
    """)


def test_an_if_that_only_guarded_unused_imports_goes_with_them(run_rule):
    """Falcon's `if is_flash_attn_available(...):` around a flash-attention import nothing calls any more goes,
    and its predicate's import with it; a guard around an import still used stays."""
    after = run_rule(rule, GUARDED)
    assert after == GUARDED.replace(
        "import torch\nfrom transformers.utils import is_flash_attn_available, is_torch_available\n\n"
        "if is_flash_attn_available():\n    from transformers.modeling_flash_attention_utils import flash_fn\n\n",
        "from transformers.utils import is_torch_available\n\n",
    )
    assert run_rule(rule, after) == after


def test_string_annotations_and_all_use_a_name_a_nested_import_does_not(run_rule):
    code = dedent("""\
        from typing import TYPE_CHECKING
        from transformers.cache_utils import Cache
        from transformers.utils import logging
        import torch

        __all__ = ["logging"]


        def f(cache: "Cache | None" = None):
            from torch import nn

            return nn.Identity(), cache.layers  # `torch` only as a module name, `layers` only as an attribute
        """)
    assert run_rule(rule, code) == code.replace("from typing import TYPE_CHECKING\n", "").replace(
        "import torch\n", ""
    )


def test_a_kept_last_name_keeps_its_comma_a_new_last_name_loses_it(run_rule):
    code = dedent("""\
        from transformers.utils import (
            auto_docstring,
            logging,
        )
        from torch import (
            nn,
            Tensor,
        )

        logger = logging.get_logger(__name__)
        layer = nn.Linear
        """)
    # the comma goes with the line break it held (the formatter lays the statement out again afterwards)
    assert run_rule(rule, code) == code.replace("    auto_docstring,\n", "").replace(
        "    nn,\n    Tensor,\n)", "    nn)"
    )


def test_comments_in_an_import_list_stay_and_string_annotations_are_read_as_code(run_rule):
    code = dedent("""\
        from typing import Literal
        from torch import (
            Tensor,
            # the runtime's layers
            nn,
            Size,
            device,
        )

        Mode = Literal["Size"]


        def f(x: "torch.Tensor", layer: "nn.Module", mode: Literal["device"]) -> "Mode":
            return x
        """)
    # `Tensor` is an attribute of the annotation `torch.Tensor`, and words in a Literal are not names; the comment
    # after a dropped name moves to the parenthesis before it
    assert run_rule(rule, code) == code.replace("    Tensor,\n", "").replace(
        "    nn,\n    Size,\n    device,\n)", "    nn)"
    )
