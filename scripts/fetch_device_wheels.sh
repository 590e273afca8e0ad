#!/usr/bin/env bash
# The wheels scripts/device_check.sh installs on the GPU node, downloaded here into .whl/ (ignored by
# git; the device `run` call carries it). The node has Python 3.12 with torch 2.11, Lightning,
# transformers, safetensors, tokenizers, pyarrow, matplotlib, PyYAML, packaging and cloudpickle, and
# no network (/work/.library/device/KINDS.md): what train.py needs beside them is Hydra and its
# config library, the ANTLR runtime Hydra's parser uses, and the Slurm launcher plugin
# (hydra_plugins/ imports it) with submitit, and torchao for the FP8 rows. No wandb: the check runs logger=none.
# The versions are this project's venv's (pyproject.toml's ranges). antlr4-python3-runtime 4.9.3 is
# published as a source archive only, so it is built here into a pure-Python (py3-none-any) wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
[ -x "$python" ] || python=python3
mkdir -p .whl
rm -f .whl/*.whl
binary=(hydra-core==1.3.8 omegaconf==2.3.1 submitit==1.5.4 hydra-submitit-launcher==1.2.0
        torchao==0.18.0)  # hardware.precision=fp8-mixed (the fp8 rows; abi3, works with torch 2.11)
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "${binary[@]}"
"$python" -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls -l .whl
du -ch .whl/*.whl | tail -1
