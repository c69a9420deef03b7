"""Source resolution without the network: local dirs, a hand-built HF cache, and fast offline failures."""

import time
from pathlib import Path

import huggingface_hub
import pytest

from runtime.errors import UserError
from skills.migrator.source import resolve_source

SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline, empty HF cache under tmp (constants are read at import, so patch them too)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def cache_repo(cache: Path, repo_id: str) -> Path:
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"model_type": "llama"}')
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    return snapshot


def test_local_dir(tmp_path: Path):
    (tmp_path / "config.json").write_text("{}")
    resolved = resolve_source(str(tmp_path))
    assert (
        resolved.path == tmp_path.resolve() and resolved.repo_id is None and resolved.source == str(tmp_path)
    )


def test_local_dir_without_config(tmp_path: Path):
    with pytest.raises(UserError, match="no config.json"):
        resolve_source(str(tmp_path))


def test_missing_local_path():
    with pytest.raises(UserError, match="neither an existing directory"):
        resolve_source("/nonexistent/model/dir")


@pytest.mark.parametrize(
    "source",
    [
        "org/tiny",
        "https://huggingface.co/org/tiny",
        "https://huggingface.co/org/tiny/tree/main",
        "hf.co/org/tiny/",
    ],
)
def test_cache_hit(hf_cache: Path, source: str):
    snapshot = cache_repo(hf_cache, "org/tiny")
    resolved = resolve_source(source)
    assert resolved.path == snapshot and resolved.repo_id == "org/tiny" and resolved.source == source
    assert resolved.url == "https://huggingface.co/org/tiny"


def test_revision_from_url(hf_cache: Path):
    snapshot = cache_repo(hf_cache, "org/tiny")
    resolved = resolve_source(f"https://huggingface.co/org/tiny/tree/{SHA}")
    assert resolved.path == snapshot and resolved.url.endswith(f"/tree/{SHA}")


def test_offline_miss_fails_fast(hf_cache: Path):
    start = time.monotonic()
    with pytest.raises(UserError, match="HF_HUB_OFFLINE") as err:
        resolve_source("https://huggingface.co/org/absent")
    assert time.monotonic() - start < 3
    assert "org/absent" in str(err.value) and "directory" in str(err.value)


def test_download_failure_is_a_user_error(hf_cache: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    def unreachable(*args, **kwargs):
        raise ConnectionError("network is unreachable")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)
    with pytest.raises(UserError, match="could not download org/absent@main .*unreachable"):
        resolve_source("org/absent")
