#!/usr/bin/env bash
# The first contact with a GPU (issue 54): equality, precision, speed against a plain PyTorch loop,
# plan mode against measured runs, and issue 31's two held-out grids on the node's CPU cores, in one
# run of at most 8 minutes on one H100/H200 (layerwise/tools/device_check.py says what each row is).
#     scripts/device_check.sh OUTDIR           on the GPU node
#     scripts/device_check.sh --cpu OUTDIR     the same steps on the cpu profile, tiny sizes (here)
# Writes OUTDIR/device_check.json, OUTDIR/results.md and OUTDIR/device_check.log, rewritten after every
# section, so a run cut off by the wall clock keeps what it measured. Extra options go to the module
# (before OUTDIR, which comes last: --sections equality,speed  --budget-s 300  --subset).
# The GPU node has torch but not Hydra: scripts/fetch_device_wheels.sh puts the missing wheels in
# .whl/ here, the device call carries .whl, and they are installed below into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
[ -x "$python" ] || python=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 WANDB_MODE=disabled
if ! "$python" -c "import hydra, omegaconf" 2>/dev/null; then
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "device_check: Hydra is not installed and .whl/ holds no wheels. Fix: scripts/fetch_device_wheels.sh here, then carry .whl" >&2
        exit 2
    fi
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
outdir="${*: -1}"  # the last argument
case "$outdir" in ""|-*) echo "usage: scripts/device_check.sh [--cpu] [options] OUTDIR" >&2; exit 2 ;; esac
mkdir -p "$outdir"
"$python" -m layerwise.tools.device_check "$@" 2>&1 | tee "$outdir/device_check.log"
