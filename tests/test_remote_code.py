"""Checkpoints whose model code ships with them (`auto_map`) and that no transformers release knows: `skill
migrate` parses that code (never executes it) and converts it, and, trusted, the result matches transformers
running it, on one rank and sharded."""

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
import torch
from skill_process import skill_json
from tiny_checkpoint import greedy_margin, make_tokenizer

from skills.verify.verify import DEFAULT_PROMPTS

FIXTURES = Path(__file__).parent / "fixtures"
# model name -> what the converted code must show of the constructs its fixture is written with
CONVERTED = {
    # q/k/v in one `W_pack` linear, F.scaled_dot_product_attention called directly, a mask built by hand
    "packlm": ("self.attn = Attention(", "F.scaled_dot_product_attention(", "mask ="),
    # attention written out on keys repeated per group (the scores by einsum), a method building the mask from the
    # cache's length
    "grouplm": ("self.attn = Attention(", "repeat_kv(key_states", "_causal_mask"),
    # attention in a helper returning its last product, scaled by a 0-d tensor, masked by a causal buffer
    "qwenish": ("self.attn = Attention(", "def _attn(", "torch.tril("),
    # states [tokens, batch, hidden], key heads under a name of its own, the output layer in the inner model
    "glmish": (
        "num_kv_heads=self.num_multi_query_groups_per_partition",
        "F.scaled_dot_product_attention(",
        "kv_cache=",
    ),
    # Meta's reference Llama: config names of its own, a rotary table sliced from the cache's length, the output
    # layer applied by the inner model
    "metalm": ("num_heads=self.n_local_heads", "return self.output(", "start_pos"),
    # transformers 4.2x style: a tuple cache grown by torch.cat per layer, blocks zipped with it, tuples returned
    "tuplelm": ("self.attn = Attention(", "torch.cat((past_key", "presents"),
    # today's APIs mixed as no transformers model mixes them: soft-capped scores, sliding and full layers
    "twistlm": ("soft_cap=self.config.attn_logit_softcapping", "get_interface(", "past_key_values"),
    # nanoGPT: no cache, the trunk in an nn.ModuleDict of the entry, positions from arange, heads sized by C
    "nanolm": ("head_dim=config.n_embd // self.n_head", "nn.ModuleDict(", "torch.arange(0, t, dtype"),
    # minGPT: a persistent causal buffer, which its checkpoint holds and loading skips; the MLP through a lambda,
    # made a module class
    "minlm": ('_skipped_checkpoint_buffers = ("bias",)', "lambda x:", "torch.tril("),
    # minGPT flat: the trunk the entry's own attributes, which move into an inner model its checkpoint names
    # without the prefix
    "flatlm": ('base_model_prefix = "model"', "self.drop(", "masked_fill("),
}
# two in `make test` (the other constructs' rules have unit tests of their own), all with -m slow: ~20 s each
IN_MAKE_TEST = ("packlm", "minlm")


def _load(model: str, name: str):
    spec = importlib.util.spec_from_file_location(
        f"remote_{model}.{name}", FIXTURES / f"remote_{model}" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _checkpoint(model: str, out: Path) -> Path:
    """The fixture's code beside random weights with a clear greedy margin and an offline tokenizer."""
    configuration = _load(model, f"configuration_{model}")
    modeling = _load(model, f"modeling_{model}")
    config_cls = next(
        v for k, v in vars(configuration).items() if k.endswith("Config") and k != "PretrainedConfig"
    )
    model_cls = next(
        v
        for k, v in vars(modeling).items()
        if k.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))
    )
    config = config_cls()
    config.auto_map = {
        "AutoConfig": f"configuration_{model}.{config_cls.__name__}",
        "AutoModelForCausalLM": f"modeling_{model}.{model_cls.__name__}",
    }
    ids = [
        make_tokenizer(out, config.vocab_size)(p)["input_ids"] for p in DEFAULT_PROMPTS
    ]  # migrate verifies on them
    for seed in range(20):
        torch.manual_seed(seed)
        built = model_cls(config).eval()
        with torch.no_grad():
            for p in built.parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.3)
        if greedy_margin(built, ids, 16) >= 0.02:
            break
    built.save_pretrained(out)
    for source in (FIXTURES / f"remote_{model}").glob("*.py"):
        shutil.copy(source, out / source.name)
    return out


def _migrated(model: str, tmp_path: Path) -> Path:
    checkpoint = _checkpoint(model, tmp_path / model)
    result = skill_json(
        "migrate", checkpoint, "-o", tmp_path / "out", "--trust-remote-code", "--strict", "--json"
    )
    verification = result["verification"]
    assert verification["status"] == "identical" and verification["tokens_compared"] == 64, verification
    return Path(result["model_dir"])


@pytest.mark.parametrize(
    "model", [m if m in IN_MAKE_TEST else pytest.param(m, marks=pytest.mark.slow) for m in CONVERTED]
)
def test_remote_code_converts_and_matches_transformers_running_it(model, tmp_path):
    code = (_migrated(model, tmp_path) / "models" / f"modeling_{model}.py").read_text()
    attention, gone, leftover = CONVERTED[model]
    assert attention in code and gone not in code
    assert leftover not in code  # what only the folded mask / cache needed went with it


# model -> what `skill parallelize` must report of how it split the constructs its fixture is written with
SHARDED = {
    # `wqkv` holds whole key-head groups side by side: each rank takes a contiguous share of its rows; the MLP's
    # `w1` / `w3` / `w2` are found by what its forward does
    "grouplm": ("wqkv -> ColumnParallelLinear by heads", "GroupMLP: w1/w3 -> ColumnParallelLinear"),
    # head counts and the attention output's width under names of their own, [gate; up] halved by torch.chunk
    "glmish": (
        "SelfAttention: query_key_value -> QKVParallelLinear",
        "MLP: dense_h_to_4h -> MergedColumnParallelLinear",
    ),
    # head counts and the FFN width under names of its own, the plan's sizes read off the model, not its config
    "metalm": (
        "MetaLMAttention: wq/wk/wv -> ColumnParallelLinear by heads",
        "FeedForward: w1/w3 -> ColumnParallelLinear",
    ),
    # a biased query beside unbiased keys and values: one ColumnParallelLinear a projection, not QKVParallelLinear
    "twistlm": ("TwistAttention: q_proj/k_proj/v_proj -> ColumnParallelLinear by heads", "TwistMLP: fc1"),
    # nanoGPT: heads set after the fused projection, head size from the input width (`C // self.n_head`)
    "nanolm": ("CausalSelfAttention: c_attn -> QKVParallelLinear", "MLP: c_fc -> ColumnParallelLinear"),
    # minGPT flat: the embedding in the inner model MG037 built, the head tied to it; the lambda MLP stays whole
    "flatlm": (
        "FlatLMModel: wte -> VocabParallelEmbedding",
        "lm_head -> ParallelLMHead (lmhead_tp_group), tied",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("model", SHARDED)
def test_remote_code_shards_over_two_ranks_and_matches_transformers(model, tmp_path):
    model_dir = _migrated(model, tmp_path)
    config = tmp_path / "tp2.yaml"
    config.write_text(
        "world_size: 2\nattn_tp_size: 2\ndense_tp_size: 2\nembed_tp_size: 2\nlmhead_tp_size: 2\n"
    )
    result = skill_json("parallelize", model_dir, "--config", config, "--json")
    assert result["verification"]["status"] == "identical", result["verification"]
    rewrites = " ".join(result["rewrites"])
    assert all(r in rewrites for r in SHARDED[model]), rewrites
