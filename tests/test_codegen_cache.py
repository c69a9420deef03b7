"""skills/codegen_cache.py: a stored result is returned only for the same inputs and code, and the rules' results
survive the trip through JSON unchanged."""

import json
from dataclasses import asdict

import pytest
import snapshots
import transformers
from transformers import LlamaConfig

from skills import codegen_cache
from skills.codegen_cache import cached, config_key
from skills.migrator import pipeline
from skills.migrator.context import Finding
from skills.parallel_impl.rewrite import ParallelCode, _parallel_code


def counting(value):
    calls = []

    def compute():
        calls.append(1)
        return dict(value)

    return compute, calls


def test_stored_results_are_returned_only_for_the_same_kind_and_inputs(tmp_path, monkeypatch):
    monkeypatch.setenv(codegen_cache.ENV, str(tmp_path))
    compute, calls = counting({"a": 1})
    for kind, inputs in [
        ("migrate", [1, "x"]),
        ("migrate", [1, "x"]),
        ("migrate", [2, "x"]),
        ("other", [1, "x"]),
    ]:
        assert cached(kind, inputs, compute, dict, dict) == {"a": 1}
    assert len(calls) == 3


def test_a_change_to_the_code_is_a_miss(tmp_path, monkeypatch):
    monkeypatch.setenv(codegen_cache.ENV, str(tmp_path))
    compute, calls = counting({"a": 1})
    cached("migrate", [], compute, dict, dict)
    monkeypatch.setattr(codegen_cache, "_code_fingerprint", lambda: "edited rules")
    cached("migrate", [], compute, dict, dict)
    assert len(calls) == 2


def test_off_without_the_variable_and_with_it_empty(tmp_path, monkeypatch):
    compute, calls = counting({"a": 1})
    for value in (None, ""):
        if value is None:
            monkeypatch.delenv(codegen_cache.ENV, raising=False)
        else:
            monkeypatch.setenv(codegen_cache.ENV, value)
        cached("migrate", [], compute, dict, dict)
        cached("migrate", [], compute, dict, dict)
    assert len(calls) == 4 and not list(tmp_path.iterdir())


def test_an_unreadable_entry_is_computed_again_and_an_unwritable_cache_still_answers(tmp_path, monkeypatch):
    monkeypatch.setenv(codegen_cache.ENV, str(tmp_path))
    compute, calls = counting({"a": 1})
    cached("migrate", [], compute, dict, dict)
    (entry,) = (tmp_path / "migrate").iterdir()
    entry.write_text("{truncated")
    assert cached("migrate", [], compute, dict, dict) == {"a": 1} and len(calls) == 2
    assert json.loads(entry.read_text()) == {"a": 1}  # and stored again
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(codegen_cache.ENV, str(blocker))  # a file, not a directory
    assert cached("migrate", [], compute, dict, dict) == {"a": 1} and len(calls) == 3


def test_config_key_ignores_only_the_path_the_config_was_loaded_from(tmp_path):
    a, b = LlamaConfig(hidden_size=64), LlamaConfig(hidden_size=64)
    a.save_pretrained(tmp_path / "a")
    b._name_or_path = str(tmp_path / "b")
    assert config_key(a) == config_key(b) and config_key(None) is None
    assert config_key(LlamaConfig(hidden_size=32)) != config_key(a)


def test_parallel_code_survives_the_round_trip():
    code = ParallelCode(
        {"modeling_x.py": "code"},
        ["q_proj -> QKVParallelLinear"],
        {"qkv_proj": ("q_proj", "k_proj", "v_proj")},
        {"models/modeling_x.py": ["PR001"]},
        [Finding("modeling_x.py", "X", 3, "a construct", "PR002")],
        ["XAttention"],
        2,
    )
    assert _parallel_code(json.loads(json.dumps(asdict(code)))) == code


def test_convert_code_reads_the_stored_conversion_without_running_the_rules(tmp_path, monkeypatch):
    monkeypatch.setenv(codegen_cache.ENV, str(tmp_path))
    config = transformers.AutoConfig.for_model("llama")

    def convert(rules, **overrides):
        monkeypatch.setattr(pipeline, "rewrite", rules)
        monkeypatch.setattr(pipeline, "rewrite_configuration", rules)
        return pipeline.convert_code(
            snapshots.source("llama"), "llama", "paged", checkpoint_config=config, **overrides
        )

    def no_rules(*_args, **_kwargs):
        raise AssertionError("the rules ran")

    first = convert(lambda source, ctx, disabled: f"# {len(source)} characters\n")
    assert convert(no_rules) == first and set(first.files) == {
        "models/modeling_llama.py",
        "models/configuration_llama.py",
    }
    with pytest.raises(AssertionError, match="the rules ran"):
        convert(no_rules, disabled=["MG001"])  # other options: converted again
    monkeypatch.setenv(codegen_cache.ENV, "")
    with pytest.raises(AssertionError, match="the rules ran"):
        convert(no_rules)
