"""Where offline prompts come from (the command line, a file, or the YAML's data_config) and how a prompt
becomes token ids; shared by the engine's offline path and the standalone runner."""

import json
import logging
from pathlib import Path

from runtime.config import InferenceConfig
from runtime.errors import UserError

DEFAULT_PROMPTS = Path(__file__).with_name("default_prompt.json")
logger = logging.getLogger(__name__)


def encode_prompt(tokenizer, prompt: str, chat: bool, limit: int) -> list[int]:
    """The prompt's ids, through the chat template when asked and the tokenizer has one; longer than
    ``limit`` (data_config.input_truncated_len) keeps the last ``limit`` tokens."""
    if chat and tokenizer.chat_template:
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    else:
        ids = tokenizer(prompt)["input_ids"]
    if len(ids) > limit:
        logger.warning(
            "prompt of %d tokens truncated to its last %d (data_config.input_truncated_len)", len(ids), limit
        )
    return list(ids[-limit:])


def read_prompts_file(path: Path) -> list[str]:
    """A JSON list of strings, or plain text with one prompt per line."""
    if not path.is_file():
        raise UserError(f"prompts file {path} does not exist.")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            prompts = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{path} is not valid JSON ({e}); it must hold a list of strings.") from e
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise UserError(f"{path} must hold a JSON list of strings.")
        return prompts
    return [line for line in text.splitlines() if line.strip()]


def prompts_from_config(config: InferenceConfig) -> list[str]:
    dc = config.data_config
    if dc.prompts:
        return list(dc.prompts)
    if dc.dataset_path:
        return read_prompts_file(Path(dc.dataset_path))
    if dc.dataset == "default":
        return read_prompts_file(DEFAULT_PROMPTS)
    raise UserError(
        f'data_config.dataset {dc.dataset!r} is not bundled; use dataset: "default", list '
        "prompts under data_config.prompts, or point data_config.dataset_path at a prompts file."
    )
