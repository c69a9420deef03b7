"""The rules' output, stored by what it was computed from (opt-in: ``SKILL_CODEGEN_CACHE=<directory>``).

The rules are deterministic: the same sources, options and checkpoint config, rewritten by the same code of
skills/ and runtime/ under the same transformers, libcst and ruff, give the same files. An entry's key hashes
all of these, so changing any of them is a miss, never a stale answer. A run of `skill migrate` spends most of
its time in the rules; with the cache, migrating the same architecture again (another checkpoint of the same
shape, another --dtype) skips them.
"""

import hashlib
import json
import logging
import os
from collections.abc import Callable
from functools import cache
from importlib.metadata import version
from pathlib import Path
from typing import Any, TypeVar

from skills.atomic_write import write_text_atomic

ENV = "SKILL_CODEGEN_CACHE"
_ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")
logger = logging.getLogger(__name__)


@cache
def _code_fingerprint() -> str:
    """The rules' code and the libraries they run on."""
    h = hashlib.sha256(" ".join(f"{p}=={version(p)}" for p in ("transformers", "libcst", "ruff")).encode())
    for path in sorted([*(_ROOT / "skills").rglob("*.py"), *(_ROOT / "runtime").rglob("*.py")]):
        h.update(path.relative_to(_ROOT).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def config_key(config: Any) -> list | None:
    """A transformers config as a key: its class and values, without the path it was loaded from."""
    if config is None:
        return None
    values = {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}
    return [
        type(config).__module__,
        type(config).__qualname__,
        json.dumps(values, sort_keys=True, default=repr),
    ]


def cached(
    kind: str, inputs: Any, compute: Callable[[], T], dump: Callable[[T], dict], load: Callable[[dict], T]
) -> T:
    """compute(), or what it returned for the same `kind` and JSON-able `inputs` under the same code."""
    root = os.environ.get(ENV)
    if not root:
        return compute()
    blob = json.dumps([kind, inputs, _code_fingerprint()], sort_keys=True, default=str)
    path = Path(root) / kind / f"{hashlib.sha256(blob.encode()).hexdigest()}.json"
    try:
        return load(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not there yet, or unreadable: computed again
    value = compute()
    try:
        write_text_atomic(path, json.dumps(dump(value)))
    except OSError as e:
        logger.warning("could not store converted code in %s=%s (%s); it is not cached", ENV, root, e)
    return value
