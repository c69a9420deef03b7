"""`skill bench` smoke test: every workload at a tiny size on a tiny checkpoint (the bench's code, not timing)."""

import json
import subprocess
from pathlib import Path

import pytest
from model_dirs import make_model_dir
from skill_process import skill


def skill_bench(model_dir, *args: str) -> subprocess.CompletedProcess:
    return skill("bench", model_dir, *args, timeout=600)


def _cmdline(path: Path) -> str:
    try:
        return path.read_bytes().decode(errors="replace").replace("\0", " ")
    except OSError:  # the process ended meanwhile
        return ""


# decode1 alone in `make test` (it reports the most: MBU, bandwidth limit); every workload with `-m slow`
@pytest.mark.parametrize(
    "workload", ["decode1", pytest.param("all", marks=pytest.mark.slow)], ids=["decode1", "all"]
)
def test_workloads_run_and_report(workload, tmp_path, tiny_llama_dir):
    model_dir = make_model_dir(tmp_path, tiny_llama_dir)
    plot = tmp_path / "bench.png"
    proc = skill_bench(
        model_dir,
        "--workload",
        workload,
        "--quick",
        "--compare",
        "transformers",
        "--serve",
        "--repeats",
        "1",
        "--threads",
        "1",
        "--dtype",
        "float32",
        "--json",
        "--plot",
        str(plot),
        "--quant-method",
        "int8_weight_only",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["bandwidth_gb_s"] > 0 and report["machine"]["threads"] == 1
    assert set(report["workloads"]) == (
        {"decode1", "mixed64", "prefill"} if workload == "all" else {workload}
    )
    for name, w in report["workloads"].items():
        assert w["ours_tok_s"] > 0 and w["peer_tok_s"] > 0
        assert abs(w["ratio"] - w["ours_tok_s"] / w["peer_tok_s"]) < 1e-9
        assert 0 < w["ttft_p50_ms"] <= w["ttft_p99_ms"] and w["peer_ttft_p99_ms"] > 0
        assert w["peak_rss_mb"]["ours"] > 0 and w["peak_rss_mb"]["peer"] > 0
        assert isinstance(w["ours_linears"], str) and w["ours_linears"]  # the path this host's timing picked
        assert w["spot_check"]["checked"] > 0 and w["spot_check"]["passed"], (name, w["spot_check"])
        served = w["served"]  # the same engine over HTTP: the same tokens as the offline engine
        assert served["outputs_match_ours"] and served["tok_s"] > 0 and served["peak_rss_mb"] > 0, (
            name,
            served,
        )
        assert abs(served["vs_ours"] - served["tok_s"] / w["ours_tok_s"]) < 1e-9
        quantized = w["quantized"]  # the runtime with int8 weights, timed in the same run
        assert quantized["method"] == "int8_weight_only" and quantized["tok_s"] > 0
        assert abs(quantized["vs_ours"] - quantized["tok_s"] / w["ours_tok_s"]) < 1e-9
        assert quantized["spot_check_vs_ours"] and all(
            v == "identical" or v.startswith("differs at step") for v in quantized["spot_check_vs_ours"]
        )
    decode = report["workloads"]["decode1"]
    assert 0 < decode["mbu"] and decode["bandwidth_limit_tok_s"] > 0
    assert abs(decode["achieved_gb_s"] / report["bandwidth_gb_s"] - decode["mbu"]) < 1e-9
    if workload == "all":
        assert report["workloads"]["prefill"]["mbu"] is None
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "skill bench" in proc.stderr  # the table
    assert not [c for c in map(_cmdline, Path("/proc").glob("[0-9]*/cmdline")) if str(model_dir) in c], (
        "the bench left a server of its own running"
    )


def test_bad_options_are_refused_before_anything_runs(tmp_path, tiny_llama_dir):
    model_dir = make_model_dir(tmp_path, tiny_llama_dir)
    for args, message in [
        (["--workload", "decode2"], "unknown workload"),
        (["--compare", "vllm"], "only peer"),
        (["--plot", str(tmp_path / "x.jpg")], "PNG"),
        (["--quant-method", "int3"], "int8_weight_only"),
    ]:
        proc = skill_bench(model_dir, *args)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr
