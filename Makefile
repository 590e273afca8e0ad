# The two quick-start commands: `make run` (the default experiment) and `make test` (the suite).
# Both create .venv and install into it first, so each works on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install check clean

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

clean:
	rm -rf $(VENV) runs outputs multirun
