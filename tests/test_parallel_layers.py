import re

import pytest
import torch
import torch.nn.functional as F
from dist_harness import distributed_tests
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from runtime.config.comm_manager import CommManager
from runtime.errors import ConfigError
from runtime.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from runtime.layers.head_shard import (
    gather_heads,
    interleaved_heads,
    local_heads,
    local_kv_heads,
    local_width,
    shard_heads,
    whole_blocks,
)


class FakeTP:
    """TP size / rank for every group, without collectives: enough for loader-only tests."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank

    def has_group(self, name: str) -> bool:
        return True

    def get_size(self, name: str) -> int:
        return self.size

    def get_rank(self, name: str) -> int:
        return self.rank

    def get_group(self, name: str) -> None:
        return None


def load(param, loaded, shard_id=None):
    param.weight_loader(param, loaded, shard_id)


def rows(t, start, n):
    return t[start : start + n]


def test_column_shards_weight_and_bias_rows():
    w, b = torch.randn(8, 3), torch.randn(8)
    for rank in range(2):
        layer = ColumnParallelLinear(3, 8, bias=True, comm_manager=FakeTP(2, rank))
        load(layer.weight, w)
        load(layer.bias, b)
        assert torch.equal(layer.weight, rows(w, 4 * rank, 4)) and torch.equal(
            layer.bias, rows(b, 4 * rank, 4)
        )


def test_row_shards_weight_columns_and_keeps_bias_whole():
    w, b = torch.randn(3, 8), torch.randn(3)
    for rank in range(4):
        layer = RowParallelLinear(8, 3, bias=True, comm_manager=FakeTP(4, rank))
        load(layer.weight, w)
        load(layer.bias, b)
        assert torch.equal(layer.weight, w[:, 2 * rank : 2 * rank + 2]) and torch.equal(layer.bias, b)


def _qkv_weights(heads: int, kv_heads: int, d: int, hidden: int = 3):
    return (
        torch.randn(heads * d, hidden),
        torch.randn(kv_heads * d, hidden),
        torch.randn(kv_heads * d, hidden),
    )


def test_qkv_shard_ids_and_fused_on_disk():
    q, k, v = _qkv_weights(4, 2, 2)
    bq, bk, bv = torch.randn(8), torch.randn(4), torch.randn(4)
    for rank in range(2):
        by_id = QKVParallelLinear(3, 2, 4, 2, bias=True, comm_manager=FakeTP(2, rank))
        fused = QKVParallelLinear(3, 2, 4, 2, bias=True, comm_manager=FakeTP(2, rank))
        for sid, w, b in zip("qkv", (q, k, v), (bq, bk, bv)):
            load(by_id.weight, w, sid)
            load(by_id.bias, b, sid)
        load(fused.weight, torch.cat([q, k, v]))
        load(fused.bias, torch.cat([bq, bk, bv]))
        assert (by_id.num_heads, by_id.num_kv_heads, by_id.q_size, by_id.kv_size) == (2, 1, 4, 2)
        expected = torch.cat([rows(q, 4 * rank, 4), rows(k, 2 * rank, 2), rows(v, 2 * rank, 2)])
        assert torch.equal(by_id.weight, expected) and torch.equal(fused.weight, expected)
        expected_bias = torch.cat([rows(bq, 4 * rank, 4), rows(bk, 2 * rank, 2), rows(bv, 2 * rank, 2)])
        assert torch.equal(by_id.bias, expected_bias) and torch.equal(fused.bias, expected_bias)


def test_qkv_replicates_kv_heads_when_tp_exceeds_them():
    q, k, v = _qkv_weights(4, 2, 2)
    for rank in range(4):
        layer = QKVParallelLinear(3, 2, 4, 2, comm_manager=FakeTP(4, rank))
        load(layer.weight, torch.cat([q, k, v]))
        kv_head = rank // 2
        assert (layer.num_heads, layer.num_kv_heads) == (1, 1)
        expected = torch.cat([rows(q, 2 * rank, 2), rows(k, 2 * kv_head, 2), rows(v, 2 * kv_head, 2)])
        assert torch.equal(layer.weight, expected)


@pytest.mark.parametrize("tp", [2, 4])
def test_qkv_head_groups_give_each_rank_its_share_of_every_group(tp):
    """head_groups=2 (DiffLlama pairs head h with h + H/2): a rank's heads are its share of each half, in order,
    so the halves of its local head axis pair up as the model's do; key heads too (replicated when tp exceeds
    the key heads of a group)."""
    q, k, v = _qkv_weights(8, 4, 2)
    heads, kv_heads = 4 // tp, max(2 // tp, 1)  # per group and rank
    for rank in range(tp):
        by_id = QKVParallelLinear(3, 2, 8, 4, comm_manager=FakeTP(tp, rank), head_groups=2)
        fused = QKVParallelLinear(3, 2, 8, 4, comm_manager=FakeTP(tp, rank), head_groups=2)
        for sid, w in zip("qkv", (q, k, v)):
            load(by_id.weight, w, sid)
        load(fused.weight, torch.cat([q, k, v]))
        assert (by_id.num_heads, by_id.num_kv_heads) == (2 * heads, 2 * kv_heads)
        kv_head = rank * 2 // tp * kv_heads
        expected = torch.cat(
            [rows(q, 2 * (g * 4 + rank * heads), 2 * heads) for g in range(2)]
            + [rows(w, 2 * (g * 2 + kv_head), 2 * kv_heads) for w in (k, v) for g in range(2)]
        )
        assert torch.equal(by_id.weight, expected) and torch.equal(fused.weight, expected)
    with pytest.raises(ConfigError, match=r"num_key_value_heads \(3\) must both split into the model's 2"):
        QKVParallelLinear(3, 2, 8, 3, head_groups=2)


def test_qkv_head_counts_must_split_over_tp():
    with pytest.raises(ConfigError, match=r"num_attention_heads \(6\).*attn_tp_group \(4\)"):
        QKVParallelLinear(3, 2, 6, 2, comm_manager=FakeTP(4, 0))
    with pytest.raises(ConfigError, match=r"num_key_value_heads \(3\)"):
        QKVParallelLinear(3, 2, 6, 3, comm_manager=FakeTP(2, 0))


def test_merged_shard_ids_and_fused_on_disk():
    gate, up = torch.randn(6, 3), torch.randn(6, 3)
    for rank in range(2):
        by_id = MergedColumnParallelLinear(3, [6, 6], comm_manager=FakeTP(2, rank))
        fused = MergedColumnParallelLinear(3, [6, 6], comm_manager=FakeTP(2, rank))
        load(by_id.weight, gate, 0)
        load(by_id.weight, up, 1)
        load(fused.weight, torch.cat([gate, up]))
        expected = torch.cat([rows(gate, 3 * rank, 3), rows(up, 3 * rank, 3)])
        assert torch.equal(by_id.weight, expected) and torch.equal(fused.weight, expected)


def test_shape_mismatch_names_parameter_and_both_shapes():
    layer = QKVParallelLinear(
        3, 2, 4, 2, comm_manager=FakeTP(2, 0), prefix="model.layers.0.self_attn.qkv_proj"
    )
    with pytest.raises(
        ValueError,
        match=re.escape(
            "model.layers.0.self_attn.qkv_proj.weight: checkpoint tensor has shape [6, 3], expected [4, 3] "
            "(this rank keeps a [2, 3] shard of it)"
        ),
    ):
        load(layer.weight, torch.randn(6, 3), "k")
    row = RowParallelLinear(8, 3, bias=True, comm_manager=FakeTP(2, 1), prefix="mlp.down_proj")
    with pytest.raises(
        ValueError, match=re.escape("mlp.down_proj.weight: checkpoint tensor has shape [3, 6]")
    ):
        load(row.weight, torch.randn(3, 6))
    with pytest.raises(ValueError, match=re.escape("mlp.down_proj.bias: checkpoint tensor has shape [4]")):
        load(row.bias, torch.randn(4))


def test_vocab_shards_zero_their_padding_rows():
    w = torch.randn(100, 4)
    for rank, real in ((0, 64), (1, 36)):
        emb = VocabParallelEmbedding(100, 4, comm_manager=FakeTP(2, rank))  # padded to 128, 64 rows per rank
        emb.weight.data.fill_(float("nan"))
        load(emb.weight, w)
        assert emb.weight.shape == (64, 4)
        assert torch.equal(emb.weight[:real], rows(w, 64 * rank, real))
        assert torch.equal(emb.weight[real:], torch.zeros(64 - real, 4))


def test_lazy_safetensors_slices(tmp_path):
    tensors = {
        "col": torch.randn(8, 3),
        "row": torch.randn(3, 8),
        "k": torch.randn(4, 3),
        "emb": torch.randn(10, 3),
    }
    save_file(tensors, tmp_path / "w.safetensors")
    col = ColumnParallelLinear(3, 8, comm_manager=FakeTP(2, 1))
    row = RowParallelLinear(8, 3, comm_manager=FakeTP(2, 1))
    qkv = QKVParallelLinear(3, 2, 2, 2, comm_manager=FakeTP(2, 1))
    emb = VocabParallelEmbedding(10, 3, comm_manager=FakeTP(2, 1), pad_to=4)  # rows 4..7 of a padded 8
    with safe_open(tmp_path / "w.safetensors", framework="pt") as f:
        load(col.weight, f.get_slice("col"))
        load(row.weight, f.get_slice("row"))
        load(qkv.weight, f.get_slice("k"), "k")
        load(emb.weight, f.get_slice("emb"))
    assert torch.equal(col.weight, tensors["col"][4:])
    assert torch.equal(row.weight, tensors["row"][:, 4:])
    assert torch.equal(qkv.weight[2:4], tensors["k"][2:])
    assert torch.equal(emb.weight[:2], tensors["emb"][8:]) and not emb.weight[2:].any()


class RecordingSlice:
    """A lazy slice that remembers which indices were read."""

    def __init__(self, t: torch.Tensor):
        self.t, self.reads = t, []

    def get_shape(self):
        return list(self.t.shape)

    def __getitem__(self, index):
        self.reads.append(index)
        return self.t[index]


def test_each_rank_reads_only_its_rows():
    src = RecordingSlice(torch.randn(8, 3))
    load(ColumnParallelLinear(3, 8, comm_manager=FakeTP(4, 2)).weight, src)
    assert src.reads == [(slice(4, 6),)]


def test_weights_stored_in_out_load_transposed(tmp_path):
    """transformers' Conv1D stores [in, out]: each layer keeps its share of the transpose, read lazily too, and a
    square weight (where a missed transpose would load without error) is transposed."""
    w_col, w_row, w_sq = torch.randn(3, 8), torch.randn(8, 3), torch.randn(4, 4)
    save_file({"col": w_col, "row": w_row, "sq": w_sq}, tmp_path / "w.safetensors")
    for rank in range(2):
        tp = FakeTP(2, rank)
        col = ColumnParallelLinear(3, 8, comm_manager=tp, transposed_on_disk=True)
        qkv = QKVParallelLinear(3, 2, 2, 1, comm_manager=tp, transposed_on_disk=True)
        row = RowParallelLinear(8, 3, comm_manager=tp, transposed_on_disk=True)
        whole = ReplicatedLinear(4, 4, bias=True, transposed_on_disk=True)
        load(qkv.weight, w_col)
        load(whole.bias, w_sq[0])  # only the weight is stored transposed
        with safe_open(tmp_path / "w.safetensors", framework="pt") as f:
            load(col.weight, f.get_slice("col"))
            load(row.weight, f.get_slice("row"))
            load(whole.weight, f.get_slice("sq"))
        assert torch.equal(col.weight, rows(w_col.t(), 4 * rank, 4))
        expected = torch.cat([rows(w_col.t(), 2 * rank, 2), w_col.t()[4:6], w_col.t()[6:8]])
        assert torch.equal(qkv.weight, expected)
        assert torch.equal(row.weight, w_row.t()[:, 4 * rank : 4 * rank + 4])
        assert torch.equal(whole.weight, w_sq.t()) and torch.equal(whole.bias, w_sq[0])


def test_replicated_and_single_rank_forward_match_f_linear():
    x, w, b = torch.randn(2, 3), torch.randn(5, 3), torch.randn(5)
    for cls in (ReplicatedLinear, ColumnParallelLinear):
        layer = cls(3, 5, bias=True)
        load(layer.weight, w)
        load(layer.bias, b)
        torch.testing.assert_close(layer(x), F.linear(x, w, b))
    head = ParallelLMHead(5, 3, pad_to=4)
    load(head.weight, w)
    assert head.weight.shape == (8, 3) and head(x).shape == (2, 5)


def test_tied_lm_head_shares_or_refuses():
    emb, head = (
        VocabParallelEmbedding(10, 3, comm_manager=FakeTP(2, 0)),
        ParallelLMHead(10, 3, comm_manager=FakeTP(2, 0)),
    )
    head.tie_weights(emb)
    assert head.weight is emb.weight
    with pytest.raises(ConfigError, match="embed_tp_size and lmhead_tp_size must be equal"):
        ParallelLMHead(10, 3).tie_weights(emb)


# ---- multi-process (gloo): sharded forward == single-rank F.linear reference ----

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 16, 4, 2, 4, 100


def _setup(rank: int, world_size: int) -> CommManager:
    cm = CommManager(world_size, rank)
    for name in ("attn_tp_group", "embed_tp_group", "lmhead_tp_group"):
        cm.register_group(name, 1, world_size)
    cm.register_group(
        "dense_tp_group", world_size // 2, 2
    )  # TP 2 inside the world: one group at world 2, two at 4
    return cm


def _rand(*shape):
    return torch.randn(*shape) * 0.3


def _close(out, ref):
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def _mix_heads(q, k, v, heads, kv_heads):
    """Per-head stand-in for attention: head h uses kv head h // (heads / kv_heads)."""
    rep = heads // kv_heads
    k = k.unflatten(-1, (kv_heads, HEAD_DIM)).repeat_interleave(rep, -2)
    v = v.unflatten(-1, (kv_heads, HEAD_DIM)).repeat_interleave(rep, -2)
    return (q.unflatten(-1, (heads, HEAD_DIM)) * k + v).flatten(-2)


def check_qkv_row(cm: CommManager) -> None:
    torch.manual_seed(0)
    ws = [_rand(n * HEAD_DIM, HIDDEN) for n in (HEADS, KV_HEADS, KV_HEADS)]
    bs = [_rand(w.shape[0]) for w in ws]
    wo, bo, x = _rand(HIDDEN, HEADS * HEAD_DIM), _rand(HIDDEN), _rand(3, HIDDEN)
    qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=True, comm_manager=cm)
    o_proj = RowParallelLinear(HEADS * HEAD_DIM, HIDDEN, bias=True, comm_manager=cm, tp_group="attn_tp_group")
    for sid, w, b in zip("qkv", ws, bs):
        load(qkv.weight, w, sid)
        load(qkv.bias, b, sid)
    load(o_proj.weight, wo)
    load(o_proj.bias, bo)
    q, k, v = qkv(x).split([qkv.q_size, qkv.kv_size, qkv.kv_size], dim=-1)
    out = o_proj(_mix_heads(q, k, v, qkv.num_heads, qkv.num_kv_heads))
    ref_q, ref_k, ref_v = (F.linear(x, w, b) for w, b in zip(ws, bs))
    _close(out, F.linear(_mix_heads(ref_q, ref_k, ref_v, HEADS, KV_HEADS), wo, bo))


def check_merged_row(cm: CommManager) -> None:
    torch.manual_seed(1)
    gate, up, down, b_down, x = (
        _rand(32, HIDDEN),
        _rand(32, HIDDEN),
        _rand(HIDDEN, 32),
        _rand(HIDDEN),
        _rand(3, HIDDEN),
    )
    gate_up = MergedColumnParallelLinear(HIDDEN, [32, 32], comm_manager=cm)
    down_proj = RowParallelLinear(32, HIDDEN, bias=True, comm_manager=cm)
    load(gate_up.weight, torch.cat([gate, up]))
    load(down_proj.weight, down)
    load(down_proj.bias, b_down)
    g, u = gate_up(x).chunk(2, dim=-1)
    _close(down_proj(F.silu(g) * u), F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down, b_down))


def check_column_gather(cm: CommManager) -> None:
    torch.manual_seed(2)
    w, b, x = _rand(32, HIDDEN), _rand(32), _rand(3, HIDDEN)
    layer = ColumnParallelLinear(HIDDEN, 32, bias=True, gather_output=True, comm_manager=cm)
    load(layer.weight, w)
    load(layer.bias, b)
    _close(layer(x), F.linear(x, w, b))


def check_vocab_embedding(cm: CommManager) -> None:
    torch.manual_seed(3)
    w = _rand(VOCAB, HIDDEN)
    emb = VocabParallelEmbedding(VOCAB, HIDDEN, comm_manager=cm, pad_to=8)
    load(emb.weight, w)
    ids = torch.tensor([[0, 31, 32, 63], [64, VOCAB - 1, 5, 70]])
    _close(emb(ids), F.embedding(ids, w))


def check_lm_head(cm: CommManager) -> None:
    torch.manual_seed(4)
    w, b, h = _rand(VOCAB, HIDDEN), _rand(VOCAB), _rand(3, HIDDEN)
    head = ParallelLMHead(VOCAB, HIDDEN, bias=True, comm_manager=cm, pad_to=8)
    load(head.weight, w)
    load(head.bias, b)
    logits = head(h)
    assert logits.shape == (3, VOCAB)
    _close(logits, F.linear(h, w, b))
    emb, tied = (
        VocabParallelEmbedding(VOCAB, HIDDEN, comm_manager=cm, pad_to=8),
        ParallelLMHead(VOCAB, HIDDEN, comm_manager=cm, tp_group="embed_tp_group", pad_to=8),
    )
    load(emb.weight, w)
    tied.tie_weights(emb)
    _close(tied(h), F.linear(h, w))


def check_norm_over_all_heads(cm: CommManager) -> None:
    """OLMo2's q_norm / k_norm under TP: each rank's heads normalised with every head's statistics."""
    torch.manual_seed(5)
    ws, x = [_rand(n * HEAD_DIM, HIDDEN) for n in (HEADS, KV_HEADS, KV_HEADS)], _rand(3, HIDDEN)
    qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, comm_manager=cm)
    load(qkv.weight, torch.cat(ws))
    q, k, _ = qkv(x).split(qkv.output_partition_sizes, dim=-1)
    for local, w, heads in ((q, ws[0], HEADS), (k, ws[1], KV_HEADS)):
        norm = nn.RMSNorm(heads * HEAD_DIM, eps=1e-6)
        nn.init.normal_(norm.weight)
        expected = norm(F.linear(x, w))
        got = gather_heads(norm, heads, cm, "attn_tp_group")(local)
        per_rank = max(heads // cm.get_size("attn_tp_group"), 1) * HEAD_DIM
        replicas = max(cm.get_size("attn_tp_group") // heads, 1)
        start = cm.get_rank("attn_tp_group") // replicas * per_rank
        _close(got, expected[:, start : start + per_rank])


CHECKS = {
    f.__name__: f
    for f in (
        check_qkv_row,
        check_merged_row,
        check_column_gather,
        check_vocab_embedding,
        check_lm_head,
        check_norm_over_all_heads,
    )
}


world_results, test_distributed = distributed_tests(_setup, CHECKS)


def test_per_head_parameter_keeps_this_ranks_heads():
    sinks = torch.randn(8)
    for rank in range(4):
        param = shard_heads(nn.Parameter(torch.empty(8)), FakeTP(4, rank), "attn_tp_group")
        load(param, sinks)
        assert torch.equal(param, rows(sinks, 2 * rank, 2))
    whole = nn.Parameter(torch.empty(8))
    assert shard_heads(whole, None, "attn_tp_group") is whole and shard_heads(None, FakeTP(2, 0), "g") is None
    with pytest.raises(ConfigError, match="6 heads is not divisible by attn_tp_group \\(4\\)"):
        shard_heads(nn.Parameter(torch.empty(6)), FakeTP(4, 0), "attn_tp_group")


def test_a_ranks_heads_and_their_width_are_even_shares():
    assert local_heads(8, FakeTP(4, 1), "attn_tp_group") == 2
    assert local_width(8 * 16, FakeTP(4, 1), "attn_tp_group") == 2 * 16
    assert local_width(8 * 16, None, "attn_tp_group") == 8 * 16  # unsharded without a comm manager
    with pytest.raises(ConfigError, match="6 channels of the attention output are not divisible .* \\(4\\)"):
        local_width(6, FakeTP(4, 0), "attn_tp_group")


def test_key_heads_fewer_than_ranks_are_replicated_one_per_rank():
    assert [local_kv_heads(8, FakeTP(n, 0), "attn_tp_group") for n in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert [local_kv_heads(1, FakeTP(n, 0), "attn_tp_group") for n in (1, 2, 4)] == [1, 1, 1]
    assert local_kv_heads(2, FakeTP(4, 0), "attn_tp_group") == 1
    with pytest.raises(ConfigError, match="3 key heads are not divisible"):
        local_kv_heads(3, FakeTP(2, 0), "attn_tp_group")


def test_q_k_v_interleaved_per_head_need_a_key_head_per_query_head():
    interleaved_heads(8, 8)
    with pytest.raises(
        ConfigError, match="interleaved per head, but this model has 2 key heads for 8 query heads"
    ):
        interleaved_heads(8, 2)


def test_a_ranks_rows_of_a_projection_viewed_in_blocks_are_whole_blocks():
    # CodeGen: 3 x 64 rows in 4 blocks of 48 (mp_num 4): 1, 2 or 4 ranks take whole blocks, 8 would cut them
    for size in (1, 2, 4):
        whole_blocks(3 * 64, 48, FakeTP(size, 0), "attn_tp_group")
    whole_blocks(3 * 64, 48, None, "attn_tp_group")
    with pytest.raises(
        ConfigError, match="192 output channels are 4 blocks of 48 .* choose a size that divides 4"
    ):
        whole_blocks(3 * 64, 48, FakeTP(8, 0), "attn_tp_group")
