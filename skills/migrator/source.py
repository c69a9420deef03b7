"""Turn `skill migrate`'s source argument (a local dir, a Hub URL or ORG/REPO) into a local checkpoint dir."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
from huggingface_hub.errors import LocalEntryNotFoundError

from runtime.errors import UserError

_HUB_URL = re.compile(
    r"(?:https?://)?(?:www\.)?(?:huggingface\.co|hf\.co)/(?P<repo>[\w.-]+/[\w.-]+)"
    r"(?:/(?:tree|blob|resolve)/(?P<rev>[^/?#]+))?/?(?:[/?#].*)?"
)
_REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")
# what a migration reads: config, tokenizer, weights, remote code
ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.py",
    "tokenizer*",
    "*.model",
    "*.tiktoken",
    "merges.txt",
    "vocab.txt",
    "*.jinja",
]
TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ResolvedSource:
    path: Path  # local directory holding config.json
    source: str  # as the user gave it
    repo_id: str | None
    url: str  # the Hub page, or the local directory


def _offline() -> bool:
    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return flag.upper() in {"1", "ON", "YES", "TRUE"} or huggingface_hub.constants.HF_HUB_OFFLINE


def _local(source: str, path: Path) -> ResolvedSource:
    if not (path / "config.json").is_file():
        raise UserError(
            f"{path} has no config.json, so it is not a Hugging Face checkpoint directory; pass the "
            "directory that holds config.json (and the tokenizer and *.safetensors files)."
        )
    return ResolvedSource(path.resolve(), source, None, str(path.resolve()))


def _cached(repo_id: str, revision: str) -> Path | None:
    try:
        path = Path(
            huggingface_hub.snapshot_download(
                repo_id, revision=revision, local_files_only=True, allow_patterns=ALLOW_PATTERNS
            )
        )
    except LocalEntryNotFoundError:
        return None
    return path if (path / "config.json").is_file() else None


def _download(repo_id: str, revision: str) -> Path:
    try:
        # a short probe first: no retries, so an unreachable Hub fails in seconds
        info = huggingface_hub.HfApi().model_info(repo_id, revision=revision, timeout=TIMEOUT_S)
        return Path(
            huggingface_hub.snapshot_download(
                repo_id, revision=info.sha, allow_patterns=ALLOW_PATTERNS, etag_timeout=TIMEOUT_S
            )
        )
    except Exception as e:  # the network boundary: connection, HTTP, auth and disk errors alike
        raise UserError(
            f"could not download {repo_id}@{revision} from the Hugging Face Hub "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'}); check the "
            "repository name and your network or token, or download it elsewhere and pass the local "
            "directory instead."
        ) from e


def _hub(source: str, repo_id: str, revision: str) -> ResolvedSource:
    url = f"https://huggingface.co/{repo_id}" + (f"/tree/{revision}" if revision != "main" else "")
    path = _cached(repo_id, revision)
    if path is None and _offline():
        raise UserError(
            f"{repo_id}@{revision} is not in the Hugging Face cache "
            f"({huggingface_hub.constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set, so it cannot be "
            f"downloaded; run `hf download {repo_id}` on a machine with network access and pass the "
            "downloaded directory, populate the cache (HF_HUB_CACHE), or unset HF_HUB_OFFLINE."
        )
    path = path or _download(repo_id, revision)
    if not (path / "config.json").is_file():
        raise UserError(
            f"{repo_id}@{revision} has no config.json ({url}); pick a repository with a "
            "transformers checkpoint."
        )
    return ResolvedSource(path, source, repo_id, url)


def resolve_source(source: str, revision: str | None = None) -> ResolvedSource:
    """Resolve a local dir, https://huggingface.co/ORG/REPO[/tree/REV] or ORG/REPO to a dir with config.json.

    Hub sources are looked up in the local HF cache first and downloaded only when HF_HUB_OFFLINE is unset.
    """
    path = Path(source).expanduser()
    if path.exists():
        return _local(source, path)
    if url := _HUB_URL.fullmatch(source):
        return _hub(source, url["repo"], revision or url["rev"] or "main")
    if _REPO_ID.fullmatch(source) and not source.startswith("."):
        return _hub(source, source, revision or "main")
    raise UserError(
        f"source {source!r} is neither an existing directory nor a Hugging Face repository "
        "(https://huggingface.co/ORG/REPO or ORG/REPO); check the path or the repository name."
    )
