#!/usr/bin/env bash
# The CUDA checks the README's "Devices" section reports, for a machine with one NVIDIA GPU:
#   1. the single-rank parity tests, with the runtime on the GPU (it takes cuda whenever it sees one) and
#      transformers' reference on the host, in float32;
#   2. `skill bench --compare transformers` on a SmolLM2-135M-shaped checkpoint with random weights (the
#      shipped weights are not needed to time it), both engines on the GPU, eager and compiled.
# Usage: bash scripts/cuda_check.sh OUT_DIR SMOLLM2_CONFIG_DIR [TEST_BUDGET_S] [BENCH_BUDGET_S]
# SMOLLM2_CONFIG_DIR holds the model's config.json and tokenizer files; python3 must import torch (a CUDA
# build) and the project's dependencies. Each stage is bounded, so the script ends in about the sum of both
# budgets plus a minute and a half. On an H200 (2026-12-04) the tests took 185 s with 16 host cores, decode1
# with the peer about 80 s; mixed64 and the compiled decode1 needed more than 95 s and 81 s.
set -uo pipefail
OUT=$(realpath "${1:?output folder}")
SHAPE=$(realpath "${2:?folder with the SmolLM2 config and tokenizer}")
TEST_BUDGET=${3:-240}
BENCH_BUDGET=${4:-240}
PY=${PYTHON:-python3}
# the host (CPU) kernels are not what runs here; building them would only cost time
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 SKILL_HOST_KERNELS=0
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
WORK=$(mktemp -d)
# a converted model's infer.sh runs `skill` and the python and torchrun beside it: where the project is
# importable but not installed, shims
mkdir -p "$WORK/bin"
shim() { printf '#!/bin/sh\nexec %s "$@"\n' "$2" > "$WORK/bin/$1" && chmod +x "$WORK/bin/$1"; }
shim python "$(command -v "$PY")"
shim torchrun "$(dirname "$(command -v "$PY")")/torchrun"
shim skill "$(command -v "$PY") -m skills.cli"
export SKILL=$WORK/bin/skill

$PY - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__)
print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
EOF

echo "== single-rank parity on the GPU"
timeout "$TEST_BUDGET" $PY -m pytest -q -n 8 -p no:cacheprovider --junitxml="$OUT/junit.xml" \
  tests/test_parity_llama.py tests/test_engine.py tests/test_migrate_parity.py tests/test_bench.py \
  tests/test_quantization.py -k "not parallel" 2>&1 | tail -40 | tee "$OUT/tests.txt"

echo "== SmolLM2-shaped checkpoint, random weights"
$PY - "$SHAPE" "$WORK/ckpt" <<'EOF'
import shutil, sys
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM

shape, ckpt = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape), dtype=torch.bfloat16)
model.save_pretrained(ckpt)
for f in shape.iterdir():
    if f.name != "config.json":
        shutil.copy(f, ckpt / f.name)
EOF
$PY -m skills.cli migrate "$WORK/ckpt" -o "$WORK/models" --name smol --no-verify --no-run --force 2>&1 | tail -3

bench() {  # bench NAME SECONDS ARGS...: one bounded `skill bench` run, its JSON and log kept under OUT
  local name=$1 seconds=$2
  shift 2
  echo "== bench $name"
  timeout "$seconds" $PY -m skills.cli bench "$WORK/models/smol" --dtype bfloat16 --repeats 1 --json "$@" \
    > "$OUT/bench_$name.json" 2> "$WORK/bench_$name.log"
  grep -v "^bench " "$WORK/bench_$name.log" | tail -12 | tee -a "$OUT/bench.txt"
}
# separate runs, so a workload that outlasts its share loses only its own figures
bench decode1 $((BENCH_BUDGET * 20 / 100)) --workload decode1 --compare transformers
bench prefill $((BENCH_BUDGET * 15 / 100)) --workload prefill --compare transformers
bench mixed64 $((BENCH_BUDGET * 35 / 100)) --workload mixed64 --compare transformers
bench decode1_compiled $((BENCH_BUDGET * 30 / 100)) --workload decode1 --exe-mode compile --compare none
rm -rf "$WORK"
