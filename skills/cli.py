"""The `skill` command line."""
import functools
import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from runtime.errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Port Hugging Face causal LMs to the runtime contract, parallelize and run them.")
err = Console(stderr=True)


@app.callback()
def _group():
    """Port Hugging Face causal LMs to the runtime contract, parallelize and run them."""


def user_errors(fn):
    """Print a UserError as one paragraph (no traceback) and exit with its code."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
    return wrapper


def find_yaml(model_dir: Path, yaml_file: Path | None) -> Path:
    if yaml_file is not None:
        return yaml_file
    if not model_dir.is_dir():
        raise UserError(f"model directory {model_dir} does not exist; pass the directory `skill migrate` wrote.")
    candidates = sorted((model_dir / "config").glob("*.yaml"))
    preferred = model_dir / "config" / f"{model_dir.name}.yaml"
    if preferred in candidates:
        return preferred
    if len(candidates) == 1:
        return candidates[0]
    raise UserError(f"cannot tell which YAML of {model_dir / 'config'} to use (found "
                    f"{[c.name for c in candidates] or 'none'}); pass --yaml FILE.")


@app.command()
@user_errors
def run(
    model_dir: Annotated[Path, typer.Argument(help="Model directory (models/ + config/).")],
    yaml_file: Annotated[Path | None, typer.Option("--yaml", help="YAML to run (default: config/<dir>.yaml).")] = None,
    prompt: Annotated[list[str] | None, typer.Option("--prompt", help="A prompt; repeat for several.")] = None,
    prompts_file: Annotated[Path | None, typer.Option(help="JSON list of prompts, or one per line.")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(min=1, help="Override scheduler_config.max_new_tokens.")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="Feed prompts as plain text, without the chat template.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
):
    """Run offline inference on a model directory."""
    from runtime.config import InferenceConfig
    from runtime.logging_config import setup_logging
    from runtime.offline import OfflineInference, prompts_from_config, read_prompts_file

    config = InferenceConfig.from_yaml(find_yaml(model_dir, yaml_file))
    if max_new_tokens is not None:
        config.scheduler_config.max_new_tokens = max_new_tokens
    prompts = list(prompt or []) + (read_prompts_file(prompts_file) if prompts_file else [])
    prompts = prompts or prompts_from_config(config)
    llm = OfflineInference(config, model_dir)
    setup_logging(llm.dist.rank)
    results = llm.generate(prompts, chat=not raw)
    if llm.dist.rank != 0:
        return
    if as_json:
        print(json.dumps({"outputs": [r.to_dict() for r in results], "prefill_ms": llm.prefill_avg_ms,
                          "decode_avg_ms": llm.decode_avg_ms}, ensure_ascii=False))
    else:
        for r in results:
            err.print(f"[bold]> {r.prompt}[/]", highlight=False)
            sys.stdout.write(r.text + "\n")


def main():
    from runtime.logging_config import setup_logging
    setup_logging()
    app()


if __name__ == "__main__":
    main()
