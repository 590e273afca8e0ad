# The two quick-start commands: `make run` (the default experiment) and `make test` (the suite).
# Both create .venv and install into it first, so each works on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install check clean smoke-torch211

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch pinned to the 2.13 series: on this machine pip takes the CPU wheel from disk.
	$(BIN)/pip install --quiet "torch==2.13.*"
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	WANDB_MODE=$${WANDB_MODE:-offline} $(BIN)/python train.py $(ARGS)

# Two pytest-xdist workers, a test file each at a time (a module's fixtures, such as the Slurm sweep,
# are made once), each computing on one thread (tests/conftest.py; the time is in README.md).
test: $(STAMP)
	WANDB_MODE=disabled $(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=30 $(ARGS)

check: $(STAMP)
	$(BIN)/python train.py mode=check $(ARGS)

# The oldest torch we accept (pyproject: torch>=2.11,<2.14), in a second venv: the smoke subset
# (`pytest -m smoke`, tests/test_smoke.py: a run of each strategy family, a Hugging Face import, a
# resume) under torch 2.11. PyPI has no CPU wheel of 2.11, so pip takes its CUDA 13.0 build with its
# CUDA libraries (23 wheels, ~2.6 GB, a 4.7 GB venv), which runs on CPU as well. A fresh clone (CI)
# downloads them each time: ~1 min, accepted; the stamp keeps a second call from reinstalling.
VENV211 := .venv-torch211
STAMP211 := $(VENV211)/.installed

$(STAMP211): pyproject.toml
	$(PYTHON) -m venv $(VENV211)
	$(VENV211)/bin/pip install --quiet --upgrade pip
	$(VENV211)/bin/pip install --quiet "torch==2.11.*"
	$(VENV211)/bin/pip install --quiet -e ".[test]"
	touch $(STAMP211)

smoke-torch211: $(STAMP211)
	$(VENV211)/bin/python -c "import torch; assert torch.__version__.startswith('2.11.'), torch.__version__"
	WANDB_MODE=disabled $(VENV211)/bin/python -m pytest -q -m smoke --durations=12 $(ARGS)

clean:
	rm -rf $(VENV) $(VENV211) runs outputs multirun
