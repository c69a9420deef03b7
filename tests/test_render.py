"""Artifact rendering: the YAML loads in the runtime, scripts parse, output is deterministic, and the
standalone runner reproduces transformers' greedy tokens."""

import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from model_dirs import make_model_dir
from tiny_checkpoint import PARITY_PROMPTS
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from runtime.config import InferenceConfig
from runtime.errors import ConfigError, UserError
from runtime.layers.attention import Attention
from skills.migrator.attention_layout import attention_layouts
from skills.migrator.expert_layout import expert_layouts
from skills.migrator.render import PARALLEL_KEYS, RenderContext, render_artifacts

SKILL = str(Path(sys.executable).parent / "skill")  # not shutil.which: procps ships a `skill` too
NEW_TOKENS = 16


def make_ctx(**overrides) -> RenderContext:
    base = RenderContext(
        name="tiny_llama",
        class_name="TinyLlama",
        mode="framework",
        model_source="hf-internal/tiny-llama",
        model_path="/ckpt/tiny_llama",
        dtype="bfloat16",
        skill_executable=SKILL,
        batch_size=4,
        max_new_tokens=16,
        input_truncated_len=64,
        custom_params={"kv_layout": "legacy", "use_fast_rope": False},
    )
    return replace(base, **overrides)


def load_yaml(tmp_path: Path, files: dict[str, str], name: str = "tiny_llama") -> InferenceConfig:
    path = tmp_path / f"{name}.yaml"
    path.write_text(files[f"config/{name}.yaml"])
    return InferenceConfig.from_yaml(path)


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_yaml_loads_in_the_runtime(tmp_path, mode):
    files = render_artifacts(make_ctx(mode=mode))
    expected = {"config/tiny_llama.yaml", "infer.sh", "README.md", "requirements.txt"}
    if mode == "standalone":
        expected |= {"runner_tiny_llama.py", "infer.py"}
    assert set(files) == expected
    cfg = load_yaml(tmp_path, files)
    assert (cfg.model_name, cfg.world_size) == ("tiny_llama", 1)
    mc = cfg.model_config
    assert (mc.model_path, mc.dtype, mc.exe_mode, mc.with_ckpt) == (
        "/ckpt/tiny_llama",
        "bfloat16",
        "eager",
        True,
    )
    assert mc.custom_params == {"kv_layout": "legacy", "use_fast_rope": False}
    assert (cfg.data_config.dataset, cfg.data_config.input_truncated_len, cfg.data_config.prompts) == (
        "default",
        64,
        None,
    )
    sc = cfg.scheduler_config
    assert (sc.batch_size, sc.max_new_tokens, sc.block_size, sc.ignore_eos) == (4, 16, 128, False)


def test_world_size_2_is_written_twice_with_parallel_sizes(tmp_path):
    cfg = load_yaml(tmp_path, render_artifacts(make_ctx(world_size=2)))
    assert cfg.world_size == cfg.parallel_config.world_size == 2
    assert all(getattr(cfg.parallel_config, k) == 2 for k in PARALLEL_KEYS)
    cfg = load_yaml(tmp_path, render_artifacts(make_ctx(world_size=2, parallel={"attn_tp_size": 1})))
    assert (cfg.parallel_config.attn_tp_size, cfg.parallel_config.attn_dp_size) == (1, 2)


def test_inconsistent_sizes_are_rejected_at_render_time():
    with pytest.raises(ConfigError, match="batch_size"):
        render_artifacts(make_ctx(world_size=2, batch_size=1, parallel={"attn_tp_size": 1}))
    with pytest.raises(ValueError, match="unknown parallel sizes"):
        render_artifacts(make_ctx(parallel={"attn_dp_size": 1}))


def test_booleans_are_capitalised_and_prompts_inline(tmp_path):
    files = render_artifacts(make_ctx(prompts=['Say "hi": yes', "two"]))
    text = files["config/tiny_llama.yaml"]
    assert not re.search(r":\s*(true|false)\b", text)
    for key in (
        "with_ckpt: True",
        'quant_method: "none"',
        "enable_profiler: False",
        "ignore_eos: False",
        "use_fast_rope: False",
    ):
        assert key in text
    assert load_yaml(tmp_path, files).data_config.prompts == ['Say "hi": yes', "two"]


@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_scripts_parse(tmp_path, mode):
    files = render_artifacts(make_ctx(mode=mode))
    (tmp_path / "infer.sh").write_text(files["infer.sh"])
    subprocess.run(["bash", "-n", str(tmp_path / "infer.sh")], check=True)
    for rel in ("runner_tiny_llama.py", "infer.py") if mode == "standalone" else ():
        compile(files[rel], rel, "exec")
    if mode == "standalone":
        assert "class TinyLlamaRunner:" in files["runner_tiny_llama.py"]  # no base class: the mode's signal


def test_rendering_is_deterministic():
    for mode in ("framework", "standalone"):
        ctx = make_ctx(
            mode=mode, baseline={"prefill_ms": 1.0, "decode_avg_ms": 2.0, "output_text": "x", "device": "cpu"}
        )
        assert render_artifacts(ctx) == render_artifacts(make_ctx(**vars(ctx)))


def test_readme_baseline_unverified_and_multi_card_note():
    baseline = {
        "prefill_ms": 12.345,
        "decode_avg_ms": 3.5,
        "output_text": "Paris | France\nyes",
        "device": "cpu",
    }
    readme = render_artifacts(make_ctx(baseline=baseline))["README.md"]
    assert "| cpu | 12.35 | 3.50 | Paris \\| France<br>yes |" in readme
    assert (
        "## Verified\n\nNot verified yet: `skill verify .`" in readme
    )  # until skill verify records a result
    assert "multi-card" not in readme
    readme = render_artifacts(make_ctx(world_size=2, needs_multi_card=True))["README.md"]
    assert "Needs multi-card" in readme and "Not collected" in readme


def test_requirements_follow_the_project_pins():
    reqs = render_artifacts(make_ctx())["requirements.txt"].splitlines()
    pins = [line for line in reqs if line and not line.startswith("#")]
    assert [re.split(r"[<>=]", p)[0] for p in pins] == ["torch", "transformers", "safetensors", "pyyaml"]
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert all(f'"{p}"' in pyproject for p in pins)


def infer_sh(model_dir: Path, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(model_dir / "infer.sh"), *args], check=False, capture_output=True, text=True, **kwargs
    )


def _stub(path: Path, body: str) -> None:
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.mark.parametrize(("mode", "world_size"), [("framework", 1), ("framework", 2), ("standalone", 2)])
def test_infer_sh_launches_logs_and_propagates_the_exit_code(tmp_path, mode, world_size):
    """A stub `skill` (and torchrun) next to a real python: the launcher's command line, log and exit code."""
    bin_dir, model_dir, elsewhere = tmp_path / "bin", tmp_path / "model", tmp_path / "elsewhere"
    for d in (bin_dir, elsewhere):
        d.mkdir()
    _stub(bin_dir / "skill", '# skills.cli stand-in\necho "skill $*"; echo "stub stderr" >&2; exit 3')
    _stub(bin_dir / "torchrun", 'echo "torchrun $*"; echo "stub stderr" >&2; exit 4')
    _stub(bin_dir / "python", f'exec {sys.executable} "$@"')
    write(
        model_dir,
        render_artifacts(make_ctx(mode=mode, world_size=world_size, skill_executable=str(bin_dir / "skill"))),
    )
    env = {k: v for k, v in os.environ.items() if k not in ("SKILL", "YAML", "RES_PATH")}
    env["PATH"] = "/usr/bin:/bin"  # no model-infer-skills `skill` (maybe procps' one): the rendered fallback
    proc = infer_sh(model_dir, "--raw", cwd=elsewhere, env=env)
    yaml_path = model_dir / "config" / "tiny_llama.yaml"
    run = f"run {model_dir} --yaml {yaml_path} --raw"
    expected = {
        ("framework", 1): (3, f"skill {run}\n"),
        ("framework", 2): (4, f"torchrun --nproc-per-node 2 {bin_dir / 'skill'} {run}\n"),
        ("standalone", 2): (
            4,
            f"torchrun --nproc-per-node 2 {model_dir / 'infer.py'} --yaml_file_path "
            + f"{yaml_path} --raw\n",
        ),
    }
    assert (proc.returncode, proc.stdout) == expected[mode, world_size], proc.stderr
    assert proc.stderr == "stub stderr\n"
    assert sorted((model_dir / "logs" / "log_0.log").read_text().splitlines()) == sorted(
        [proc.stdout.strip(), "stub stderr"]
    )
    other = tmp_path / "other.yaml"
    shutil.copy(yaml_path, other)
    proc = infer_sh(model_dir, env={**env, "YAML": str(other)})
    assert str(other) in proc.stdout
    proc = infer_sh(model_dir, "--yaml", str(tmp_path / "missing.yaml"), env=env)
    assert proc.returncode == 2 and "no YAML" in proc.stderr


@pytest.fixture(scope="module")
def hf_greedy(tiny_llama_dir) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    with torch.no_grad():
        return [
            model.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id
            )[0, len(ids) :].tolist()
            for ids in (tok(p)["input_ids"] for p in PARITY_PROMPTS)
        ]


@pytest.mark.parametrize("mode", ["standalone", "framework"])
def test_infer_sh_matches_transformers_generate(tmp_path, tiny_llama_dir, hf_greedy, mode):
    """infer.sh -> infer.py + runner (standalone) or `skill run` (framework) over a legacy-KV contract model;
    batch 2 packs prompts of unequal length and leaves a second batch for the standalone runner."""
    model_dir = make_model_dir(tmp_path, tiny_llama_dir, kv_layout="legacy")
    ctx = make_ctx(
        name="contract_llama",
        class_name="ContractLlama",
        mode=mode,
        model_path=str(tiny_llama_dir),
        dtype="float32",
        kv_layout="legacy",
        batch_size=2,
        max_new_tokens=NEW_TOKENS,
        custom_params={"kv_layout": "legacy"},
        prompts=PARITY_PROMPTS,
    )
    write(model_dir, render_artifacts(ctx))
    # One thread: two OpenMP threads on a shared 2-core machine can slow each step a hundredfold.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = infer_sh(model_dir, "--raw", "--json", env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)  # stdout holds only what the run printed there; the logs are on stderr
    assert [o["token_ids"] for o in out["outputs"]] == hf_greedy
    assert out["prefill_ms"] > 0 and out["decode_avg_ms"] > 0
    log = (model_dir / "logs" / "log_0.log").read_text()
    assert proc.stdout in log and "Request 3: outputs: " in proc.stderr and "Request 3: outputs: " in log
    if mode == "standalone":
        assert "contract_llama inference time cost of prefill is" in log
        assert "contract_llama inference time cost of decode is" in log


def test_standalone_runner_refuses_remote_code_without_trust(tmp_path, tiny_llama_dir):
    model_dir = make_model_dir(tmp_path, tiny_llama_dir)
    files = render_artifacts(
        make_ctx(
            name="contract_llama",
            class_name="ContractLlama",
            mode="standalone",
            model_path=str(tiny_llama_dir),
            custom_params={"remote_code": True},
        )
    )
    write(model_dir, files)
    spec = importlib.util.spec_from_file_location("runner_remote", model_dir / "runner_contract_llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(UserError, match="trust_remote_code: True"):
        module.ContractLlamaRunner(str(model_dir / "config" / "contract_llama.yaml"))


def test_infer_sh_online_mode_and_node_lists(tmp_path):
    """--mode online runs `skill serve`; IPS / PREFILL_IPS (the seed's set_env.sh) become torchrun's node flags."""
    bin_dir, model_dir = tmp_path / "bin", tmp_path / "model"
    bin_dir.mkdir()
    _stub(bin_dir / "skill", '# skills.cli stand-in\necho "skill $*"')
    _stub(bin_dir / "torchrun", 'echo "torchrun $*"')
    _stub(bin_dir / "python", f'exec {sys.executable} "$@"')
    write(
        model_dir,
        render_artifacts(make_ctx(mode="framework", world_size=2, skill_executable=str(bin_dir / "skill"))),
    )
    env = {k: v for k, v in os.environ.items() if k not in ("SKILL", "YAML", "RES_PATH", "IPS", "NODE_RANK")}
    env["PATH"] = "/usr/bin:/bin"
    skill, yaml_path = bin_dir / "skill", model_dir / "config" / "tiny_llama.yaml"
    out = infer_sh(model_dir, "--mode", "online", "--pd-role", "prefill", "--port", "9000", env=env)
    assert out.stdout == f"skill serve {model_dir} --yaml {yaml_path} --pd-role prefill --port 9000\n", (
        out.stderr
    )
    nodes = {**env, "IPS": "10.0.0.1 10.0.0.2", "NODE_RANK": "1"}
    out = infer_sh(model_dir, "--raw", env=nodes)
    assert out.stdout == (
        f"torchrun --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 "
        f"--nproc-per-node 1 {skill} run {model_dir} --yaml {yaml_path} --raw\n"
    ), out.stderr
    out = infer_sh(
        model_dir,
        "--mode=online",
        "--pd-role",
        "decode",
        env={**nodes, "DECODE_IPS": "10.0.1.1 10.0.1.2", "MASTER_PORT": "4000"},
    )
    assert out.stdout == (
        f"skill serve {model_dir} --yaml {yaml_path} --nnodes 2 --node-rank 1 --master-addr "
        "10.0.1.1 --master-port 4000 --pd-role decode\n"
    ), out.stderr
    out = infer_sh(model_dir, env={**env, "IPS": "10.255.0.1 10.255.0.2"})
    assert out.returncode == 2 and "set NODE_RANK" in out.stderr
    out = infer_sh(model_dir, "--mode", "serve", env=env)
    assert out.returncode == 2 and "offline or online" in out.stderr
    write(model_dir, render_artifacts(make_ctx(mode="standalone", skill_executable=str(skill))))
    out = infer_sh(model_dir, "--mode", "online", env=env)
    assert out.returncode == 2 and "framework mode" in out.stderr


class _SinkAttention(nn.Module):
    def __init__(self, window):
        super().__init__()
        self.sinks = nn.Parameter(torch.zeros(4))
        self.attn = Attention(4, 8, 0.3, 2, sliding_window=window, v_head_dim=4)

    def forward(self, q, k, v, md):
        return self.attn(q, k, v, md, sinks=self.sinks)


class _PlainAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention(4, 8, 0.3, 4, soft_cap=50.0)

    def forward(self, q, k, v, md):
        return self.attn(q, k, v, md)


class _LatentAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention(4, 24, 0.3, 4, v_head_dim=16, latent_dim=40)


def test_readme_lists_the_attention_layers_read_off_the_model():
    model = nn.ModuleList([_SinkAttention(16), _PlainAttention(), _SinkAttention(16), _LatentAttention()])
    layouts = attention_layouts(model)
    assert [(a["layers"], a["first"], a["sinks"], a["cache_values_per_token"]) for a in layouts] == [
        (2, "0.attn", "yes", 2 * (8 + 4)),
        (1, "1.attn", "no", 4 * (8 + 8)),
        (1, "3.attn", "no", 40),
    ]
    readme = render_artifacts(make_ctx(attention=layouts))["README.md"]
    assert (
        "| 2 | `0.attn` | 4 / 2 | 8 / 4 | 16 | - | yes | keys and values | 24 |\n"
        "| 1 | `1.attn` | 4 / 4 | 8 / 8 | - | 50.00 | no | keys and values | 64 |\n"
        "| 1 | `3.attn` | 4 / 4 | 24 / 16 | - | - | no | latent (160 expanded) | 40 |\n" in readme
    )
    assert "## Attention" not in render_artifacts(make_ctx())["README.md"]


class _SigmoidRouter(nn.Module):
    """DeepSeek-V3's router: sigmoid scores, a correction bias, group-limited top-k, scaled weights."""

    def __init__(self):
        super().__init__()
        self.top_k, self.num_group, self.topk_group, self.routed_scaling_factor = 2, 2, 1, 2.5
        self.norm_topk_prob = True
        self.weight = nn.Parameter(torch.zeros(4, 8))
        self.e_score_correction_bias = nn.Buffer(torch.zeros(4))

    def forward(self, x):
        return (x @ self.weight.T).sigmoid() + self.e_score_correction_bias


class _SoftmaxRouter(nn.Module):
    """Mixtral's router: softmax, top-k, weights always renormalised."""

    def __init__(self):
        super().__init__()
        self.top_k = 2
        self.weight = nn.Parameter(torch.zeros(4, 8))

    def forward(self, x):
        top, index = torch.softmax(x @ self.weight.T, dim=-1).topk(self.top_k)
        top /= top.sum(dim=-1, keepdim=True)
        return top, index


class _MoeBlock(nn.Module):
    def __init__(self, router: nn.Module, shared: bool):
        super().__init__()
        self.gate = router
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.zeros(4, 6, 8))
        self.experts.down_proj = nn.Parameter(torch.zeros(4, 8, 3))
        if shared:
            self.shared_experts = nn.Linear(8, 8)


def test_readme_lists_the_experts_and_routers_read_off_the_model():
    model = nn.ModuleList([_MoeBlock(_SigmoidRouter(), True), _MoeBlock(_SoftmaxRouter(), False)])
    layouts = expert_layouts(model)
    assert [(e["layers"], e["first"], e["router"], e["shared"]) for e in layouts] == [
        (1, "0.experts", "`gate` (_SigmoidRouter)", "`shared_experts`"),
        (1, "1.experts", "`gate` (_SoftmaxRouter)", "-"),
    ]
    assert layouts[0]["scoring"] == (
        "sigmoid scores, top-2, with bias (e_score_correction_bias), group-limited (2 groups, best 1), "
        "top-k weights renormalised, scaled by 2.5"
    )
    assert layouts[1]["scoring"] == "softmax scores, top-2, top-k weights renormalised"
    readme = render_artifacts(make_ctx(experts=layouts))["README.md"]
    assert (
        "| 1 | `1.experts` | 4 | `gate_up_proj` [4, 6, 8], `down_proj` [4, 8, 3] | `gate` (_SoftmaxRouter) |"
        in readme
    )
    assert "## Experts" not in render_artifacts(make_ctx())["README.md"]
