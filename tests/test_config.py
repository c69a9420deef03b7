import textwrap

import pytest
import torch

from runtime.config import InferenceConfig, ParallelConfig
from runtime.config.inference_config import npu_importable
from runtime.errors import ConfigError

SEED_YAML = """\
model_name: "qwen3"
world_size: 2
model_config:
  model_name: "qwen3"
  model_path: "/path/to/weights"
  exe_mode: "eager"
  with_ckpt: True
  enable_weight_nz: True
  enable_profiler: False
  dtype: "float32"
  custom_params:
    enable_multi_streams: False
data_config:
  dataset: "default"
  input_truncated_len: 512
parallel_config:
  world_size: 2
  attn_tp_size: 2
  dense_tp_size: 2
  embed_tp_size: 2
  lmhead_tp_size: 2
scheduler_config:
  batch_size: 4
  max_new_tokens: 32
  block_size: 128
"""


def write(tmp_path, text: str):
    path = tmp_path / "infer.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def rejects(d: dict, *fragments: str) -> str:
    with pytest.raises(ConfigError) as e:
        InferenceConfig.from_dict(d, source="cfg.yaml")
    msg = str(e.value)
    assert msg.startswith("cfg.yaml: ") and "\n" not in msg
    for f in fragments:
        assert f in msg, (f, msg)
    return msg


def test_defaults():
    cfg = InferenceConfig.from_dict({})
    assert cfg == InferenceConfig()
    assert cfg.model_name == "model" and cfg.world_size == 1
    assert cfg.model_config.dtype == "bfloat16" and cfg.model_config.exe_mode == "eager"
    assert cfg.scheduler_config.batch_size == 1 and cfg.scheduler_config.num_kv_blocks is None
    assert cfg.parallel_config.attn_dp_size == 1 and cfg.parallel_config.global_rank == 0
    assert cfg.disagg_config.disaggregation_mode == "NONE"
    assert cfg.max_seq_len == 256 + 32 and cfg.batch_size_per_dp_rank == 1


def test_seed_yaml_loads(tmp_path):
    cfg = InferenceConfig.from_yaml(write(tmp_path, SEED_YAML))
    assert cfg.model_name == "qwen3" and cfg.world_size == 2
    assert cfg.model_config.model_path == "/path/to/weights"
    assert cfg.model_config.custom_params == {"enable_multi_streams": False}
    assert cfg.model_config.torch_dtype == torch.float32
    assert cfg.parallel_config.attn_tp_size == 2 and cfg.parallel_config.attn_dp_size == 1
    assert cfg.parallel_config.moe_ep_size == 2
    assert cfg.max_seq_len == 544 and cfg.batch_size_per_dp_rank == 4
    assert cfg.source == str(tmp_path / "infer.yaml")


def test_keys_without_effect_warn_once_naming_key_and_reason(tmp_path, caplog, monkeypatch):
    from runtime.config import ineffective

    monkeypatch.setattr(ineffective, "_warned", set())
    path = write(tmp_path, SEED_YAML.replace("  dtype:", "  next_n: 1\n  dtype:"))
    with caplog.at_level("WARNING", logger=ineffective.__name__):
        for _ in range(2):
            InferenceConfig.from_yaml(path)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings  # once per key, not per load
    assert warnings[0].startswith(
        f"{path}: `model_config.enable_weight_nz: True` has no effect: the NZ weight "
    )
    assert "Ascend" in warnings[0] and "`model_config.next_n: 1` has no effect: multi-token" in warnings[1]
    caplog.clear()
    off = SEED_YAML.replace("enable_weight_nz: True", "enable_weight_nz: False")
    InferenceConfig.from_yaml(write(tmp_path, off))  # asks for nothing: silent
    assert ineffective.warn_ineffective({"model_config": {"enable_weight_nz": False}}, "x") == []
    assert caplog.records == []


def test_empty_section_is_defaults():
    assert InferenceConfig.from_dict({"data_config": None}) == InferenceConfig()


def test_derived_sizes():
    cfg = InferenceConfig.from_dict(
        {
            "parallel_config": {"world_size": 4, "attn_tp_size": 2, "moe_tp_size": 4},
            "scheduler_config": {"batch_size": 8},
        }
    )
    pc = cfg.parallel_config
    assert (pc.attn_dp_size, pc.moe_ep_size, pc.embed_dp_size, pc.lmhead_dp_size, pc.dense_dp_size) == (
        2,
        1,
        4,
        4,
        4,
    )
    assert cfg.batch_size_per_dp_rank == 4


def test_consistent_derived_key_accepted():
    cfg = InferenceConfig.from_dict(
        {
            "parallel_config": {"world_size": 4, "attn_tp_size": 2, "attn_dp_size": 2},
            "scheduler_config": {"batch_size": 2},
        }
    )
    assert cfg.parallel_config.attn_dp_size == 2
    assert "attn_dp_size" not in cfg.to_dict()["parallel_config"]


def test_with_rank():
    cfg = InferenceConfig.from_dict(
        {"parallel_config": {"world_size": 2}, "scheduler_config": {"batch_size": 2}}
    )
    ranked = cfg.with_rank(1, 1)
    assert (ranked.parallel_config.global_rank, ranked.parallel_config.local_rank) == (1, 1)
    assert cfg.parallel_config.global_rank == 0
    assert "global_rank" not in ranked.to_dict()["parallel_config"]


def test_round_trip(tmp_path):
    cfg = InferenceConfig.from_yaml(write(tmp_path, SEED_YAML))
    again = InferenceConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.to_dict() == cfg.to_dict()


@pytest.mark.parametrize(
    "dtype,expected", [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)]
)
def test_torch_dtype(dtype, expected):
    assert InferenceConfig.from_dict({"model_config": {"dtype": dtype}}).model_config.torch_dtype == expected


def test_unknown_top_level_key():
    rejects(
        {"modle_config": {}}, "unknown key `modle_config`", "did you mean `model_config`", "scheduler_config"
    )


def test_unknown_section_key():
    msg = rejects(
        {"data_config": {"promtps": ["hi"]}}, "unknown key `data_config.promtps`", "did you mean `prompts`"
    )
    assert "input_truncated_len" in msg


def test_unknown_parallel_key_lists_derived_keys():
    rejects(
        {"parallel_config": {"atn_tp_size": 2}},
        "`parallel_config.atn_tp_size`",
        "`attn_tp_size`",
        "attn_dp_size",
    )


@pytest.mark.parametrize(
    "section,key,value",
    [
        ("scheduler_config", "batch_size", "2"),
        ("scheduler_config", "batch_size", 2.5),
        ("scheduler_config", "batch_size", True),
        ("model_config", "with_ckpt", "True"),
        ("model_config", "with_ckpt", 1),
        ("scheduler_config", "mem_fraction_static", "0.5"),
    ],
)
def test_wrong_scalar_type(section, key, value):
    rejects({section: {key: value}}, f"`{section}.{key}`", repr(value))


def test_wrong_type_in_list():
    rejects({"data_config": {"prompts": ["ok", 3]}}, "`data_config.prompts[1]`", "string")


@pytest.mark.parametrize(
    "section,key,value,hint",
    [
        ("scheduler_config", "batch_size", 0, "greater than or equal to 1"),
        ("scheduler_config", "mem_fraction_static", 1.5, "less than or equal to 1"),
        ("scheduler_config", "num_kv_blocks", 1, "greater than or equal to 2"),
        ("data_config", "input_truncated_len", 0, "greater than 0"),
    ],
)
def test_out_of_range(section, key, value, hint):
    rejects({section: {key: value}}, f"`{section}.{key}`", hint)


def test_tp_size_must_divide_world_size():
    rejects(
        {"parallel_config": {"world_size": 4, "moe_tp_size": 3}},
        "`parallel_config.moe_tp_size`",
        "is 3",
        "1, 2, 4",
    )


def test_top_level_world_size_mismatch():
    rejects(
        {"world_size": 2, "parallel_config": {"world_size": 4}, "scheduler_config": {"batch_size": 4}},
        "`world_size` is 2",
        "`parallel_config.world_size` is 4",
        "make them equal",
    )


def test_batch_size_not_divisible_by_attn_dp():
    rejects(
        {"parallel_config": {"world_size": 8, "attn_tp_size": 2}, "scheduler_config": {"batch_size": 6}},
        "`scheduler_config.batch_size` is 6",
        "attn_dp_size 4",
        "4 or 8",
    )


def test_invalid_dtype():
    rejects({"model_config": {"dtype": "fp8"}}, "`model_config.dtype`", "'fp8'", "'bfloat16'")


@pytest.mark.skipif(npu_importable(), reason="torch_npu is installed: the graph modes are accepted")
@pytest.mark.parametrize("mode", ["ge_graph", "npugraph_ex"])
def test_npu_graph_modes_need_torch_npu_and_point_to_compile(mode):
    rejects({"model_config": {"exe_mode": mode}}, "`model_config.exe_mode`", "needs torch_npu", '"compile"')


def test_unknown_exe_mode_lists_the_modes():
    rejects({"model_config": {"exe_mode": "graph"}}, "`model_config.exe_mode`", "'graph'", '"compile"')


def test_compile_mode_is_accepted():
    assert (
        InferenceConfig.from_dict({"model_config": {"exe_mode": "compile"}}).model_config.exe_mode
        == "compile"
    )


def test_inconsistent_derived_key():
    rejects(
        {
            "parallel_config": {"world_size": 4, "attn_tp_size": 2, "attn_dp_size": 4},
            "scheduler_config": {"batch_size": 4},
        },
        "`parallel_config.attn_dp_size` is 4",
        "attn_tp_size 2 = 2",
        "set it to 2",
    )


def test_top_level_not_mapping(tmp_path):
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        InferenceConfig.from_yaml(write(tmp_path, "- a\n- b\n"))


def test_malformed_yaml_names_line(tmp_path):
    path = write(
        tmp_path,
        """\
        model_config:
          dtype: "float32"
        scheduler_config:
          batch_size: [1, 2
        """,
    )
    with pytest.raises(ConfigError) as e:
        InferenceConfig.from_yaml(path)
    assert str(path) in str(e.value) and "line 5" in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError) as e:
        InferenceConfig.from_yaml(tmp_path / "nope.yaml")
    assert "nope.yaml" in str(e.value) and "--yaml" in str(e.value)
    assert e.value.exit_code == 2


def test_direct_parallel_config_derived():
    assert ParallelConfig(world_size=8, moe_tp_size=2).moe_ep_size == 4
