"""Multi-rank runs: `skill run` relaunches itself once per rank (forked on one node's CPU, or under torchrun) and
attention-DP ranks split the requests over gloo; the tokens equal the single-rank run and transformers."""

import json
import os
import re
import subprocess
import sys

import pytest
import yaml
from model_dirs import make_model_dir
from skill_process import skill
from tiny_checkpoint import PARITY_PROMPTS

from runtime.launch import LAUNCHER_ENV, LAUNCHERS, free_port


def run_args(model_dir, yaml_path, *flags: str) -> list[str]:
    return [
        "run",
        str(model_dir),
        "--yaml",
        str(yaml_path),
        "--json",
        "--raw",
        "--max-new-tokens",
        "16",
        *[a for p in PARITY_PROMPTS for a in ("--prompt", p)],
        *flags,
    ]


def tokens(stdout: str) -> list[list[int]]:
    return [o["token_ids"] for o in json.loads(stdout)["outputs"]]


def run_tokens(model_dir, yaml_path) -> list[list[int]]:
    proc = skill(*run_args(model_dir, yaml_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tokens(proc.stdout)


@pytest.fixture()
def dp2(tmp_path, tiny_llama_dir):
    model_dir = make_model_dir(tmp_path, tiny_llama_dir)
    single = model_dir / "config" / "contract_llama.yaml"
    doc = yaml.safe_load(single.read_text())
    doc["world_size"] = 2
    doc["parallel_config"] = {"world_size": 2}  # attn_tp 1 -> attn_dp 2: requests split over the ranks
    dp2 = model_dir / "config" / "dp2.yaml"
    dp2.write_text(yaml.safe_dump(doc))
    return model_dir, single, dp2


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_data_parallel_world_2_matches_single_rank(dp2, launcher):
    model_dir, single, parallel = dp2
    proc = skill(*run_args(model_dir, parallel), env={**os.environ, LAUNCHER_ENV: launcher})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert tokens(proc.stdout) == run_tokens(model_dir, single)
    assert re.search(r"\[rank1\] INFO .* parameter bytes on rank 1\n", proc.stderr), proc.stderr[-3000:]
    assert ("Setting OMP_NUM_THREADS" in proc.stderr) == (launcher == "torchrun")  # torchrun's banner


def test_two_nodes_on_one_host_match_a_single_node(dp2):
    """Two launches, one per "node" (torchrun --nnodes 2 over loopback): node 0 prints the single-node answer."""
    model_dir, single, parallel = dp2
    port = str(free_port())
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "skills.cli",
                *run_args(
                    model_dir,
                    parallel,
                    "--nnodes",
                    "2",
                    "--node-rank",
                    str(rank),
                    "--master-addr",
                    "127.0.0.1",
                    "--master-port",
                    port,
                ),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert outs[1][0] == ""  # only global rank 0 prints
    assert tokens(outs[0][0]) == run_tokens(model_dir, single)
