"""Multi-rank `skill serve`: TP 2 (requests broadcast over tp_cpu_group) and attention DP 2 with TP'd dense
layers (two DP leaders in lock-step over dp_leader_group) answer exactly as the offline single-rank run does,
for concurrent clients; so does a two-node launch on one host."""

import pytest
from hf_reference import NEW_TOKENS
from serve_harness import served_texts, serving
from skill_process import Started

from runtime.launch import free_port


@pytest.mark.parametrize("layout", ["tp2", "attn_dp2"])
def test_multi_rank_serve_equals_single_rank(served_llama, layout, tmp_path):
    model_dir, yamls, offline = served_llama
    with serving(model_dir, tmp_path / "serve.log", "--yaml", str(yamls[layout])) as server:
        texts = served_texts(server.url, "default", NEW_TOKENS)
        m = server.wait_idle()
        assert server.stop() == 0
    assert texts == offline["raw"] * 2 + offline["chat"]
    assert m["skill_kv_cache_used_blocks"] == 0 and m["skill_kv_cache_total_blocks"] > 0


def test_two_node_serve_on_one_host_equals_single_rank(served_llama, tmp_path):
    """Node 0 serves HTTP with rank 0, node 1 (a second launch) runs rank 1; torchrun rendezvous over loopback."""
    model_dir, yamls, offline = served_llama
    nodes = ["--yaml", str(yamls["attn_dp2"]), "--nnodes", "2", "--master-port", str(free_port())]
    node1 = Started("serve", model_dir, *nodes, "--node-rank", "1", log=tmp_path / "node1.log")
    try:
        with serving(model_dir, tmp_path / "node0.log", *nodes, "--node-rank", "0") as server:
            assert served_texts(server.url, "default", NEW_TOKENS) == offline["raw"] * 2 + offline["chat"]
            assert server.stop() == 0
        assert node1.wait(60) == 0, (tmp_path / "node1.log").read_text()[-3000:]
    finally:
        node1.kill()
