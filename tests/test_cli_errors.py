"""Bad input exits non-zero with a one-paragraph message and no traceback."""

import json
import shutil
import socket
import subprocess

import pytest
import yaml
from model_dirs import make_model_dir
from skill_process import fresh, skill

from runtime.launch import free_port


def assert_clean_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    message = proc.stderr[proc.stderr.index("error:") :]
    assert "\n\n" not in message.strip(), message  # one paragraph
    for needle in needles:
        assert needle in message, message


@pytest.fixture
def model_dir(tmp_path, tiny_llama_dir):
    return make_model_dir(tmp_path, tiny_llama_dir)


def _yaml(model_dir):
    return model_dir / "config" / "contract_llama.yaml"


def test_malformed_yaml(model_dir):
    _yaml(model_dir).write_text("model_config:\n  dtype: [float32\n")
    assert_clean_error(fresh("run", str(model_dir)), "malformed YAML", "line")


def test_unknown_key(model_dir):
    doc = yaml.safe_load(_yaml(model_dir).read_text())
    doc["scheduler_config"]["max_new_token"] = 4
    _yaml(model_dir).write_text(yaml.safe_dump(doc))
    proc = fresh("run", str(model_dir))
    assert_clean_error(proc, "scheduler_config.max_new_token", "max_new_tokens")
    assert proc.returncode == 2


def test_missing_checkpoint_dir(model_dir, tmp_path):
    doc = yaml.safe_load(_yaml(model_dir).read_text())
    doc["model_config"]["model_path"] = str(tmp_path / "nowhere")
    _yaml(model_dir).write_text(yaml.safe_dump(doc))
    assert_clean_error(fresh("run", str(model_dir)), "nowhere", "model_path")


def test_corrupt_safetensors(model_dir, tiny_llama_dir, tmp_path):
    broken = tmp_path / "broken_ckpt"
    shutil.copytree(tiny_llama_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x00\x01 not a safetensors file")
    doc = yaml.safe_load(_yaml(model_dir).read_text())
    doc["model_config"]["model_path"] = str(broken)
    _yaml(model_dir).write_text(yaml.safe_dump(doc))
    assert_clean_error(fresh("run", str(model_dir)), "model.safetensors", "safetensors")


def test_missing_model_dir(tmp_path):
    assert_clean_error(fresh("run", str(tmp_path / "no_such_model")), "no_such_model")


def test_a_config_json_the_config_class_rejects(model_dir, tiny_llama_dir, tmp_path):
    broken = tmp_path / "bad_config"
    shutil.copytree(tiny_llama_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    config["hidden_size"] = "wide"
    (broken / "config.json").write_text(json.dumps(config))
    doc = yaml.safe_load(_yaml(model_dir).read_text())
    doc["model_config"]["model_path"] = str(broken)
    _yaml(model_dir).write_text(yaml.safe_dump(doc))
    assert_clean_error(fresh("run", str(model_dir)), "could not read", "config.json", "hidden_size")


def test_a_port_in_use_is_named_before_any_worker_starts(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = skill("serve", str(model_dir), "--port", str(port), timeout=120)
    assert_clean_error(proc, f"cannot listen on 127.0.0.1:{port}", "pick another port")
    assert "engine worker" not in proc.stderr


def test_a_prefill_servers_bootstrap_port_must_differ_from_its_port(model_dir):
    port = str(free_port())
    proc = skill("serve", str(model_dir), "--port", port, "--pd-role", "prefill", "--bootstrap-port", port)
    assert_clean_error(proc, f"--bootstrap-port {port} is the server's own --port")
