"""Tiny random-weight HF checkpoints (model + offline-trained tokenizer) for fast parity tests."""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

PAD, BOS_CHAT, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS_CHAT, EOS]  # ids 0, 1, 2 as in SmolLM2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still learn the shape of a sentence.
Once upon a time there was a little village by the sea, where the people fished and sang every evening.
The capital of France is Paris, the capital of Italy is Rome, and the capital of Japan is Tokyo.
Water boils at one hundred degrees and freezes at zero. The sun rises in the east and sets in the west.
She opened the window, looked at the garden, and decided that today would be a good day for a walk.
Computers store numbers as bits. A program reads input, computes a result, and writes output to a file.
In the morning we drink coffee or tea; in the afternoon we work, and at night we read books and sleep.
Questions and answers: what is your name? My name is Ada. How old are you? I am ten years old.
The river flows through the valley between green hills, past farms, bridges, and an old stone mill.
Music, painting, and poetry are arts; mathematics, physics, and chemistry are sciences of nature.
1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14 -- hello, world! "quoted" (parenthesised) [bracketed] {braced}
"""

# Token lengths under the 512-entry tiny tokenizer: 3, 7, 20, 42.
PARITY_PROMPTS = [
    "The capital of",
    "The capital of France is",
    "Once upon a time there was a little village by the sea",
    "She opened the window, looked at the garden, and decided that today would be a good day for a walk by the river",
]

_TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 512,
}
# one of several transformers a model sizes in a sub-config of its own (BLT)
_SMALL_PART = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "vocab_size": 512,
}
# Per-arch extras; tie_word_embeddings follows each arch's own default, stated explicitly.
_ARCH: dict[str, dict] = {
    "llama": {"tie_word_embeddings": False},
    "mistral": {"tie_word_embeddings": False},
    "qwen2": {"tie_word_embeddings": False},
    "qwen3": {"tie_word_embeddings": False},
    "gemma3_text": {"tie_word_embeddings": True, "sliding_window": 8, "query_pre_attn_scalar": 16},
    # an MoE layer from the second on
    "deepseek_v3": {"tie_word_embeddings": False, "first_k_dense_replace": 1},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},  # its layer pattern, for 2 layers
    "zaya": {"num_experts_per_tok": 1},  # the only top-k its config accepts
    # hybrids whose defaults name no layer pattern with both kinds: a state layer, then an attention layer
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "bamba": {"attn_layer_indices": [1]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    # its sliding layers' per-layer sizes are a full model's (64 heads of 256): indexed attention only
    "dots3_note_text": {"layer_types": ["indexed_attention", "indexed_attention"]},
    # its last layer reuses the cache of an earlier layer of its kind: two sliding layers, as before the mix
    "gemma3n_text": {"layer_types": ["sliding_attention", "sliding_attention"]},
    # Zamba ties its shared transformer's weights across hybrid layers: two of them
    "zamba": {"layer_types": ["linear_attention", "hybrid", "hybrid"], "num_hidden_layers": 3},
    # its defaults leave the sparse-attention indexer unsized (the published config sets it): one key head, as
    # its config requires, a budget of two compressed blocks of 4
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
    },
    # a dense attention layer, then a sparse one; the shared experts' and dense MLPs' widths the tiny ones
    "minimax_m3_vl_text": {
        "layer_types": ["full_attention", "minimax_m3_sparse"],
        "shared_intermediate_size": 128,
        "dense_intermediate_size": 128,
    },
    # sub-configs: the attention reads `rope_theta` and clamps q/k/v by `clip_qkv`, which DBRX checkpoints set and
    # the defaults leave unset; 4 small experts, 2 per token
    "dbrx": {
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
    },
    # BLT's four transformers (entropy patcher, local encoder and decoder, global) are sized in sub-configs, all
    # at the tiny width and byte vocabulary, and its n-gram hash table by its own count
    "blt": {
        "encoder_hash_byte_group_vocab": 512,
        **{
            part: {**_SMALL_PART, **extra}
            for part, extra in {
                "patcher_config": {"head_dim": 16},
                "encoder_config": {"hidden_size_global": 64},
                "decoder_config": {"hidden_size_global": 64, "head_dim": 16},
                "global_config": {"head_dim": 16},
            }.items()
        },
    },
    # transformers' recurrent step sizes the state by the value heads' width: q/k heads as wide (the defaults'
    # 0.5 fails its own shape check on a first decode step)
    "xlstm": {"qk_dim_factor": 1.0},
    # a layer in each section: input, recurrent (looped), output
    "dory": {"num_hidden_layers": 3, "n_input_layers": 1, "n_output_layers": 1},
    # its defaults loop layers 6..17 (none of two): layers 1 and 2 (a full and a sliding one) looped twice between
    # a layer before and one after them, a block per layer
    "inkling2_loop_text": {
        "num_hidden_layers": 4,
        "loop_layer_index_start": 1,
        "loop_layer_index_end": 3,
        "loop_num_passes": 2,
        "n_layers_per_attn_res_block": 1,
    },
}


@functools.lru_cache(maxsize=8)
def _tokenizer_json(vocab_size: int) -> str:
    n_base = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)
    if vocab_size < n_base:
        raise ValueError(f"vocab_size must be >= {n_base} (byte alphabet + special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    # A corpus too small for the requested size is padded with never-produced reserved tokens.
    missing = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    tok.add_special_tokens([AddedToken(f"<|reserved_{i}|>", special=True) for i in range(missing)])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    return tok.to_str()


def make_tokenizer(out_dir: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained offline on CORPUS, exactly `vocab_size` entries, ChatML template; saved to `out_dir`."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        eos_token=EOS,
        pad_token=PAD,
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
    )
    assert len(tokenizer) == vocab_size
    tokenizer.save_pretrained(out_dir)
    return tokenizer


_MOE = {"num_experts": 4, "num_local_experts": 4, "moe_intermediate_size": 32, "num_experts_per_tok": 2}
# Group-limited top-k over the 4 tiny experts: 2 groups of 2, the top-2 taken from the best group (a default of
# 8 groups would leave no expert in a group).
_EXPERT_GROUPS = {"n_group": 2, "topk_group": 1}
# Sizes some configs name apart from head_dim and vocab_size, shrunk where the config sets them (MLA ranks and
# head parts, partial rotary, per-layer input embeddings): left at their defaults they contradict the tiny sizes.
_SUB_SIZES = {
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "qk_head_dim": 32,
    "v_head_dim": 16,
    "rotary_dim": 8,
    "global_head_dim": 16,  # Gemma 4: full-attention layers' head size
    "vocab_size_per_layer_input": 512,  # Gemma 3n / 4: per-layer input embeddings
    "hidden_size_per_layer_input": 16,
    # DeepSeek's sparse attention: each query reads the 4 tokens its indexer picks, not 2048 (all); its 64 scoring
    # heads stay, since fewer tie more scores at ReLU's 0, which transformers' own cached and uncached runs then
    # break differently
    "index_topk": 4,
    # MiniMax-M3's block-sparse attention: each query reads 2 blocks of 4 keys (its own among them), not 16 of 128
    "index_block_size": 4,
    "index_topk_blocks": 2,
}


def _is_set(config: PretrainedConfig, name: str) -> bool:
    try:
        return getattr(config, name, None) is not None
    except RuntimeError:  # a per-layer attribute (heterogeneous configs) refuses a global read
        return False


def _named_sizes(defaults: PretrainedConfig) -> dict[str, int]:
    """Other sizes by what their names end with, shrunk where the defaults set them larger and the tables above
    do not name them (Inkling's `unpadded_vocab_size` sizes the LM head, its `swa_head_dim` the sliding
    layers' heads)."""
    found = {}
    for name, value in defaults.to_dict().items():
        if isinstance(value, int) and not isinstance(value, bool) and name not in {**_TINY, **_SUB_SIZES}:
            if name.endswith("vocab_size"):
                found[name] = min(value, _TINY["vocab_size"])
            elif name.endswith("head_dim"):
                found[name] = min(value, _TINY["head_dim"])
    return found


def _not_settable(defaults: PretrainedConfig, name: str, value) -> bool:
    """Whether the config computes `name` (a property without a setter: Falcon's head_dim) or refuses it (XLNet has
    no sequence length limit to set)."""
    prop = getattr(type(defaults), name, None)
    if not isinstance(prop, property):
        return False
    try:
        prop.fset(copy.copy(defaults), value)
    except (TypeError, NotImplementedError):  # TypeError: no setter
        return True
    return False


def tiny_config(model_type: str, **overrides) -> PretrainedConfig:
    """A tiny config for llama / mistral / qwen2 / qwen3 / gemma3_text; MoE types get 4 small experts."""
    fixed = {**_ARCH.get(model_type, {}), **overrides}  # what the arch's entry or the caller sets wins
    defaults = AutoConfig.for_model(model_type)
    # a causal LM is a decoder: BERT-style models key their causal mask on is_decoder (default False)
    params = {**_TINY, "is_decoder": True}
    params.update({k: v for k, v in _MOE.items() if hasattr(defaults, k)})
    params.update({k: v for k, v in _SUB_SIZES.items() if _is_set(defaults, k)})
    params.update(_named_sizes(defaults))
    if (getattr(defaults, "n_group", None) or 1) > 1:
        params.update(_EXPERT_GROUPS)
    if hasattr(defaults, "n_shared_experts") and defaults.n_shared_experts is None:
        params["n_shared_experts"] = 1  # a count the defaults leave unset, which the model multiplies by
    if (getattr(defaults, "num_kv_shared_layers", 0) or 0) > 0:
        # the last layer reuses an earlier one's keys and values, as the defaults' last layers do
        params["num_kv_shared_layers"] = 1
    params.update(fixed)
    if _is_set(defaults, "kv_lora_rank") and "num_key_value_heads" not in fixed:
        params["num_key_value_heads"] = params["num_attention_heads"]  # MLA: a key head per query head
    kinds = list(dict.fromkeys(getattr(defaults, "layer_types", None) or ()))
    if len(kinds) > 1 and "layer_types" not in fixed:
        # every kind of layer the defaults mix (Gemma 3's sliding and full attention, Qwen3-Next's linear and full
        # attention), in the order they first come, repeated over the layers
        layers = params["num_hidden_layers"] = max(params["num_hidden_layers"], len(kinds))
        params["layer_types"] = [kinds[i % len(kinds)] for i in range(layers)]
    derived = {k for k, v in params.items() if _not_settable(defaults, k, v)}
    params = {k: v for k, v in params.items() if k not in derived}  # e.g. Falcon computes head_dim
    # under the names the config's fields have (an alias's value wins, as it does when the config applies it after
    # building): a config that reads a field while it is built (DBRX sizes its ffn_config by `d_model`) would
    # otherwise see the default
    aliases = getattr(type(defaults), "attribute_map", {})
    params = {k: v for k, v in params.items() if k not in aliases} | {
        aliases[k]: v for k, v in params.items() if k in aliases
    }
    try:
        config = AutoConfig.for_model(model_type, **params)
    except StrictDataclassError as invalid:
        # a config that validates its heads (dots3_note_text wants as many key heads as query heads)
        mha = {**params, "num_key_value_heads": params["num_attention_heads"]}
        if "num_key_value_heads" in fixed:
            raise
        try:
            config = AutoConfig.for_model(model_type, **mha)
        except StrictDataclassError:
            raise invalid from None
        params = mha
    if vars(config).get("rope_parameters") == {} and "rope_parameters" not in overrides:
        # defaults that name no RoPE parameters for a model that reads them (Cohere Compass): plain RoPE
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        kinds = set(getattr(config, "layer_types", None) or ())
        params["rope_parameters"] = {k: rope for k in kinds} if kinds else rope
        config = AutoConfig.for_model(model_type, **params)
    return config


def _reinit_(model: PreTrainedModel, init_std: float) -> None:
    # Large matrices give peaked logits (confident greedy steps); 1-D params (norms, biases) keep their
    # arch's own centre (1 for RMSNorm, 0 for Gemma's 1+w norm and biases) plus a little noise.
    sandwich = any("post_feedforward_layernorm" in name for name, _ in model.named_parameters())
    # Sandwich post-norms (Gemma, OLMo2) pin each block's output RMS to their weight; lifted to 8x the
    # (possibly sqrt(hidden)-scaled) embedding RMS so the residual is not dominated by the current
    # token, which with tied embeddings makes greedy decoding repeat it.
    embed_scale = float(getattr(model.get_input_embeddings(), "embed_scale", 1.0))
    post_norm_shift = 8 * init_std * embed_scale - 1
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2:
                param.normal_(0.0, init_std)
                continue
            param.add_(torch.randn_like(param), alpha=0.1)
            if sandwich and ("post_attention_layernorm" in name or "post_feedforward_layernorm" in name):
                param.add_(post_norm_shift)
        params = dict(model.named_parameters(remove_duplicate=False))
        for name, value in model.state_dict().items():  # persistent float buffers (a router's bias) vary too
            if name not in params and value.is_floating_point():
                value.add_(torch.randn_like(value), alpha=0.1)


def set_token_id(config: PretrainedConfig, key: str, value: int | None, fallback: int) -> None:
    """``config.<key> = value``; a strictly typed config that wants an int there (cwm's bos, modernbert-decoder's
    pad) gets ``fallback`` instead."""
    try:
        setattr(config, key, value)
    except StrictDataclassError:
        setattr(config, key, fallback)


def build_tiny_checkpoint(
    config: PretrainedConfig,
    out_dir: Path,
    seed: int = 0,
    init_std: float = 0.5,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Random `AutoModelForCausalLM` for `config` (seeded) + tokenizer, saved as safetensors in `out_dir`."""
    out_dir = Path(out_dir)
    tokenizer = make_tokenizer(out_dir, config.vocab_size)
    config = copy.deepcopy(config)
    ids = {
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": None,
    }
    for key, value in ids.items():
        set_token_id(config, key, value, tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reinit_(model, init_std)
    for key, value in ids.items():
        setattr(model.generation_config, key, value)
    model.to(dtype).save_pretrained(out_dir, safe_serialization=True)
    _save_as_transformers_loads_it(model, out_dir, dtype)
    return out_dir


def _save_as_transformers_loads_it(saved: PreTrainedModel, out_dir: Path, dtype: torch.dtype) -> None:
    """Re-saves the checkpoint as transformers loads it when loading changes a weight, so that "the same weights"
    holds for both sides: Youtu's `_init_weights` zeroes the embedding's padding row after loading, which a
    trained checkpoint has zero anyway (padding_idx gets no gradient) but a random one does not."""
    loaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=dtype)
    before = saved.state_dict()
    if any(not torch.equal(before[k], v) for k, v in loaded.state_dict().items() if k in before):
        loaded.save_pretrained(out_dir, safe_serialization=True)


MIN_GAP = 1e-4  # a relative margin is taken only above this gap in logits: far above float32 rounding


@torch.no_grad()
def greedy_margin(
    model: torch.nn.Module,
    input_ids_list: Sequence[Sequence[int]],
    max_new_tokens: int,
    relative: bool = False,
) -> float:
    """Smallest top1-top2 logit gap over `max_new_tokens` greedy steps of every prompt; `relative`: each gap
    divided by the standard deviation of that step's logits.

    EOS does not stop the loop, so every step a consumer might run is covered.
    """
    margin = float("inf")
    for prompt in input_ids_list:
        ids = torch.tensor([list(prompt)])
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids).logits[0, -1].float()
            top = torch.topk(logits, 2)
            gap = (top.values[0] - top.values[1]).item()
            spread = logits.std().item()
            margin = min(margin, (gap / spread if spread > 0 else 0.0) if relative else gap)
            ids = torch.cat([ids, top.indices[:1].view(1, 1)], dim=1)
    return margin


def pick_seed(
    config: PretrainedConfig,
    out_dir: Path,
    prompts_ids: Sequence[Sequence[int]],
    max_new_tokens: int = 16,
    min_margin: float = 0.01,
    seeds: Iterable[int] = range(20),
) -> int:
    """First seed whose checkpoint has greedy margin >= `min_margin`; `out_dir` is left holding it.

    A model that scales its logits down (Cohere's `logit_scale`) scales rounding differences with them, so
    when no seed reaches the margin in logits, the first seed reaching it relative to the logits' spread (and at
    least MIN_GAP in logits) is taken."""
    best, relative = float("-inf"), None
    for seed in seeds:
        build_tiny_checkpoint(config, out_dir, seed=seed)
        model = AutoModelForCausalLM.from_pretrained(out_dir).eval()
        margin = greedy_margin(model, prompts_ids, max_new_tokens)
        if margin >= min_margin:
            return seed
        best = max(best, margin)
        if (
            relative is None
            and margin >= MIN_GAP
            and greedy_margin(model, prompts_ids, max_new_tokens, relative=True) >= min_margin
        ):
            relative = seed
    if relative is None:
        raise RuntimeError(f"no seed reached greedy margin {min_margin} (best {best:.4g})")
    build_tiny_checkpoint(config, out_dir, seed=relative)
    return relative
