"""YAML keys the strict config accepts (the seeds' YAMLs carry them) but that change nothing on this runtime.
Each one set to a value that asks for something is named once per process, with the reason, instead of being
ignored silently."""

import logging
import os
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_ASCEND = "an Ascend (torch_npu / torchair) switch; this runtime has no such path, so it has no effect here"
# (section, key) -> (does this value ask for something?, why nothing happens)
NO_EFFECT: dict[tuple[str, str], tuple[Callable[[Any], bool], str]] = {
    ("model_config", "enable_weight_nz"): (bool, f"the NZ weight layout is {_ASCEND}; weights stay ND"),
    ("model_config", "enable_cache_compile"): (bool, f"the compile cache is {_ASCEND}"),
    ("model_config", "enable_static_kernel"): (bool, f"static kernels are {_ASCEND}"),
    ("model_config", "platform_version"): (lambda v: v is not None, f"the platform tag is {_ASCEND}"),
    ("model_config", "force_eplb"): (
        bool,
        (
            "expert-parallel load balancing (moving hot experts between ranks) is not implemented; "
            "each rank keeps the fixed block of experts moe_ep_group gives it"
        ),
    ),
    ("model_config", "next_n"): (bool, "multi-token prediction (MTP) is not implemented: one token per step"),
    ("scheduler_config", "num_reserved_decode_tokens"): (
        lambda v: v != 64,
        "the engine keeps no decode reserve in the KV pool; it preempts when the pool runs out",
    ),
}
_warned: set[tuple[str, str]] = set()


def warn_ineffective(doc: dict, source: str) -> list[str]:
    """Warnings for the keys of the YAML mapping `doc` that have no effect (each logged once per process, by
    rank 0 only); returns all of them."""
    found = []
    for (section, key), (asks, why) in NO_EFFECT.items():
        values = doc.get(section) or {}
        if isinstance(values, dict) and key in values and asks(values[key]):
            found.append(f"{source}: `{section}.{key}: {values[key]}` has no effect: {why}.")
            if (section, key) not in _warned and os.environ.get("RANK", "0") == "0":
                _warned.add((section, key))
                logger.warning(found[-1])
    return found
