"""Drives one step: packs a Batch into tensors, runs the model, samples, writes results back."""
import logging

import torch
import torch.distributed

from runtime.config import InferenceConfig
from runtime.distributed import DistInfo
from runtime.engine.forward_metadata import ForwardMetaData
from runtime.engine.model_worker import ModelWorker
from runtime.engine.request import Batch, Request, SamplingParams
from runtime.engine.sampler import Sampler
from runtime.layers.token_layout import ATTN_GROUP, step_layout, use_layout

logger = logging.getLogger(__name__)


def _long(device, values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


class ExecutionEngine:
    def __init__(self, config: InferenceConfig, dist: DistInfo, model_dir=None):
        self.config, self.device = config, dist.device
        self.worker = ModelWorker(config, dist, model_dir)
        self.sampler = Sampler()
        self.kv = None
        self.tokenizer = None

    def init(self) -> None:
        self.worker.init()
        self.tokenizer = self.worker.load_tokenizer()
        self.kv = self.worker.init_kvcache()

    def _build_model_inputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, ForwardMetaData]:
        tokens = batch.new_token_ids()
        lens_q = [len(t) for t in tokens]
        kv_len = [0 if batch.is_prefill else r.computed_len for r in batch.requests]
        dev = self.device
        input_ids = _long(dev, [t for seq in tokens for t in seq])
        q, kv = _long(dev, lens_q), _long(dev, kv_len)
        cu_q = torch.nn.functional.pad(q.cumsum(0), (1, 0))
        if batch.is_prefill:
            req_of_token = torch.repeat_interleave(torch.arange(len(batch), device=dev), q)
            positions = torch.arange(input_ids.numel(), device=dev) - cu_q[:-1][req_of_token]
        else:
            req_of_token, positions = torch.arange(len(batch), device=dev), kv
        kv_total = kv + q
        md = ForwardMetaData(
            is_prefill=batch.is_prefill, kv_len=kv, actual_seq_lengths_q=q, actual_seq_lengths_kv=kv_total,
            actual_seq_lengths_cu_q=cu_q, positions=positions, max_seq_len_q=max(lens_q),
            max_seq_len_kv=max(k + n for k, n in zip(kv_len, lens_q)),
            prompt_tokens=[len(r.prompt_token_ids) for r in batch.requests])
        block_size = self.kv.block_size
        width = -(-md.max_seq_len_kv // block_size)  # blocks covering the longest context this step
        for group, tables in self.kv.block_tables([r.request_id for r in batch.requests]).items():
            table = _long(dev, [t[:width] + [0] * (width - len(t[:width])) for t in tables])
            md.block_table[group] = table
            md.slot_mapping[group] = table[req_of_token, positions // block_size] * block_size + positions % block_size
        return input_ids, positions, md

    def _run(self, input_ids: torch.Tensor, position_ids: torch.Tensor, md: ForwardMetaData):
        layout = step_layout(self.config.parallel_config, self.worker.comm_manager, input_ids.numel(), self.device)
        with use_layout(layout):
            return self.worker.inference(input_ids, position_ids, md)

    @torch.inference_mode()
    def forward_batch(self, batch: Batch) -> dict:
        input_ids, position_ids, md = self._build_model_inputs(batch)
        logits, infer_ms = self._run(input_ids, position_ids, md)
        next_tokens = self._agree(self.sampler(logits[:, -1, :], batch.requests)).tolist()
        return {"next_tokens": next_tokens, "logits": logits, "infer_time_ms": infer_ms}

    def _agree(self, tokens: torch.Tensor) -> torch.Tensor:
        """The attn-TP ranks serve the same requests: all take the first rank's sample (unseeded sampling draws
        from each rank's own generator)."""
        cm = self.worker.comm_manager
        if cm is None or not cm.has_group(ATTN_GROUP) or cm.get_group(ATTN_GROUP) is None:
            return tokens
        torch.distributed.broadcast(tokens, src=cm.get_ranks(ATTN_GROUP)[0], group=cm.get_group(ATTN_GROUP))
        return tokens

    @torch.inference_mode()
    def dummy_step(self) -> None:
        """A one-token forward whose KV goes to slot 0 (the null block; a free legacy row): a rank without work
        runs it while its peers step, because attention-DP ranks share the collectives of TP modules."""
        one, zero = _long(self.device, [1]), _long(self.device, [0])
        slot = _long(self.device, [[0]])
        md = ForwardMetaData(
            is_prefill=True, kv_len=zero, actual_seq_lengths_q=one, actual_seq_lengths_kv=one,
            actual_seq_lengths_cu_q=_long(self.device, [0, 1]), positions=zero, max_seq_len_q=1, max_seq_len_kv=1,
            prompt_tokens=[1], block_table=dict.fromkeys(self.kv.group_keys, slot),
            slot_mapping=dict.fromkeys(self.kv.group_keys, zero))
        self._run(zero, zero, md)

    def warm_up(self) -> None:
        """One dummy prefill + decode so kernels and allocators are ready before timing starts."""
        request = Request([0, 1, 2], SamplingParams(max_new_tokens=2))
        if not self.kv.allocate_slots(request.request_id, 0, request.num_tokens + 1):
            return
        for is_prefill in (True, False):
            batch = Batch([request], is_prefill=is_prefill)
            batch.update_requests_from_batch(self.forward_batch(batch)["next_tokens"])
        self.kv.free(request.request_id)
