"""Multi-rank `skill serve`: TP 2 (requests broadcast over tp_cpu_group) and attention DP 2 with TP'd dense
layers (two DP leaders in lock-step over dp_leader_group) answer exactly as the single-rank server and the
offline run do, for concurrent clients."""
import subprocess
import sys
from pathlib import Path

import pytest
from hf_reference import NEW_TOKENS
from serve_harness import migrated_with_layouts, offline_outputs, served_texts, serving
from tiny_checkpoint import PARITY_PROMPTS

from runtime.launch import free_port

# (world_size, attn_tp, dense_tp, embed_tp, lmhead_tp)
LAYOUTS = {"tp2": (2, 2, 2, 2, 2), "attn_dp2": (2, 1, 2, 2, 2)}


@pytest.fixture(scope="module")
def served_model(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    return migrated_with_layouts(tmp_path_factory, LAYOUTS)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_multi_rank_serve_equals_single_rank(served_model, layout, tmp_path):
    model_dir, yamls = served_model
    raw = [o["text"] for o in offline_outputs(model_dir, PARITY_PROMPTS, NEW_TOKENS, "--raw")]
    chat = [o["text"] for o in offline_outputs(model_dir, PARITY_PROMPTS, NEW_TOKENS)]
    with serving(model_dir, tmp_path / "serve.log", "--yaml", str(yamls[layout])) as server:
        texts = served_texts(server.url, "default", NEW_TOKENS)
        m = server.wait_idle()
        assert server.stop() == 0
    assert texts == raw * 2 + chat
    assert m["skill_kv_cache_used_blocks"] == 0 and m["skill_kv_cache_total_blocks"] > 0


def test_two_node_serve_on_one_host_equals_single_rank(served_model, tmp_path):
    """Node 0 serves HTTP with rank 0, node 1 (a second launch) runs rank 1; torchrun rendezvous over loopback."""
    model_dir, yamls = served_model
    raw = [o["text"] for o in offline_outputs(model_dir, PARITY_PROMPTS, NEW_TOKENS, "--raw")]
    chat = [o["text"] for o in offline_outputs(model_dir, PARITY_PROMPTS, NEW_TOKENS)]
    nodes = ["--yaml", str(yamls["attn_dp2"]), "--nnodes", "2", "--master-port", str(free_port())]
    with (tmp_path / "node1.log").open("w") as log:
        node1 = subprocess.Popen([sys.executable, "-m", "skills.cli", "serve", str(model_dir), *nodes,
                                  "--node-rank", "1"], stdout=log, stderr=subprocess.STDOUT)
    try:
        with serving(model_dir, tmp_path / "node0.log", *nodes, "--node-rank", "0") as server:
            assert served_texts(server.url, "default", NEW_TOKENS) == raw * 2 + chat
            assert server.stop() == 0
        assert node1.wait(60) == 0, (tmp_path / "node1.log").read_text()[-3000:]
    finally:
        node1.kill()
