"""The bench's rich table (stderr) and its plot."""

from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text


def _f(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _served(s: dict | None) -> str:
    if s is None:
        return "-"
    same = "" if s["outputs_match_ours"] else ", OUTPUTS DIFFER"
    return f"{s['tok_s']:.1f} ({s['vs_ours']:.2f}x{same}), {s['ttft_p99_ms']:.0f}"


def _quantized(q: dict | None) -> str:
    if q is None:
        return "-"
    same = ", ".join(q["spot_check_vs_ours"])
    return f"{q['tok_s']:.1f} ({q['vs_ours']:.2f}x; {same})"


def _where(machine: dict) -> str:
    device = machine.get("device", "cpu")
    host = f"{machine['threads']} threads, {machine['cpu']}"
    return host if device == "cpu" else f"{device} (host: {host})"


def print_table(report: dict, console: Console) -> None:
    m = report["machine"]
    table = Table(
        title=Text(
            f"skill bench: {report['model_dir']} ({report['dtype']}, {_where(m)}, "
            f"read bandwidth {report['bandwidth_gb_s']:.1f} GB/s)"
        )
    )
    for col in (
        "workload",
        "ours tok/s",
        "peer tok/s",
        "ratio",
        "MBU",
        "TTFT p50/p99 ms (ours)",
        "TTFT p99 ms (peer)",
        "TPOT ms ours/peer",
        "peak RSS MB ours/peer",
        "greedy spot check",
        "served tok/s (vs ours), TTFT p99 ms",
        "quantized tok/s (vs ours; greedy vs ours)",
    ):
        table.add_column(col, justify="left" if col == "workload" else "right")
    for name, w in report["workloads"].items():
        spot = w["spot_check"]
        table.add_row(
            name,
            _f(w["ours_tok_s"]),
            _f(w["peer_tok_s"]),
            _f(w["ratio"], ".2f") + ("x" if w["ratio"] else ""),
            _f(w["mbu"] and 100 * w["mbu"], ".0f") + ("%" if w["mbu"] else ""),
            f"{_f(w['ttft_p50_ms'], '.0f')} / {_f(w['ttft_p99_ms'], '.0f')}",
            _f(w["peer_ttft_p99_ms"], ".0f"),
            f"{_f(w['tpot_ms']['ours'])} / {_f(w['tpot_ms']['peer'])}",
            f"{_f(w['peak_rss_mb']['ours'], '.0f')} / {_f(w['peak_rss_mb']['peer'], '.0f')}",
            "-"
            if spot is None
            else f"{spot['identical']}/{spot['checked']} identical"
            + ("" if spot["passed"] else " (FAILED)")
            + "".join(f"; {v}" for v in spot["verdicts"] if v != "identical"),
            _served(w["served"]),
            _quantized(w["quantized"]),
        )
    console.print(table)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        w = report["workloads"][name]
        bars = [("ours", w["ours_tok_s"], "tab:blue")]
        if w.get("served"):
            bars.append(("served (HTTP)", w["served"]["tok_s"], "tab:cyan"))
        if w.get("quantized"):
            bars.append((w["quantized"]["method"], w["quantized"]["tok_s"], "tab:green"))
        if w["peer_tok_s"] is not None:
            bars.append(("transformers", w["peer_tok_s"], "tab:gray"))
        bars = ax.bar(*zip(*[(label, value) for label, value, _ in bars]), color=[c for *_, c in bars])
        ax.bar_label(bars, fmt="%.1f")
        if w["bandwidth_limit_tok_s"]:
            ax.axhline(
                w["bandwidth_limit_tok_s"],
                color="tab:red",
                linestyle="--",
                label=f"bandwidth limit {w['bandwidth_limit_tok_s']:.0f} tok/s",
            )
            ax.legend(loc="lower right")
        unit = "prompt tok/s" if name == "prefill" else "output tok/s"
        title = name + (f" ({w['ratio']:.2f}x)" if w["ratio"] else "")
        ax.set(title=title, ylabel=unit)
    m = report["machine"]
    fig.suptitle(f"{Path(report['model_dir']).name}, {report['dtype']}, {_where(m)}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
