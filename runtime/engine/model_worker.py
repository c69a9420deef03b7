"""Owns the model: config -> CommManager -> construction -> weights -> post-processing -> KV cache."""

import contextlib
import json
import logging
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

from runtime.config import InferenceConfig
from runtime.config.comm_manager import CommManager
from runtime.device_memory import free_memory_bytes, lazy_zeros, return_cached_memory, synchronize
from runtime.distributed import DistInfo
from runtime.engine.float64 import Float64, in_dtype
from runtime.engine.graph_mode import compile_decode
from runtime.engine.legacy_cache import LegacyCacheRows
from runtime.engine.loader import converted_quant_method, init_dummy_weights, load_checkpoint
from runtime.engine.registry import resolve_model
from runtime.errors import UserError
from runtime.kv_cache import KVCacheManager, blocks_for_batch, blocks_for_memory
from runtime.layers.attention import Attention, cache_holders
from runtime.layers.host_linear import swap_host_linears
from runtime.layers.quantization.online import process_weights_after_loading, quantize_online

logger = logging.getLogger(__name__)


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters this rank holds (tied ones once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    if dtype == torch.float64:  # the float32 a model pins (a router's weight) is float64 too
        with Float64():
            yield
        return
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


class ModelWorker:
    def __init__(self, config: InferenceConfig, dist: DistInfo, model_dir: Path | None):
        self.config, self.dist, self.model_dir = config, dist, model_dir
        self.model_path = Path(config.model_config.model_path).expanduser()
        self.model = None
        self.decode_model = None  # the model, or its compiled decode graph (exe_mode)
        self.hf_config: PretrainedConfig | None = None
        self.comm_manager: CommManager | None = None
        self.state_bytes = 0  # set aside outside the KV pool for the layers' per-request states

    def resolve_classes(self):
        mc = self.config.model_config
        if mc.custom_params.get("remote_code") and not mc.trust_remote_code:
            raise UserError(
                f"{self.model_dir} was migrated from code shipped inside the checkpoint; running it "
                "executes that code. Set model_config.trust_remote_code: True in the YAML (or pass "
                "--trust-remote-code) if you trust its source."
            )
        return resolve_model(Path(self.model_dir), self._model_type())

    def _model_type(self) -> str | None:
        path = self.model_path / "config.json"
        return json.loads(path.read_text()).get("model_type") if path.is_file() else None

    def _load_hf_config(self, config_cls) -> PretrainedConfig:
        if not (self.model_path / "config.json").is_file():
            raise UserError(
                f"no config.json in {self.model_path}; set model_config.model_path in the YAML to "
                "the checkpoint directory."
            )
        try:
            if config_cls is None:
                return AutoConfig.from_pretrained(
                    self.model_path, trust_remote_code=self.config.model_config.trust_remote_code
                )
            hf_config = config_cls.from_pretrained(self.model_path)
        except UserError:
            raise
        except Exception as e:  # the config class (remote code too) rejected the checkpoint's config.json
            name = config_cls.__name__ if config_cls is not None else "AutoConfig"
            raise UserError(
                f"{name} could not read {self.model_path / 'config.json'}: {type(e).__name__}: {e}; "
                "fix the configuration code or config.json (transformers' own from_pretrained fails the same way)."
            ) from e
        hf_config._name_or_path = str(self.model_path)  # as AutoConfig sets it: where remote code lives
        return hf_config

    def model_class_and_config(self) -> tuple[type[torch.nn.Module], PretrainedConfig]:
        """The model directory's entry class and the checkpoint's HF config (through its config class if any)."""
        model_cls, config_cls = self.resolve_classes()
        return model_cls, self._load_hf_config(config_cls)

    def init(self) -> None:
        mc = self.config.model_config
        model_cls, self.hf_config = self.model_class_and_config()
        pc = self.config.parallel_config
        self.comm_manager = CommManager(pc.world_size, self.dist.rank)
        start = time.perf_counter()
        with torch.device(self.dist.device), default_dtype(mc.torch_dtype):
            model = model_cls(self.hf_config, self.config, self.comm_manager, prefix="")
        # factories the device context misses (torch.normal) leave their tensors on the host
        model.to(self.dist.device).eval().requires_grad_(False)
        for name, module in model.named_modules():  # migrated code builds Attention without a prefix
            if isinstance(module, Attention) and not module.prefix:
                module.prefix = name
        if hasattr(model, "check_model_settings"):
            model.check_model_settings()
        saved = self._saved_quant_method() if mc.with_ckpt else None
        if mc.with_ckpt:
            load_checkpoint(model, self.model_path, pc, self.dist.rank)
        else:
            init_dummy_weights(model)
        if mc.quant_method != "none" and saved is None:  # convert-weights shards hold theirs already
            quantize_online(model, mc.quant_method)
        process_weights_after_loading(model)
        tp = max(pc.attn_tp_size, pc.dense_tp_size, pc.embed_tp_size, pc.lmhead_tp_size, pc.moe_tp_size)
        if tp > 1 and not any(hasattr(p, "weight_loader") for p in model.parameters()):
            logger.warning(
                "parallel_config asks for TP %d but %s has no parallel layers (run `skill parallelize`); "
                "every rank computes the whole model",
                tp,
                model_cls.__name__,
            )
        self.model = model
        self.param_bytes = param_bytes(model)
        count, self.linear_path = swap_host_linears(model, mc.exe_mode != "eager", self._decode_rows())
        if count:
            logger.info("[Main] %d linear layers run on %s", count, self.linear_path)
        self.decode_model = compile_decode(model, mc.exe_mode, self.dist.device)
        logger.info(
            "[Main] model %s loaded in %.1f s (%s, %s), %d parameter bytes on rank %d",
            model_cls.__name__,
            time.perf_counter() - start,
            self.dist.device,
            mc.dtype,
            self.param_bytes,
            self.dist.rank,
        )

    def _decode_rows(self) -> int | None:
        """The most rows a linear layer takes in a decode step (None: this engine only prefills). Under attention
        TP or DP a TP group gathers its ranks' padded rows, so the bound is the batch times the world size."""
        if self.config.disagg_config.disaggregation_mode == "PREFILL":
            return None
        return self.config.scheduler_config.batch_size * self.config.parallel_config.world_size

    def _saved_quant_method(self) -> str | None:
        """The quant_method convert-weights saved model_path's shards with (None: not such shards); it must be
        the YAML's."""
        saved, wanted = converted_quant_method(self.model_path), self.config.model_config.quant_method
        if saved is not None and saved != wanted:
            raise UserError(
                f"{self.model_path} holds weights convert-weights saved with quant_method {saved!r}, but "
                f"model_config.quant_method is {wanted!r}; set it to {saved!r} (the YAML convert-weights "
                "wrote does), or point model_path at the original checkpoint."
            )
        return saved

    def load_tokenizer(self):
        try:
            return AutoTokenizer.from_pretrained(
                self.model_path, trust_remote_code=self.config.model_config.trust_remote_code
            )
        except (OSError, ValueError) as e:
            raise UserError(
                f"cannot load a tokenizer from {self.model_path} ({e}); the checkpoint directory "
                "needs tokenizer.json or tokenizer_config.json."
            ) from e

    def init_kvcache(self):
        """Paged KV when the model declares cache entries, else the legacy per-module ``cache_unit`` rows."""
        sc, dtype = self.config.scheduler_config, self.config.model_config.torch_dtype
        batch, max_seq = self.config.batch_size_per_dp_rank, self.config.max_seq_len
        info = self.model.get_cache_info() if hasattr(self.model, "get_cache_info") else None
        modules = dict(self.model.named_modules())
        if info is None:
            owners = [m for m in modules.values() if getattr(m, "cache_unit", None)]
            if not owners:
                raise UserError(
                    f"{type(self.model).__name__} declares neither get_cache_info() nor cache_unit "
                    "on its attention modules, so the runtime cannot give it a KV cache."
                )
            for m in owners:
                m.k_cache = torch.zeros(batch, max_seq, *m.cache_unit, dtype=dtype, device=self.dist.device)
                v_unit = getattr(m, "v_cache_unit", None) or m.cache_unit
                m.v_cache = torch.zeros(batch, max_seq, *v_unit, dtype=dtype, device=self.dist.device)
            return LegacyCacheRows(batch, max_seq)
        bytes_per_block = info.bytes_per_block(sc.block_size)
        num_blocks = sc.num_kv_blocks or self._blocks_from_memory(bytes_per_block)
        manager = KVCacheManager(info, num_blocks, sc.block_size)
        holders = {**modules, **cache_holders(self.model)}
        for entries in manager.groups.values():
            for e in entries:
                shape = (num_blocks, sc.block_size, e.num_kv_heads)
                module = holders[e.name]
                module.k_cache = lazy_zeros((*shape, e.head_dim), e.dtype, self.dist.device)
                module.v_cache = lazy_zeros((*shape, e.value_dim), e.dtype, self.dist.device)
        logger.info(
            "[Main] paged KV cache: %d blocks x %d tokens (%.1f MiB), %s",
            num_blocks,
            sc.block_size,
            num_blocks * bytes_per_block / 2**20,
            ", ".join(manager.group_keys),
        )
        return manager

    def held_bytes(self) -> int:
        """Bytes of the model's parameters and buffers on this rank."""
        return param_bytes(self.model) + sum(b.numel() * b.element_size() for b in self.model.buffers())

    def fit_cache_keys(self, keys: dict[int, set[int]], resize: bool = False) -> bool:
        """Give each attention layer a cache per key a forward pass gave it (``keys``: by id of the layer); True
        when one changed, or ``resize`` asks, after releasing the pool, which must then be sized again."""
        owners = [m for m in self.model.modules() if isinstance(m, Attention) and m.cache_owner is m]
        wanted = {m: tuple(sorted(keys[id(m)])) for m in owners if id(m) in keys}
        changed = [m for m, k in wanted.items() if k != m.cache_keys]
        for m in changed:
            m.set_cache_keys(wanted[m])
            logger.info("[Main] %s keeps a cache for each of its keys %s", m.prefix, m.cache_keys)
        if changed or resize:
            for holder in cache_holders(self.model).values():
                holder.k_cache = holder.v_cache = None
            return_cached_memory(self.dist.device)
        return bool(changed) or resize

    def _blocks_from_memory(self, bytes_per_block: int) -> int:
        """``mem_fraction_static`` of the memory free after the weights and the per-request states
        (``state_bytes``), but no more blocks than the scheduler can ever hold at once (batch_size_per_dp_rank
        requests of max_seq_len tokens)."""
        sc = self.config.scheduler_config
        free = max(free_memory_bytes(self.dist.device) - self.state_bytes, 0)
        fits = blocks_for_memory(free, sc.mem_fraction_static, bytes_per_block)
        most = blocks_for_batch(self.config.batch_size_per_dp_rank, self.config.max_seq_len, sc.block_size)
        return min(fits, most)

    def inference(self, input_ids, position_ids, forward_metadata) -> tuple[torch.Tensor, float]:
        """The model's logits and the step's time in ms, measured after the device has finished it."""
        start = time.perf_counter()
        model = self.model if forward_metadata.is_prefill else self.decode_model
        with in_dtype(self.config.model_config.torch_dtype):
            logits = model(input_ids, position_ids, forward_metadata)
        if isinstance(logits, tuple):  # (logits, prev_hidden_states) for MTP models
            logits = logits[0]
        synchronize(self.dist.device)
        return logits, (time.perf_counter() - start) * 1000
