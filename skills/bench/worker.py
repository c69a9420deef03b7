"""One engine in its own process (so its peak RSS is its own), driven over stdin/stdout by `skill bench`.

    python -m skills.bench.worker ours|quantized|served|peer MODEL_DIR YAML WORKLOAD DTYPE THREADS EXE_MODE|-
        [--quick] [--quant-method METHOD]

Prints ``READY {...}``, then answers each ``run`` line with ``RESULT {...}`` and ``quit`` with
``DONE {"peak_rss_mb": ...}``; the peer also answers ``reference N`` with greedy outputs of the first N
requests run one at a time (no padding) and where their top two logits tie, for the spot check. `served`
reports the peak RSS of the server's processes, not its own; `quantized` is `ours` with
``model_config.quant_method`` set to METHOD. Everything else it prints goes to stderr.
"""

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path


def _say(out, tag: str, payload: dict) -> None:
    out.write(f"{tag} {json.dumps(payload)}\n")
    out.flush()


def peak_rss_mb() -> float:
    """This process's high-water RSS (VmHWM starts afresh at exec, unlike ru_maxrss)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def main(argv: list[str]) -> int:
    engine, model_dir, yaml_file, workload_name, dtype, threads, exe_mode = argv[:7]
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # libraries that print to stdout cannot break the protocol
    import torch

    from skills.bench.workloads import make_workload

    torch.set_num_threads(int(threads))
    workload = make_workload(workload_name, quick="--quick" in argv)
    if engine in ("ours", "quantized", "served"):
        from skills.bench.engines import Ours, Served, bench_config

        config = bench_config(
            Path(yaml_file),
            dtype,
            None if exe_mode == "-" else exe_mode,
            workload.num_requests,
            max(workload.prompt_lens),
            max(workload.output_lens),
        )
        if engine == "quantized":
            config.model_config.quant_method = argv[argv.index("--quant-method") + 1]
        if engine == "served":
            runner, info = Served(Path(model_dir), config, int(threads)), {}
        else:
            runner = Ours(Path(model_dir), config)
            info = dict(zip(("weight_bytes", "kv_bytes_per_token"), runner.bytes_per_token()))
            info["linears"] = runner.engine.worker.linear_path or "F.linear"
    else:
        from runtime.config import InferenceConfig
        from skills.bench.engines import Peer

        checkpoint = Path(InferenceConfig.from_yaml(yaml_file).model_config.model_path).expanduser()
        runner, info = Peer(checkpoint, dtype, workload.peer_batch), {}
    prompts = workload.prompts(runner.vocab_size)
    _say(protocol, "READY", info)
    for line in sys.stdin:
        if line.strip() == "run":
            _say(protocol, "RESULT", asdict(runner.run(prompts, workload.output_lens)))
        elif line.startswith("reference "):
            n = int(line.split()[1])
            refs = [runner.reference(p, o) for p, o in zip(prompts[:n], workload.output_lens)]
            _say(protocol, "RESULT", {"outputs": [r[0] for r in refs], "ties": [r[1] for r in refs]})
        elif line.strip() == "quit":
            break
    rss = runner.peak_rss_mb() if engine == "served" else peak_rss_mb()
    if engine == "served":
        runner.close()  # before DONE: the parent kills this process once it has read it
    _say(protocol, "DONE", {"peak_rss_mb": rss})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
