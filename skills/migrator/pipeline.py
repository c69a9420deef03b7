"""`skill migrate`: source -> vendored + rewritten code -> rendered artifacts -> run -> baseline."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Collection
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from runtime.errors import UserError
from runtime.layers.quantization.compressed_tensors import checkpoint_scheme
from skills.atomic_write import write_text_atomic
from skills.codegen_cache import cached, config_key
from skills.migrator.codestyle import tidy
from skills.migrator.context import Finding, RewriteContext
from skills.migrator.fuse import fuse_projections
from skills.migrator.mode import decide_mode
from skills.migrator.render import RenderContext, render_artifacts
from skills.migrator.rewrite import check_rule_ids, rewrite, rewrite_configuration
from skills.migrator.rules import MIGRATE_RULES
from skills.migrator.source import resolve_source
from skills.migrator.validate import validate_model_dir
from skills.migrator.vendor import (
    VendoredSource,
    checkpoint_config,
    locate_source,
    read_config_json,
    snake_name,
)
from skills.verify.compare import Verification
from skills.verify.record import describe

DTYPES = {
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
}
EXIT_NEEDS_MULTI_CARD = 3


@dataclass
class MigrateOptions:
    source: str
    out: Path = Path("models")
    name: str | None = None
    mode: str | None = None
    kv: str = "paged"
    dtype: str = "auto"
    dispatch_prompt: str | None = None
    run: bool = True
    force: bool = False
    trust_remote_code: bool = False
    max_new_tokens: int = 32
    prompts: list[str] = field(default_factory=list)
    verify: bool = True  # compare the written directory with transformers (needs run)
    strict: bool = False  # a verification mismatch writes nothing
    disabled_rules: tuple[str, ...] = ()  # rule ids (--disable) not to apply
    fuse: bool = True  # models/ as the parallel layers at TP 1 (--no-fuse: one nn.Linear per tensor)


@dataclass
class MigrateResult:
    model_dir: Path
    model_name: str
    mode: str
    scenario: str
    status: str  # "ok" | "needs_multi_card" | "mismatch" (written, but not equal to transformers)
    files: list[str] = field(default_factory=list)
    baseline: dict | None = None
    notes: list[str] = field(default_factory=list)
    verification: Verification | None = None
    rules: dict[str, list[str]] = field(
        default_factory=dict
    )  # rewritten file -> ids of the rules that changed it

    def to_dict(self) -> dict:
        return {
            "model_dir": str(self.model_dir),
            "model_name": self.model_name,
            "mode": self.mode,
            "scenario": self.scenario,
            "status": self.status,
            "files": self.files,
            "baseline": self.baseline,
            "notes": self.notes,
            "rules": self.rules,
            "verification": self.verification.to_dict() if self.verification else None,
        }


def checkpoint_dtype(config: dict, requested: str) -> str:
    if requested != "auto":
        if requested not in DTYPES:
            raise UserError(f"--dtype {requested!r} is not one of auto, float32, bfloat16, float16.")
        return DTYPES[requested]
    return DTYPES.get(str(config.get("dtype") or config.get("torch_dtype") or "float32"), "float32")


@dataclass
class Conversion:
    files: dict[str, str]  # models/modeling_<name>.py (and configuration_<name>.py) -> code
    rules: dict[str, list[str]]  # the same paths -> ids of the rules that changed them


def convert_code(
    src: VendoredSource, name: str, kv: str, disabled: Collection[str] = (), checkpoint_config=None
) -> Conversion:
    """models/modeling_<name>.py and models/configuration_<name>.py, rewritten and tidied; with the
    checkpoint's config, branches it never takes are specialised away (MG018)."""
    check_rule_ids(disabled, MIGRATE_RULES)
    sources = {f"models/modeling_{name}.py": (src.modeling, rewrite, src.hf_package, src.config_rename)}
    if src.configuration is not None:
        package = src.config_package or src.hf_package
        sources[f"models/configuration_{name}.py"] = (src.configuration, rewrite_configuration, package, None)
    texts = {rel: path.read_text() for rel, (path, *_) in sources.items()}

    def compute() -> tuple[Conversion, list[Finding]]:
        done, findings = Conversion({}, {}), []
        for rel, (path, rules, package, config_rename) in sources.items():
            ctx = RewriteContext(
                entry_class=src.entry_class,
                config_module=f"configuration_{name}",
                config_rename=config_rename,
                hf_package=package,
                kv_layout=kv,
                checkpoint_config=checkpoint_config,
                filename=str(path),
                source=texts[rel],
            )
            done.files[rel] = tidy(rules(ctx.source, ctx, disabled=disabled), Path(rel).name)
            done.rules[rel] = ctx.applied
            findings += ctx.findings
        return done, findings

    inputs = [
        {
            rel: [str(path), texts[rel], package, rename]
            for rel, (path, _, package, rename) in sources.items()
        },
        # remote code may import its neighbours
        {p.name: p.read_text() for p in sorted(src.modeling.parent.glob("*.py"))} if src.remote_code else {},
        src.entry_class,
        kv,
        sorted(disabled),
        config_key(checkpoint_config),
    ]
    done, findings = cached(
        "migrate",
        inputs,
        compute,
        lambda v: {**asdict(v[0]), "findings": [asdict(f) for f in v[1]]},
        lambda d: (Conversion(d["files"], d["rules"]), [Finding(**f) for f in d["findings"]]),
    )
    if findings:
        listed = "; ".join(str(f) for f in findings)
        raise UserError(
            f"{src.entry_class} uses constructs the migrator cannot convert safely: {listed}. "
            "Nothing was written; extend the rules or port these parts by hand."
        )
    return done


def check_target(target: Path, force: bool) -> None:
    """Refuse a target that may not be (re)written before any conversion work is spent on it."""
    if target.exists() and not force:
        raise UserError(
            f"{target} already exists; pass --force to regenerate it (your edits there would be lost)."
        )
    nearest = next(p for p in (target.parent, *target.parent.parents) if p.exists())
    if not nearest.is_dir() or not os.access(nearest, os.W_OK | os.X_OK):
        raise UserError(
            f"cannot write to {target.parent} ({nearest} is not a writable directory); choose another -o OUT."
        )


def stage(target: Path, files: dict[str, str]) -> Path:
    """Write all files into a fresh hidden sibling of target (which check_target allowed); `swap` puts it in place
    once it is good."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        staging.chmod(0o755)
    except OSError as e:
        raise UserError(f"cannot write to {target.parent} ({e.strerror}); choose another -o OUT.") from e
    for rel, text in files.items():
        path = staging / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if rel.endswith(".sh"):
            path.chmod(0o755)
    (staging / "agentic" / "baseline").mkdir(parents=True, exist_ok=True)
    return staging


def swap(staging: Path, target: Path) -> None:
    if target.exists():
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
        staging.rename(target)
        shutil.rmtree(old)
    else:
        staging.rename(target)


def run_infer_sh(model_dir: Path, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), **(extra_env or {})}
    env.setdefault("SKILL", str(Path(sys.executable).with_name("skill")))
    return subprocess.run(
        ["bash", str(model_dir / "infer.sh")], capture_output=True, text=True, env=env, check=False
    )


def plan_render(
    opts: MigrateOptions, src: VendoredSource, checkpoint: Path, name: str, mode: str, config: dict
) -> RenderContext:
    return RenderContext(
        name=name,
        class_name="".join(p.capitalize() for p in name.split("_")),
        mode=mode,
        model_source=opts.source,
        model_path=str(checkpoint.resolve()),
        dtype=checkpoint_dtype(config, opts.dtype),
        skill_executable=str(Path(sys.executable).with_name("skill")),
        batch_size=max(1, len(opts.prompts) or 4),
        max_new_tokens=opts.max_new_tokens,
        kv_layout=opts.kv,
        prompts=list(opts.prompts),
        custom_params={"remote_code": True} if src.remote_code else {},
        trust_remote_code=opts.trust_remote_code,
    )


def verify_staged(staging: Path, name: str, opts: MigrateOptions, log) -> Verification:
    """`skill verify` on the freshly written (or, scenarios B / C, the existing) directory; the result goes
    into its metadata and README."""
    from skills.verify.record import record
    from skills.verify.verify import VerificationMismatch, verify

    result = verify(
        staging,
        staging / "config" / f"{name}.yaml",
        opts.prompts or None,
        trust_remote_code=opts.trust_remote_code,
        log=log,
    )
    log(describe(result))
    if result.status == "mismatch" and opts.strict:
        raise VerificationMismatch(f"{describe(result)} Nothing was written (--strict).")
    record(staging, result)
    return result


def migrate(opts: MigrateOptions, log=lambda msg: None) -> MigrateResult:
    if opts.kv not in ("paged", "legacy"):
        raise UserError(f"--kv {opts.kv!r} is not one of paged, legacy.")
    resolved = resolve_source(opts.source)
    src = locate_source(resolved.path)
    config = read_config_json(resolved.path)
    # a quantized checkpoint the runtime cannot read is refused before anything is converted
    checkpoint_scheme(config.get("quantization_config"), str(resolved.path / "config.json"))
    name = opts.name or snake_name(src.model_type)
    model_dir = opts.out / name
    mode, why = decide_mode(opts.mode, opts.dispatch_prompt, opts.out, name)
    log(f"{src.entry_class} from {resolved.source}: {mode} mode ({why})")
    if model_dir.exists() and not opts.force and opts.run and (model_dir / "infer.sh").exists():
        from skills.migrator.doctor import baseline_or_doctor

        result = baseline_or_doctor(model_dir, name, mode, resolved.source, log)
        if opts.verify:  # the user may have edited the code since it was written: check it again
            result.verification = verify_staged(model_dir, name, opts, log)
            if result.verification.status == "mismatch":
                result.status = "mismatch"
        return result
    check_target(model_dir, opts.force)
    render_ctx = plan_render(opts, src, resolved.path, name, mode, config)
    hf_config = checkpoint_config(resolved.path, src.remote_code, opts.trust_remote_code)
    converted = convert_code(src, name, opts.kv, opts.disabled_rules, hf_config)
    notes = []
    if opts.fuse:
        fusion = fuse_projections(converted.files, converted.rules, src.entry_class)
        converted = Conversion(fusion.files, fusion.rules)
        render_ctx = replace(render_ctx, fused=fusion.fused)
        notes.append(fusion.note)
        log(fusion.note)
    log(
        "rules applied: "
        + "; ".join(f"{Path(rel).name}: {' '.join(ids)}" for rel, ids in converted.rules.items())
    )
    files = {**converted.files, **render_artifacts(render_ctx)}
    staging = stage(model_dir, files)
    try:
        attention, experts = validate_model_dir(staging, staging / "config" / f"{name}.yaml")
        log(f"converted {src.entry_class}: code imports, builds and takes every checkpoint weight")
        render_ctx = replace(render_ctx, attention=attention, experts=experts)
        write_text_atomic(staging / "README.md", render_artifacts(render_ctx)["README.md"])
        outcome = {}
        if opts.run:
            from skills.migrator.doctor import collect_run

            outcome = collect_run(staging, name, render_ctx, resolved.source, log)
        if opts.run and opts.verify and outcome["status"] == "ok":
            outcome["verification"] = verify_staged(staging, name, opts, log)
            if outcome["verification"].status == "mismatch":
                outcome["status"] = "mismatch"
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    swap(staging, model_dir)
    log(f"wrote {model_dir}")
    written = sorted(str(p.relative_to(model_dir)) for p in model_dir.rglob("*") if p.is_file())
    notes += outcome.pop("notes", [])
    return replace(
        MigrateResult(model_dir, name, mode, "A", "ok", written, notes=notes, rules=converted.rules),
        **outcome,
    )


def dump(result: MigrateResult) -> str:
    return json.dumps(result.to_dict(), ensure_ascii=False)
