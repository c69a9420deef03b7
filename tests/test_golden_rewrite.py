"""Golden rewrites: the installed transformers' real modeling + configuration files of several
architectures go through `convert_code` (every rule, then ruff) and come out as clean, self-contained,
importable runtime code, for both KV layouts; rewriting the result again changes nothing."""

import ast
import re
from pathlib import Path

import migrated_code
import pytest
import torch
from migrated_code import ARCHS, paths, ruff_check
from tiny_checkpoint import tiny_config

from runtime.config import InferenceConfig
from runtime.engine.registry import resolve_model
from skills.migrator.codestyle import tidy
from skills.migrator.context import RewriteContext
from skills.migrator.rewrite import rewrite, rewrite_configuration
from skills.migrator.vendor import VendoredSource, snake_name

KV = ["paged", "legacy"]
# legacy differs from paged by `legacy=True` and get_cache_info: llama's and gemma3's (sliding window) in
# `make test`, the others' with `-m slow`
LEGACY_FAST = {"llama", "gemma3_text"}
CASES = [
    pytest.param(
        mt, kv, id=f"{mt}-{kv}", marks=pytest.mark.slow if kv == "legacy" and mt not in LEGACY_FAST else ()
    )
    for mt in ARCHS
    for kv in KV
]

# HF machinery the converted code must not mention at all (word match: ModelCacheInfo is fine).
FORBIDDEN = re.compile(
    r"\b(\w*PreTrainedModel|GenerationMixin|GradientCheckpointingLayer|Cache|DynamicCache|"
    r"create_\w*mask|ALL_ATTENTION_FUNCTIONS)\b"
)
MODELING_MODULE = re.compile(r"^transformers\.models\.\w+\.modeling_\w+$")


@pytest.fixture(scope="module")
def sources() -> dict[str, VendoredSource]:
    return {model_type: migrated_code.source(model_type) for model_type in ARCHS}


@pytest.fixture(scope="module")
def converted():
    """(model_type, kv) -> convert_code's files, converted once per session."""
    return migrated_code.converted


def entry_class(code: str, name: str) -> ast.ClassDef:
    (cls,) = [s for s in ast.parse(code).body if isinstance(s, ast.ClassDef) and s.name == name]
    return cls


@pytest.mark.parametrize("model_type", ARCHS)
def test_locate_source(sources, model_type):
    src = sources[model_type]
    assert src.entry_class == ARCHS[model_type]
    assert src.modeling.is_file() and src.configuration.is_file() and not src.remote_code


@pytest.mark.parametrize("model_type,kv", CASES)
def test_converted_code_is_clean(converted, model_type, kv):
    # convert_code raises UserError listing the Findings if any rule reported one.
    files = converted(model_type, kv)
    assert sorted(files) == sorted(paths(model_type))
    for rel, code in files.items():
        compile(code, rel, "exec")
        assert not FORBIDDEN.findall(code), f"{rel} still mentions {sorted(set(FORBIDDEN.findall(code)))}"
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom):
                assert not MODELING_MODULE.match(node.module or ""), f"{rel} imports {node.module}"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    assert not re.search(r"(Model|ForCausalLM)$", alias.name), f"{rel} imports {alias.name}"
    modeling, _ = paths(model_type)
    assert ruff_check(files[modeling], Path(modeling).name) == ""


@pytest.mark.parametrize("model_type", ARCHS)
def test_configuration_passes_ruff(converted, model_type):
    _, configuration = paths(model_type)
    assert ruff_check(converted(model_type, "paged")[configuration], Path(configuration).name) == ""


@pytest.mark.parametrize("model_type,kv", CASES)
def test_entry_class_contract(converted, model_type, kv):
    modeling, _ = paths(model_type)
    code = converted(model_type, kv)[modeling]
    cls = entry_class(code, ARCHS[model_type])
    methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
    fwd = methods["forward"].args
    assert [a.arg for a in fwd.args] == ["self", "input_ids", "position_ids", "forward_metadata"]
    assert fwd.kwarg is not None and fwd.kwarg.arg == "kwargs" and not fwd.kwonlyargs and fwd.vararg is None
    assert "load_weights" in methods
    assert ("get_cache_info" in methods) == (kv == "paged")
    init = methods["__init__"].args
    assert [a.arg for a in init.args] == ["self", "config", "infer_config", "comm_manager", "prefix"]
    tree = ast.parse(code)
    assert any(
        isinstance(s, ast.Assign)
        and [ast.unparse(t) for t in s.targets] == ["EntryClass"]
        and ast.unparse(s.value) == ARCHS[model_type]
        for s in tree.body
    )
    assert ("legacy=True" in code) == (kv == "legacy")


@pytest.mark.parametrize("model_type,kv", CASES)
def test_imports_and_builds_on_a_tiny_config(converted, tmp_path, model_type, kv):
    for rel, code in converted(model_type, kv).items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(code)
    model_cls, config_cls = resolve_model(tmp_path, model_type)
    assert model_cls.__name__ == ARCHS[model_type]
    assert config_cls is not None and config_cls.model_type == model_type
    assert config_cls.__module__.startswith("_mis_configuration_")  # the vendored class, not transformers'
    ckpt = tmp_path / "ckpt"
    tiny_config(model_type).save_pretrained(ckpt)
    hf_config = config_cls.from_pretrained(ckpt)
    model = model_cls(hf_config, InferenceConfig.from_dict({}), None, prefix="")
    assert isinstance(model, torch.nn.Module)
    assert sum(p.numel() for p in model.parameters()) > 0
    assert callable(model.load_weights)
    assert hasattr(model, "get_cache_info") == (kv == "paged")


# Rewriting costs 1-2 s of CPU per file: the paged result of every architecture, plus gemma3's legacy one
# (the layouts differ only by `legacy=True` and get_cache_info, whose idempotency tests/rules cover).
IDEMPOTENCY = [pytest.param(mt, "paged", id=f"{mt}-paged") for mt in ARCHS] + [
    pytest.param("gemma3_text", "legacy", id="gemma3_text-legacy")
]


@pytest.mark.parametrize("model_type,kv", IDEMPOTENCY)
def test_rewrite_is_idempotent(converted, sources, model_type, kv):
    src = sources[model_type]
    name = snake_name(model_type)
    modeling, configuration = paths(model_type)
    files = converted(model_type, kv)
    ctx = RewriteContext(
        entry_class=src.entry_class,
        config_module=f"configuration_{name}",
        hf_package=src.hf_package,
        kv_layout=kv,
        filename=modeling,
    )
    assert tidy(rewrite(files[modeling], ctx), Path(modeling).name) == files[modeling]
    assert (
        tidy(rewrite_configuration(files[configuration], ctx), Path(configuration).name)
        == files[configuration]
    )
    assert ctx.findings == []
