"""Locate the HF source of a checkpoint's architecture: the installed transformers' files, or the
checkpoint's own remote code (parsed, never executed)."""

import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import UserError


@dataclass(frozen=True)
class VendoredSource:
    model_type: str
    entry_class: str  # the *ForCausalLM class
    modeling: Path
    configuration: Path | None
    hf_package: str  # for `from .x import y` in the modeling file
    remote_code: bool
    config_package: str = ""  # the same for the configuration file, when it lives elsewhere
    # (config class the modeling file imports, the vendored configuration's class) when a type borrows
    # another's modeling code, as exaone runs LlamaForCausalLM with its own ExaoneConfig
    config_rename: tuple[str, str] | None = None


def read_config_json(checkpoint: Path) -> dict:
    path = checkpoint / "config.json"
    if not path.is_file():
        raise UserError(
            f"{checkpoint} has no config.json; a migration source must be a Hugging Face checkpoint "
            "directory (config.json, *.safetensors, tokenizer files)."
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}).") from e


def checkpoint_config(checkpoint: Path, remote_code: bool, trust_remote_code: bool):
    """The checkpoint's transformers config with the config class's defaults filled in, or None when
    transformers cannot build it here (remote code not trusted, a config it rejects)."""
    from transformers import AutoConfig

    if remote_code and not trust_remote_code:
        return None
    try:
        return AutoConfig.from_pretrained(checkpoint, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def snake_name(model_type: str) -> str:
    return re.sub(r"[^0-9a-zA-Z]+", "_", model_type).strip("_").lower()


def _remote(checkpoint: Path, config: dict, auto_map: dict) -> VendoredSource:
    ref = auto_map.get("AutoModelForCausalLM")
    if not ref:
        raise UserError(
            f"{checkpoint}/config.json auto_map has no AutoModelForCausalLM entry; only causal LMs migrate."
        )
    module, entry = ref.split("--")[-1].rsplit(".", 1)
    modeling = checkpoint / f"{module}.py"
    config_ref = auto_map.get("AutoConfig", "")
    configuration = checkpoint / f"{config_ref.split('--')[-1].rsplit('.', 1)[0]}.py" if config_ref else None
    if not modeling.is_file():
        raise UserError(f"auto_map names {modeling.name}, which is not in {checkpoint}.")
    return VendoredSource(
        config.get("model_type", module), entry, modeling, configuration, "transformers", True
    )


def locate_source(checkpoint: Path) -> VendoredSource:
    config = read_config_json(checkpoint)
    if auto_map := config.get("auto_map"):
        return _remote(checkpoint, config, auto_map)
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(
            f"architecture {model_type!r} (config.json model_type) has no causal-LM implementation in "
            "the installed transformers; upgrade transformers or provide the model code via auto_map."
        )
    archs = [a for a in config.get("architectures") or [] if a.endswith("ForCausalLM")]
    entry = next(
        (a for a in archs if hasattr(transformers, a)), MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    )
    entry_cls, config_cls = getattr(transformers, entry), CONFIG_MAPPING[model_type]
    imported = getattr(entry_cls.config_class, "__name__", config_cls.__name__)
    return VendoredSource(
        model_type,
        entry,
        Path(inspect.getsourcefile(entry_cls)),
        Path(inspect.getsourcefile(config_cls)),
        entry_cls.__module__.rpartition(".")[0],
        False,
        config_cls.__module__.rpartition(".")[0],
        (imported, config_cls.__name__) if imported != config_cls.__name__ else None,
    )
