"""The `skill` command line."""

import dataclasses
import functools
import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from runtime.errors import UserError
from runtime.launch import NodeLayout

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Port Hugging Face causal LMs to the runtime contract, parallelize and run them.",
)
err = Console(stderr=True)


@app.callback()
def _group():
    """Port Hugging Face causal LMs to the runtime contract, parallelize and run them."""


def user_errors(fn):
    """Print a UserError as one paragraph (no traceback) and exit with its code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None

    return wrapper


def find_yaml(model_dir: Path, yaml_file: Path | None) -> Path:
    if yaml_file is not None:
        return yaml_file
    if not model_dir.is_dir():
        raise UserError(
            f"model directory {model_dir} does not exist; pass the directory `skill migrate` wrote."
        )
    candidates = sorted((model_dir / "config").glob("*.yaml"))
    preferred = model_dir / "config" / f"{model_dir.name}.yaml"
    if preferred in candidates:
        return preferred
    if len(candidates) == 1:
        return candidates[0]
    raise UserError(
        f"cannot tell which YAML of {model_dir / 'config'} to use (found "
        f"{[c.name for c in candidates] or 'none'}); pass --yaml FILE."
    )


NNodes = Annotated[int, typer.Option(min=1, help="Nodes of the world (torchrun --nnodes); 1 = this machine.")]
NodeRank = Annotated[int, typer.Option(min=0, help="This node's index, 0 = the master node.")]
MasterAddr = Annotated[str, typer.Option(help="The master node's address (torchrun rendezvous).")]
MasterPort = Annotated[
    int | None,
    typer.Option(help="The rendezvous port (default: a free one on one node, 29500 across nodes)."),
]


def _rule_list(rules):
    """An eager --list-rules flag: the rules' ids and descriptions, in the order they are applied."""

    def show(value: bool) -> None:
        if value:
            for rule in rules():
                print(f"{rule.ID}  {rule.__name__:<22} {rule.DESCRIPTION}")
            raise typer.Exit()

    return typer.Option(
        "--list-rules", is_eager=True, callback=show, help="Print the rewrite rules and exit."
    )


def _migrate_rules():
    from skills.migrator.rules import MIGRATE_RULES

    return MIGRATE_RULES


def _parallel_rules():
    from skills.parallel_impl.rules import PARALLEL_RULES

    return PARALLEL_RULES


Disable = Annotated[
    list[str] | None,
    typer.Option("--disable", metavar="ID", help="Skip a rewrite rule (repeatable; see --list-rules)."),
]


def relaunch_per_rank(world_size: int, nodes: NodeLayout) -> int:
    """The same `skill` command line once per local rank (this node's share of the world)."""
    from runtime.launch import launch_ranks

    nodes.check(world_size)
    # every migrated model imports transformers' modeling utilities (~2.5 s); forked ranks share one import
    return launch_ranks(
        world_size, "skills.cli", sys.argv[1:], nodes, preload=("transformers.modeling_utils",)
    )


@app.command()
@user_errors
def run(
    model_dir: Annotated[Path, typer.Argument(help="Model directory (models/ + config/).")],
    yaml_file: Annotated[
        Path | None, typer.Option("--yaml", help="YAML to run (default: config/<dir>.yaml).")
    ] = None,
    prompt: Annotated[
        list[str] | None, typer.Option("--prompt", help="A prompt; repeat for several.")
    ] = None,
    prompts_file: Annotated[Path | None, typer.Option(help="JSON list of prompts, or one per line.")] = None,
    max_new_tokens: Annotated[
        int | None, typer.Option(min=1, help="Override scheduler_config.max_new_tokens.")
    ] = None,
    raw: Annotated[
        bool, typer.Option("--raw", help="Feed prompts as plain text, without the chat template.")
    ] = False,
    logprobs: Annotated[
        int | None,
        typer.Option(min=0, help="With --json: each token's log-probability and the N most likely tokens."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
    trust_remote_code: Annotated[
        bool, typer.Option(help="Allow running model code that came from the checkpoint.")
    ] = False,
    nnodes: NNodes = 1,
    node_rank: NodeRank = 0,
    master_addr: MasterAddr = "127.0.0.1",
    master_port: MasterPort = None,
):
    """Run offline inference on a model directory."""
    from runtime.config import InferenceConfig
    from runtime.offline import OfflineInference, prompts_from_config, read_prompts_file

    config = InferenceConfig.from_yaml(find_yaml(model_dir, yaml_file))
    nodes = NodeLayout.of(nnodes, node_rank, master_addr, master_port)
    if (config.world_size > 1 or nnodes > 1) and "WORLD_SIZE" not in os.environ:
        raise typer.Exit(relaunch_per_rank(config.world_size, nodes))
    if max_new_tokens is not None:
        config.scheduler_config.max_new_tokens = max_new_tokens
    if trust_remote_code:
        config.model_config.trust_remote_code = True
    prompts = list(prompt or []) + (read_prompts_file(prompts_file) if prompts_file else [])
    prompts = prompts or prompts_from_config(config)
    from runtime.distributed import destroy_distributed, leave_worker

    llm = OfflineInference(config, model_dir)
    sampling = dataclasses.replace(llm.default_sampling(), logprobs=logprobs)
    results = llm.generate(prompts, sampling, chat=not raw)
    param_bytes = llm.param_bytes_per_rank()
    # Only after success: a rank that failed must not wait in a barrier while its peers sit in another
    # collective; it exits and the launcher stops the others.
    destroy_distributed()
    if llm.dist.rank == 0 and as_json:
        print(
            json.dumps(
                {
                    "outputs": [r.to_dict() for r in results],
                    "prefill_ms": llm.prefill_avg_ms,
                    "decode_avg_ms": llm.decode_avg_ms,
                    "param_bytes_per_rank": param_bytes,
                    "kv_cache": llm.engine.kv.stats(),
                },
                ensure_ascii=False,
            )
        )
    elif llm.dist.rank == 0:
        for r in results:
            err.print(f"[bold]> {escape(r.prompt)}[/]", highlight=False)
            sys.stdout.write(r.text + "\n")
    leave_worker()


@app.command()
@user_errors
def serve(
    model_dir: Annotated[
        Path | None, typer.Argument(help="Model directory (not for --pd-role router).")
    ] = None,
    yaml_file: Annotated[
        Path | None, typer.Option("--yaml", help="YAML to run (default: config/<dir>.yaml).")
    ] = None,
    host: Annotated[
        str, typer.Option(help="Address to listen on (loopback unless told otherwise).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    api_key: Annotated[
        str | None, typer.Option(envvar="SKILL_API_KEY", help="Require `Authorization: Bearer KEY` on /v1.")
    ] = None,
    max_model_len: Annotated[
        int | None,
        typer.Option(
            min=2, help="Prompt + output tokens per request (default: input_truncated_len + max_new_tokens)."
        ),
    ] = None,
    max_queue: Annotated[
        int, typer.Option(min=0, help="Requests that may wait beyond the running batch; more get HTTP 429.")
    ] = 256,
    served_model_name: Annotated[
        str | None,
        typer.Option(help="Model id clients send (default: model_name; `default` is accepted too)."),
    ] = None,
    grace_period: Annotated[
        float, typer.Option(min=0, help="Seconds in-flight requests get after SIGTERM.")
    ] = 30.0,
    pd_role: Annotated[
        str, typer.Option(help="none, or prefill / decode / router for prefill-decode disaggregation.")
    ] = "none",
    bootstrap_host: Annotated[
        str, typer.Option(help="PD: the prefill leader's bootstrap address.")
    ] = "127.0.0.1",
    bootstrap_port: Annotated[int, typer.Option(help="PD: the prefill leader's bootstrap port.")] = 18800,
    local_ip: Annotated[str, typer.Option(help="PD: this node's address for KV transfer.")] = "127.0.0.1",
    engine_backend: Annotated[str, typer.Option(help="PD: KV transfer engine (bundled: zmq).")] = "zmq",
    kv_timeout: Annotated[
        float, typer.Option(min=0.1, help="PD: seconds a request waits for its KV.")
    ] = 30.0,
    prefill: Annotated[
        list[str] | None, typer.Option(help="PD router: a prefill instance URL; repeat.")
    ] = None,
    decode: Annotated[
        list[str] | None, typer.Option(help="PD router: a decode instance URL; repeat.")
    ] = None,
    nnodes: NNodes = 1,
    node_rank: NodeRank = 0,
    master_addr: MasterAddr = "127.0.0.1",
    master_port: MasterPort = None,
):
    """Serve a model directory over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)."""
    from runtime.config import DisaggConfig
    from runtime.online.router import RouterSettings, run_router
    from runtime.online.server import ServeSettings, run_server

    roles = ("none", "prefill", "decode", "router")
    if pd_role not in roles:
        raise UserError(f"--pd-role {pd_role!r} is not one of {', '.join(roles)}")
    if pd_role == "router":
        if not prefill or not decode:
            raise UserError("--pd-role router needs at least one --prefill URL and one --decode URL")
        return run_router(
            RouterSettings([u.rstrip("/") for u in prefill], [u.rstrip("/") for u in decode], host, port)
        )
    if model_dir is None:
        raise UserError("pass the model directory to serve (MODEL_DIR)")
    disagg = DisaggConfig(
        disaggregation_mode="NONE" if pd_role == "none" else pd_role.upper(),
        bootstrap_host=bootstrap_host,
        bootstrap_port=bootstrap_port,
        local_ip=local_ip,
        engine_backend=engine_backend,
        kv_timeout_s=kv_timeout,
    )
    settings = ServeSettings(
        host=host,
        port=port,
        api_key=api_key,
        max_model_len=max_model_len,
        max_queue=max_queue,
        served_model_name=served_model_name,
        grace_s=grace_period,
        pd_role=pd_role,
        disagg=disagg,
        nodes=NodeLayout.of(nnodes, node_rank, master_addr, master_port),
    )
    run_server(model_dir, find_yaml(model_dir, yaml_file), settings)


@app.command()
@user_errors
def bench(
    model_dir: Annotated[Path, typer.Argument(help="Model directory (models/ + config/).")],
    yaml_file: Annotated[
        Path | None, typer.Option("--yaml", help="YAML to run (default: config/<dir>.yaml).")
    ] = None,
    workload: Annotated[str, typer.Option(help="decode1 | mixed64 | prefill | all.")] = "all",
    dtype: Annotated[str, typer.Option(help="bfloat16 | float32 | float16.")] = "bfloat16",
    exe_mode: Annotated[str | None, typer.Option(help="eager | compile (default: the YAML's).")] = None,
    threads: Annotated[
        int | None, typer.Option(min=1, help="Torch threads for every engine (default: all cores).")
    ] = None,
    compare: Annotated[
        str, typer.Option(help="transformers | none: the peer timed in the same run.")
    ] = "none",
    serve: Annotated[
        bool,
        typer.Option(
            "--serve",
            help="Also time `skill serve` over HTTP (streamed requests, all at once) on each workload.",
        ),
    ] = False,
    repeats: Annotated[
        int, typer.Option(min=1, help="Timed runs per engine and workload; the median is reported.")
    ] = 3,
    quick: Annotated[
        bool, typer.Option("--quick", help="Tiny sizes: checks the bench, measures nothing.")
    ] = False,
    quant_method: Annotated[
        str | None,
        typer.Option(
            help="Also time the runtime with this model_config.quant_method (int8_weight_only, w8a8_dynamic, fp8), "
            "against the unquantized runtime of the same run."
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the report as one JSON object on stdout.")
    ] = False,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of tokens/s per workload.")] = None,
):
    """Time the runtime (and transformers) on fixed workloads; table on stderr, JSON on stdout."""
    from runtime.layers.quantization.online import ONLINE_METHODS
    from skills.bench.report import plot as write_plot
    from skills.bench.report import print_table
    from skills.bench.run import BenchOptions, run_bench
    from skills.bench.workloads import WORKLOADS

    names = list(WORKLOADS) if workload == "all" else [workload]
    if any(n not in WORKLOADS for n in names):
        raise UserError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)} or all.")
    if compare not in ("transformers", "none"):
        raise UserError(f"--compare {compare!r}: the only peer is 'transformers' (or 'none').")
    if dtype not in ("bfloat16", "float32", "float16"):
        raise UserError(f"--dtype {dtype!r}: choose bfloat16, float32 or float16.")
    if plot is not None and plot.suffix.lower() != ".png":
        raise UserError(f"--plot {plot}: the plot is a PNG; give a path ending in .png.")
    if exe_mode not in (None, "eager", "compile"):
        raise UserError(f"--exe-mode {exe_mode!r}: choose eager or compile.")
    if quant_method is not None and quant_method not in ONLINE_METHODS:
        raise UserError(f"--quant-method {quant_method!r}: choose {', '.join(ONLINE_METHODS)}.")
    opts = BenchOptions(
        model_dir,
        find_yaml(model_dir, yaml_file),
        names,
        dtype,
        threads or os.cpu_count() or 1,
        compare == "transformers",
        exe_mode,
        serve,
        repeats,
        quick,
        quant_method=quant_method,
        log=lambda msg: err.print(f"[cyan]bench[/] {escape(msg)}", highlight=False),
    )
    report = run_bench(opts)
    print_table(report, err)
    if plot is not None:
        write_plot(report, plot)
        err.print(f"[cyan]bench[/] plot written to {escape(str(plot))}", highlight=False)
    if as_json:
        print(json.dumps(report))


@app.command()
@user_errors
def migrate(
    source: Annotated[
        str, typer.Argument(help="Local checkpoint dir, https://huggingface.co/ORG/REPO or ORG/REPO.")
    ],
    out: Annotated[Path, typer.Option("-o", "--out", help="Parent directory of the model directory.")] = Path(
        "models"
    ),
    name: Annotated[str | None, typer.Option(help="Model name (default: from model_type).")] = None,
    mode: Annotated[
        str | None, typer.Option(help="framework | standalone (default: decided as seed 004 says).")
    ] = None,
    kv: Annotated[str, typer.Option(help="paged | legacy KV cache path.")] = "paged",
    dtype: Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16.")] = "auto",
    dispatch_prompt: Annotated[
        str | None, typer.Option(help="File (or - for stdin) with an orchestrator's dispatch prompt.")
    ] = None,
    no_run: Annotated[
        bool, typer.Option("--no-run", help="Write the model directory without running it.")
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="Regenerate an existing model directory.")] = False,
    trust_remote_code: Annotated[
        bool, typer.Option(help="Allow running code that came from the checkpoint.")
    ] = False,
    prompt: Annotated[
        list[str] | None,
        typer.Option("--prompt", help="Prompt(s) for the baseline run and the verification."),
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 32,
    no_verify: Annotated[
        bool, typer.Option("--no-verify", help="Skip the comparison with transformers.")
    ] = False,
    strict: Annotated[
        bool, typer.Option("--strict", help="Write nothing when the verification finds a mismatch.")
    ] = False,
    disable: Disable = None,
    no_fuse: Annotated[
        bool,
        typer.Option(
            "--no-fuse",
            help="Keep one nn.Linear per checkpoint tensor instead of the runtime's parallel layers with q/k/v "
            "and gate/up fused.",
        ),
    ] = False,
    list_rules: Annotated[bool, _rule_list(_migrate_rules)] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
):
    """Port a Hugging Face causal LM into a runnable, baselined model directory, verified against transformers
    (exit 4 on a mismatch)."""
    from skills.migrator.mode import read_dispatch_prompt
    from skills.migrator.pipeline import EXIT_NEEDS_MULTI_CARD, MigrateOptions, dump
    from skills.migrator.pipeline import migrate as run_migration
    from skills.verify.record import describe
    from skills.verify.verify import EXIT_MISMATCH

    opts = MigrateOptions(
        source,
        out,
        name,
        mode,
        kv,
        dtype,
        read_dispatch_prompt(dispatch_prompt),
        not no_run,
        force,
        trust_remote_code,
        max_new_tokens,
        list(prompt or []),
        not no_verify,
        strict,
        tuple(disable or ()),
        not no_fuse,
    )
    result = run_migration(
        opts, log=lambda msg: err.print(f"[cyan]migrate[/] {escape(msg)}", highlight=False)
    )
    if as_json:
        print(dump(result))
    else:
        _print_result(result)
    if result.status == "needs_multi_card":
        raise typer.Exit(EXIT_NEEDS_MULTI_CARD)
    if result.status == "mismatch":
        err.print(
            f"[bold red]verification failed:[/] {escape(describe(result.verification))} The directory was written "
            "for debugging; `skill verify` re-checks it.",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(EXIT_MISMATCH)


def _print_result(result) -> None:
    from skills.baseline import format_baseline_table

    err.print(
        f"[green]{escape(result.model_name)}[/] -> {escape(str(result.model_dir))} ({result.mode} mode, scenario {result.scenario}, "
        f"{result.status})",
        highlight=False,
    )
    if result.baseline:
        sys.stdout.write(result.baseline["performance"]["output_text"] + "\n")
        Console().print(format_baseline_table(result.baseline))


def _logger(command: str):
    return lambda msg: err.print(f"[cyan]{command}[/] {escape(msg)}", highlight=False)


def _verify_and_record(model_dir: Path, yaml_file: Path, log, **options):
    """skill verify's comparison, written into the directory's metadata and README, and said on stderr."""
    from skills.verify.record import describe, record
    from skills.verify.verify import verify as run_verify

    result = run_verify(model_dir, yaml_file, log=log, **options)
    record(model_dir, result)
    err.print(escape(describe(result)), highlight=False, soft_wrap=True)
    return result


@app.command()
@user_errors
def verify(
    model_dir: Annotated[Path, typer.Argument(help="A model directory (migrated or parallelized).")],
    yaml_file: Annotated[
        Path | None, typer.Option("--yaml", help="YAML to run (default: config/<dir>.yaml).")
    ] = None,
    prompts_file: Annotated[
        Path | None, typer.Option(help="JSON list of prompts, or one per line (default: a fixed set).")
    ] = None,
    tokens: Annotated[int, typer.Option(min=1, help="Greedy tokens compared per prompt.")] = 16,
    dtype: Annotated[
        str, typer.Option(help="float32 | bfloat16 | float16 | float64, for both sides.")
    ] = "float32",
    trust_remote_code: Annotated[
        bool, typer.Option(help="Allow running model code that came from the checkpoint.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
):
    """Compare a model directory's greedy run with transformers on the same weights and record the result
    (exit 0 identical, 4 mismatch, 1 when it cannot be checked here)."""
    from runtime.offline import read_prompts_file
    from skills.verify.verify import EXIT_MISMATCH

    prompts = read_prompts_file(prompts_file) if prompts_file else None
    result = _verify_and_record(
        model_dir,
        find_yaml(model_dir, yaml_file),
        _logger("verify"),
        prompts=prompts,
        tokens=tokens,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
    )
    if as_json:
        print(json.dumps(result.to_dict(), ensure_ascii=False))
    if result.status == "mismatch":
        raise typer.Exit(EXIT_MISMATCH)
    if result.status == "skipped":
        raise typer.Exit(1)


@app.command()
@user_errors
def baseline(
    log_file: Annotated[Path, typer.Option(help="A run's log file, or a directory of log_<rank>.log files.")],
    output: Annotated[Path, typer.Option(help="baseline_metadata.json to write.")],
    yaml_file: Annotated[Path, typer.Option(help="The YAML the run used.")],
    rank: Annotated[int | None, typer.Option(help="Rank whose log to read (default: 0).")] = None,
    model_source: Annotated[str, typer.Option(help="HF id / URL / local path the model came from.")] = "",
):
    """Collect baseline_metadata.json from a run's logs."""
    from skills.baseline import collect_baseline, format_baseline_table

    Console().print(format_baseline_table(collect_baseline(log_file, output, yaml_file, rank, model_source)))


@app.command()
@user_errors
def parallelize(
    model_dir: Annotated[Path, typer.Argument(help="A model directory written by `skill migrate`.")],
    config: Annotated[
        Path, typer.Option("--config", help="PARALLEL.yaml: a parallel_config block (or bare keys).")
    ],
    mode: Annotated[
        str | None, typer.Option(help="framework | standalone; must match how the model was migrated.")
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Overwrite files changed since they were generated.")
    ] = False,
    plan: Annotated[
        bool, typer.Option("--plan", help="Only print the groups, rewrites and per-rank memory.")
    ] = False,
    no_verify: Annotated[
        bool, typer.Option("--no-verify", help="Skip comparing the multi-rank run with transformers.")
    ] = False,
    disable: Disable = None,
    list_rules: Annotated[bool, _rule_list(_parallel_rules)] = False,
    replicate_attention: Annotated[
        bool,
        typer.Option(
            "--replicate-attention",
            help="Run attention the rules cannot shard by heads whole on every rank (its weights and KV cache "
            "unsplit) instead of refusing the model.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
):
    """Shard a migrated model over ranks: validate the config, rewrite to parallel layers, write its YAML, and
    verify the multi-rank run against transformers (exit 4 on a mismatch)."""
    from skills.parallel_impl.pipeline import parallelize as run_parallelize
    from skills.parallel_impl.pipeline import plan_for_model_dir
    from skills.parallel_impl.plan import format_plan

    if plan:
        result = plan_for_model_dir(model_dir, config, disable or (), replicate_attention)
        if as_json:
            print(json.dumps({"model_dir": str(model_dir.resolve()), **result.to_dict()}))
        else:
            Console().print(format_plan(result))
        return
    from skills.verify.verify import EXIT_MISMATCH

    done = run_parallelize(
        model_dir, config, mode, force, _logger("parallelize"), disable or (), replicate_attention
    )
    verification = None if no_verify else _verify_and_record(model_dir, Path(done.yaml), _logger("verify"))
    if as_json:
        print(json.dumps({**done.to_dict(), "verification": verification and verification.to_dict()}))
    else:
        for step in done.rewrites:
            err.print(f"  - {escape(step)}", highlight=False)
        err.print(
            f"[green]wrote[/] {escape(', '.join(done.written))}; run: skill run {escape(str(done.model_dir))} "
            f"--yaml {escape(str(done.yaml))}",
            highlight=False,
        )
    if verification is not None and verification.status == "mismatch":
        raise typer.Exit(EXIT_MISMATCH)


@app.command("convert-weights")
@user_errors
def convert_weights(
    model_dir: Annotated[Path, typer.Argument(help="A model directory `skill parallelize` rewrote.")],
    config: Annotated[Path, typer.Option("--config", help="PARALLEL.yaml: the config to shard for.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Directory to write (rank_<r>/ + config files).")],
    force: Annotated[bool, typer.Option("--force", help="Replace OUT and the offline YAML.")] = False,
    quant_mode: Annotated[
        str | None,
        typer.Option(
            help="Save quantized weights, one scale per output channel: w8a16 (int8; quant_method "
            "int8_weight_only), w8a8 (int8, activations quantized per token; w8a8_dynamic) or fp8 (e4m3, "
            "activations too; fp8)."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
):
    """Save each rank's weight shards for a parallel config, and the YAML that runs them (prints its path)."""
    from skills.parallel_impl.convert_weights import convert_weights as run_convert

    done = run_convert(
        model_dir,
        config,
        out,
        force,
        log=lambda msg: err.print(f"[cyan]convert-weights[/] {escape(msg)}", highlight=False),
        quant_mode=quant_mode,
    )
    print(json.dumps(done.to_dict()) if as_json else done.yaml)


def main():
    from runtime.logging_config import setup_logging

    setup_logging()
    app()


if __name__ == "__main__":
    main()
