"""Find a model directory's contract classes without touching the installed package.

A model directory holds ``models/modeling_<name>.py`` (exporting ``EntryClass`` or one
``*ForCausalLM`` class) and optionally ``models/configuration_<name>.py`` (one
``PretrainedConfig`` subclass). Modules are imported lazily, under names unique to the
directory, so two models with the same file names can live in one process.
"""

import hashlib
import importlib.util
import inspect
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

from torch import nn
from transformers import PretrainedConfig

from runtime.errors import UserError


def _import(path: Path, aliases: dict[str, ModuleType]) -> ModuleType:
    # the content is part of the name: a file rewritten in place (skill parallelize) is imported afresh
    tag = hashlib.sha1(str(path.resolve()).encode() + path.read_bytes()).hexdigest()[:10]
    name = f"_mis_{path.stem}_{tag}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    saved = {k: sys.modules.get(k) for k in aliases}
    sys.modules.update(aliases)  # lets modeling_x.py `import configuration_x`
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise UserError(
            f"importing {path} failed: {type(e).__name__}: {e}. Fix the file or re-run "
            "`skill migrate --force` to regenerate it."
        ) from e
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return module


def _defined_in(module: ModuleType, predicate) -> list[type]:
    return [
        c
        for _, c in inspect.getmembers(module, inspect.isclass)
        if c.__module__ == module.__name__ and predicate(c)
    ]


@cache
def resolve_model(
    model_dir: Path, model_type: str | None = None
) -> tuple[type[nn.Module], type[PretrainedConfig] | None]:
    """(model class, config class or None) of a model directory; the config class matches model_type if given."""
    models = Path(model_dir) / "models"
    modeling = sorted(models.glob("modeling_*.py"))
    if len(modeling) != 1:
        raise UserError(
            f"{models} must contain exactly one modeling_<name>.py (found {len(modeling)}); "
            "run `skill migrate` to create a model directory."
        )
    config_cls, aliases = None, {}
    for path in sorted(models.glob("configuration_*.py")):
        module = _import(path, {})
        aliases[path.stem] = module
        found = _defined_in(module, lambda c: issubclass(c, PretrainedConfig))
        matching = [c for c in found if model_type is None or getattr(c, "model_type", None) == model_type]
        config_cls = config_cls or (matching[0] if matching else None)
    module = _import(modeling[0], aliases)
    entry = getattr(module, "EntryClass", None)
    if entry is None:
        candidates = _defined_in(module, lambda c: c.__name__.endswith("ForCausalLM"))
        if len(candidates) != 1:
            raise UserError(
                f"{modeling[0]} must define `EntryClass` or exactly one *ForCausalLM class "
                f"(found {[c.__name__ for c in candidates]})."
            )
        entry = candidates[0]
    return entry, config_cls
