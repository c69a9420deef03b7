"""Packs one scheduled Batch into the model's inputs: token ids, positions and the step's ForwardMetaData.

Everything is computed on the host in one pass and moved to the device as one int64 buffer (one copy per
step), then sliced; nothing here loops over layers.
"""

import itertools

import torch

from runtime.engine.forward_metadata import ForwardMetaData
from runtime.engine.request import Batch


def _cumsum0(xs: list[int]) -> list[int]:
    return [0, *itertools.accumulate(xs)]


def build_step_inputs(
    batch: Batch,
    block_tables: dict[str, list[list[int]]],
    block_size: int,
    device: torch.device,
    min_rows: int = 1,
    min_blocks: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, ForwardMetaData]:
    """block_tables: cache group -> one block list per request of the batch (as the KV manager holds them).

    ``min_rows`` pads the batch with one-token rows that write to the null slot 0, ``min_blocks`` the block tables
    with the null block: sizes a compiled decode graph is traced on and serves (``forward_batch``, ``warm_up``)."""
    tokens = batch.new_token_ids()
    kv_len = [0 if batch.is_prefill else r.computed_len for r in batch.requests]
    tables_in = block_tables
    if len(tokens) < min_rows:
        pad = min_rows - len(tokens)
        tokens, kv_len = tokens + [[0]] * pad, kv_len + [0] * pad
        tables_in = {g: t + [[0]] * pad for g, t in block_tables.items()}
    lens_q = [len(t) for t in tokens]
    lens_kv = [k + q for k, q in zip(kv_len, lens_q)]
    positions = [p for k, q in zip(kv_len, lens_q) for p in range(k, k + q)]
    width = max(min_blocks, -(-max(lens_kv) // block_size))  # blocks covering the longest context this step
    host: list[list[int]] = [
        [t for seq in tokens for t in seq],
        positions,
        lens_q,
        kv_len,
        lens_kv,
        _cumsum0(lens_q),
    ]
    groups = list(tables_in)
    for group in groups:
        tables = [t[:width] + [0] * (width - len(t[:width])) for t in tables_in[group]]
        host.append([b for t in tables for b in t])
        host.append(
            [
                tables[r][p // block_size] * block_size + p % block_size
                for r, (k, q) in enumerate(zip(kv_len, lens_q))
                for p in range(k, k + q)
            ]
        )
    flat = torch.tensor(list(itertools.chain.from_iterable(host)), dtype=torch.long).to(
        device, non_blocking=True
    )
    parts = iter(flat.split([len(h) for h in host]))
    input_ids, pos, q, kv, kv_total, cu_q = (next(parts) for _ in range(6))
    md = ForwardMetaData(
        is_prefill=batch.is_prefill,
        kv_len=kv,
        actual_seq_lengths_q=q,
        actual_seq_lengths_kv=kv_total,
        actual_seq_lengths_cu_q=cu_q,
        positions=pos,
        max_seq_len_q=max(lens_q),
        max_seq_len_kv=max(lens_kv),
        prompt_tokens=[len(r.prompt_token_ids) for r in batch.requests] + [1] * (len(tokens) - len(batch)),
    )
    for group in groups:
        md.block_table[group] = next(parts).view(len(tokens), width)
        md.slot_mapping[group] = next(parts)
    return input_ids, pos, md
