"""Checkpoint loading paths: safetensors (elsewhere), .bin through weights_only, dummy weights."""

import shutil

import pytest
import torch
from model_dirs import make_model_dir, prefill_logits
from safetensors.torch import load_file

from runtime.engine.loader import iterate_weights
from runtime.errors import UserError


def test_bin_checkpoint_loads_like_safetensors(tmp_path, tiny_llama_dir):
    ckpt = tmp_path / "bin_ckpt"
    shutil.copytree(tiny_llama_dir, ckpt)
    torch.save(load_file(ckpt / "model.safetensors"), ckpt / "pytorch_model.bin")
    (ckpt / "model.safetensors").unlink()
    ids = [[5, 6, 7, 8], [9, 10]]
    expected = prefill_logits(make_model_dir(tmp_path / "a", tiny_llama_dir), ids)
    got = prefill_logits(make_model_dir(tmp_path / "b", ckpt), ids)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


class _Payload:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_bin_with_arbitrary_pickle_is_refused(tmp_path):
    torch.save({"w": _Payload()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(UserError, match="safetensors"):
        list(iterate_weights(tmp_path))


def test_dummy_weights_run_without_a_checkpoint_file(tmp_path, tiny_llama_dir):
    ckpt = tmp_path / "no_weights"
    shutil.copytree(tiny_llama_dir, ckpt, ignore=shutil.ignore_patterns("*.safetensors"))
    import yaml

    model_dir = make_model_dir(tmp_path, ckpt)
    yaml_path = model_dir / "config" / "contract_llama.yaml"
    doc = yaml.safe_load(yaml_path.read_text())
    doc["model_config"]["with_ckpt"] = False
    yaml_path.write_text(yaml.safe_dump(doc))
    first = prefill_logits(model_dir, [[1, 2, 3]])
    assert torch.isfinite(first).all()
    torch.testing.assert_close(prefill_logits(model_dir, [[1, 2, 3]]), first)  # same seed on every run
