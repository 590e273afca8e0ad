#!/usr/bin/env bash
# The GPU check to run first on a GPU node: every strategy for 10 steps on 1, 2, 4, 8 of this
# node's GPUs (as many as there are) against strategy=single on one of them, printed as one table
# (strategy, ranks, max loss difference, step time, allocator peak). Arguments go to
# `python -m layerwise.gpu_check` (see its --help), e.g.
#     scripts/gpu_check.sh --strategies ddp,modular_pipeline --steps 10 hardware.precision=bf16-mixed --tolerance 0.05
# CI and CPU machines: prints "no CUDA device: skipped" and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
[ -x "$python" ] || python=python3

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
if [ "$gpus" -eq 0 ]; then  # no driver, or no device: nothing to check (and no torch import)
    echo "gpu_check: no CUDA device: skipped"
    exit 0
fi
echo "gpu_check: $gpus CUDA device(s) on $(hostname)"
exec "$python" -m layerwise.gpu_check "$@"
