"""Orchestrates `skill bench`: per workload, one process per engine, runs alternated, medians reported."""

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from skills.bench.machine import describe, read_bandwidth_gb_s
from skills.bench.workers import Worker
from skills.bench.workloads import Workload, make_workload

SPOT_CHECK_REQUESTS = 3


@dataclass
class BenchOptions:
    model_dir: Path
    yaml_file: Path
    workloads: list[str]
    dtype: str
    threads: int
    compare: bool
    exe_mode: str | None = None  # None: the YAML's
    serve: bool = False  # also time `skill serve` over HTTP on the same workload
    repeats: int = 3
    quick: bool = False
    quant_method: str | None = None  # also time the runtime with this model_config.quant_method
    timeout_s: float = 3600.0
    log: Callable[[str], None] = field(default=lambda msg: None)


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def _tok_s(workload: Workload, seconds: float) -> float:
    """Prompt tokens per second for `prefill`, generated tokens per second otherwise."""
    tokens = sum(workload.prompt_lens) if workload.name == "prefill" else sum(workload.output_lens)
    return tokens / seconds


def _tpot_ms(result: dict) -> float | None:
    steps = [
        (f - t) / (len(o) - 1)
        for t, f, o in zip(result["ttft_s"], result["finish_s"], result["outputs"])
        if len(o) > 1
    ]
    return 1000 * statistics.mean(steps) if steps else None


def _summary(workload: Workload, runs: list[dict]) -> dict:
    ttft = [1000 * t for r in runs for t in r["ttft_s"]]
    return {
        "tok_s": statistics.median(_tok_s(workload, r["seconds"]) for r in runs),
        "ttft_p50_ms": _percentile(ttft, 50),
        "ttft_p99_ms": _percentile(ttft, 99),
        "tpot_ms": statistics.median(t for r in runs if (t := _tpot_ms(r)) is not None)
        if workload.name != "prefill"
        else None,
    }


def _first_difference(mine: list[int], theirs: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)


def _verdict(mine: list[int], theirs: list[int], ties: list[bool] | None = None) -> str:
    first = _first_difference(mine, theirs)
    if first is None:
        return "identical"
    return f"{'tie' if ties and ties[first] else 'differs'} at step {first}"


def spot_check(ours: list[list[int]], reference: dict) -> dict:
    """Our greedy tokens against transformers' for the first requests. A request passes if the tokens are
    identical, or first differ at a step where transformers' own top two logits tie within the dtype's rounding
    (a bf16 tie: either token is a correct greedy choice, and the continuations differ from there)."""
    verdicts = [
        _verdict(mine, theirs, ties)
        for mine, theirs, ties in zip(ours, reference["outputs"], reference["ties"])
    ]
    return {
        "checked": len(verdicts),
        "identical": verdicts.count("identical"),
        "verdicts": verdicts,
        "passed": not any(v.startswith("differs") for v in verdicts),
    }


def bench_workload(opts: BenchOptions, name: str, bandwidth: float) -> dict:
    workload = make_workload(name, opts.quick)
    args = [
        str(opts.model_dir),
        str(opts.yaml_file),
        name,
        opts.dtype,
        str(opts.threads),
        opts.exe_mode or "-",
    ]
    args += ["--quick"] if opts.quick else []
    engines = {"ours": Worker("ours", args, opts.timeout_s)}
    try:
        if opts.serve:
            engines["served"] = Worker("served", args, opts.timeout_s)
        if opts.compare:
            engines["peer"] = Worker("peer", args, opts.timeout_s)
        if opts.quant_method:
            engines["quantized"] = Worker(
                "quantized", [*args, "--quant-method", opts.quant_method], opts.timeout_s
            )
        runs: dict[str, list[dict]] = {e: [] for e in engines}
        for i in range(opts.repeats):
            order = list(engines) if i % 2 == 0 else list(engines)[::-1]  # alternate so drift cancels
            for e in order:
                runs[e].append(engines[e].run())
            opts.log(f"{name}: run {i + 1}/{opts.repeats} done")
        info = engines["ours"].info
        reference = engines["peer"].reference(SPOT_CHECK_REQUESTS) if opts.compare else None
        rss = {e: w.quit()["peak_rss_mb"] for e, w in engines.items()}
    finally:
        for w in engines.values():
            w.close()
    ours = _summary(workload, runs["ours"])
    peer = _summary(workload, runs["peer"]) if opts.compare else None
    out = {
        "ours_tok_s": ours["tok_s"],
        "peer_tok_s": peer and peer["tok_s"],
        "ratio": peer and ours["tok_s"] / peer["tok_s"],
        "mbu": None,
        "bandwidth_limit_tok_s": None,
        "achieved_gb_s": None,
        "ttft_p50_ms": ours["ttft_p50_ms"],
        "ttft_p99_ms": ours["ttft_p99_ms"],
        "peer_ttft_p50_ms": peer and peer["ttft_p50_ms"],
        "peer_ttft_p99_ms": peer and peer["ttft_p99_ms"],
        "tpot_ms": {"ours": ours["tpot_ms"], "peer": peer and peer["tpot_ms"]},
        "peak_rss_mb": {"ours": rss["ours"], "peer": rss.get("peer")},
        "spot_check": None,
        "served": None,
        "quantized": None,
        "ours_linears": info["linears"],  # the path swap_host_linears took (some are timed per process)
    }
    if opts.serve:
        served = _summary(workload, runs["served"])
        out["served"] = {
            **served,
            "vs_ours": served["tok_s"] / ours["tok_s"],
            "peak_rss_mb": rss["served"],
            "outputs_match_ours": all(r["outputs"] == runs["ours"][0]["outputs"] for r in runs["served"]),
        }
    if opts.quant_method:
        quantized = _summary(workload, runs["quantized"])
        out["quantized"] = {
            **quantized,
            "method": opts.quant_method,
            "vs_ours": quantized["tok_s"] / ours["tok_s"],
            "weight_bytes": engines["quantized"].info["weight_bytes"],
            "peak_rss_mb": rss["quantized"],
            "spot_check_vs_ours": [
                _verdict(q, o) for q, o in zip(runs["quantized"][0]["outputs"], runs["ours"][0]["outputs"])
            ][:SPOT_CHECK_REQUESTS],
        }
    if name == "decode1":  # batch 1: every step reads all weights plus the context's KV
        context = workload.prompt_lens[0] + workload.output_lens[0] / 2
        step_bytes = info["weight_bytes"] + info["kv_bytes_per_token"] * context
        out["achieved_gb_s"] = step_bytes * ours["tok_s"] / 1e9
        out["mbu"] = out["achieved_gb_s"] / bandwidth
        out["bandwidth_limit_tok_s"] = bandwidth * 1e9 / step_bytes
    if reference is not None:
        out["spot_check"] = spot_check(runs["ours"][0]["outputs"], reference)
    return out


def run_bench(opts: BenchOptions) -> dict:
    opts.log(f"measuring read bandwidth ({opts.threads} threads)")
    bandwidth = read_bandwidth_gb_s(opts.threads)
    workloads = {}
    for name in opts.workloads:
        opts.log(f"{name}: starting")
        workloads[name] = bench_workload(opts, name, bandwidth)
    return {
        "machine": describe(opts.threads),
        "model_dir": str(opts.model_dir),
        "dtype": opts.dtype,
        "exe_mode": opts.exe_mode or "from the YAML",
        "quick": opts.quick,
        "repeats": opts.repeats,
        "bandwidth_gb_s": bandwidth,
        "workloads": workloads,
    }
