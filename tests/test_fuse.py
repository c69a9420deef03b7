"""`skill migrate` writes the parallel layers at TP 1 (q/k/v and gate/up fused) and keeps the per-tensor code in
agentic/migrated_models/; models with nothing to fuse, or that the parallel rules refuse, keep their code."""

import snapshots

from skills.migrator.codestyle import tidy
from skills.migrator.fuse import fuse_projections
from skills.parallel_impl.rewrite import rewrite_sources


def fuse(model_type: str):
    converted = snapshots.converted(model_type, "paged")
    return converted, fuse_projections(
        converted.files, converted.rules, snapshots.source(model_type).entry_class
    )


def test_llama_gets_fused_projections_and_keeps_the_per_tensor_code():
    converted, fusion = fuse("llama")
    modeling = "models/modeling_llama.py"
    assert fusion.fused == ["qkv_proj (q_proj, k_proj, v_proj)", "gate_up_proj (gate_proj, up_proj)"]
    assert fusion.files["agentic/migrated_models/modeling_llama.py"] == converted.files[modeling]
    assert fusion.files["models/configuration_llama.py"] == converted.files["models/configuration_llama.py"]
    code = fusion.files[modeling]
    assert "QKVParallelLinear(" in code and "MergedColumnParallelLinear(" in code and "nn.Linear(" not in code
    assert fusion.rules[modeling][: len(converted.rules[modeling])] == converted.rules[modeling]
    assert {"PR001", "PR002", "PR006"} <= set(fusion.rules[modeling])


def test_the_fused_code_is_a_fixed_point():
    _, fusion = fuse("llama")
    name = "modeling_llama.py"
    again = rewrite_sources({name: fusion.files[f"models/{name}"]}, "LlamaForCausalLM")
    assert again.files[name] == fusion.files[f"models/{name}"] and not again.fused and not again.findings


def test_projections_fused_on_disk_are_left_alone():
    converted, fusion = fuse("phi3")
    assert fusion.files == converted.files and fusion.rules == converted.rules and not fusion.fused
    assert "no projections to fuse" in fusion.note


def test_attention_the_parallel_rules_refuse_keeps_its_code_with_the_reason():
    converted, fusion = fuse("jetmoe")  # keys tiled over the query heads
    assert fusion.files == converted.files and not fusion.fused
    assert fusion.note.startswith("kept one linear layer per checkpoint tensor: attention cannot be sharded")


def test_generated_imports_do_not_depend_on_the_working_directory(tmp_path, monkeypatch):
    use = "\nprint(torch, nn, join_prefix)\n"
    code = "import torch\nfrom runtime.layers.prefix import join_prefix\nfrom torch import nn\n" + use
    sorted_imports = (
        "import torch\nfrom torch import nn\n\nfrom runtime.layers.prefix import join_prefix\n" + use
    )
    here = tidy(code, "modeling_x.py")
    monkeypatch.chdir(tmp_path)
    assert here == tidy(code, "modeling_x.py") == sorted_imports
