"""Launching local ranks: the parent never initialises CUDA, GPU ranks are spawned, CPU ranks forked,
emulated nodes get cluster-like ranks, and an external launcher's world must match the config.

No GPU here: tests/fake_gpu.py dresses torch as a CUDA build whose NVML sees GPUs and turns every
CUDA-initialising call into a recorded error, so a parent that initialised CUDA fails these tests.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from layerwise.run import launch
from layerwise.config.errors import ConfigError
from layerwise.preflight import validate
from tests.fake_gpu import pretend_gpus
from tests.ranks import QUICK, compose_config, run_on_ranks

ROOT = Path(__file__).resolve().parent.parent
GPU_RUN = ["strategy=ddp", "hardware=dgx_a100_80g", "hardware.devices_per_node=2",
           "data.global_batch_size=8", "logger=none"]


def test_gpu_ranks_are_spawned_and_cpu_ranks_forked():
    assert launch.start_method("gpu") == "spawn"
    assert launch.start_method("cpu") == "fork"


def test_the_fake_gpu_catches_a_parent_that_asks_cuda(monkeypatch):
    calls = pretend_gpus(monkeypatch.setattr, 2)
    with pytest.raises(RuntimeError, match="would initialise CUDA"):
        torch.cuda.is_available()
    assert calls and calls[0].startswith("torch.cuda.is_available")


def test_gpus_are_counted_with_nvml_only(monkeypatch):
    calls = pretend_gpus(monkeypatch.setattr, 4)
    assert launch.local_gpu_count() == 4
    assert calls == [] and not torch.cuda.is_initialized()


@pytest.mark.parametrize("mode, submitting", [("fit", False), ("check", False), ("fit", True)])
def test_validating_a_gpu_config_initialises_no_cuda(monkeypatch, mode, submitting):
    calls = pretend_gpus(monkeypatch.setattr, 2)
    assert validate(compose_config(*GPU_RUN, f"mode={mode}"), submitting=submitting) == 2
    assert calls == [] and not torch.cuda.is_initialized()


def test_a_gpu_config_on_a_machine_without_gpus_names_the_fix(monkeypatch):
    pretend_gpus(monkeypatch.setattr, 0)
    with pytest.raises(ConfigError, match="needs CUDA GPUs and this machine has none"):
        validate(compose_config(*GPU_RUN))


def test_train_py_parent_initialises_no_cuda_and_spawns_gpu_ranks(tmp_path):
    """train.py for real up to the launch (compose, validate, config.yaml, train's setup), in a
    process dressed as a 2-GPU node; the launcher is replaced by a probe that reports and stops."""
    result = subprocess.run([sys.executable, "tests/fake_gpu.py", *GPU_RUN, f"hydra.run.dir={tmp_path}"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "FAKE_GPU_COUNT": "2"})
    launches = [line for line in result.stdout.splitlines() if line.startswith("LAUNCH ")]
    assert result.returncode == 0 and launches, result.stdout[-2000:] + result.stderr[-3000:]
    launched = json.loads(launches[0].removeprefix("LAUNCH "))
    assert launched == {"method": "spawn", "world_size": 2, "ranks_per_node": 2,
                        "cuda_initialized": False, "initialising_calls": []}
    assert (tmp_path / "config.yaml").exists()


def rendezvous_of_this_rank(rank):
    return {name: os.environ[name] for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")}


def test_forked_ranks_of_emulated_nodes_get_cluster_ranks():
    ranks = launch.run_ranks(rendezvous_of_this_rank, 4, ranks_per_node=2, timeout=120)
    assert [(r["RANK"], r["LOCAL_RANK"], r["NODE_RANK"], r["WORLD_SIZE"]) for r in ranks] == [
        ("0", "0", "0", "4"), ("1", "1", "0", "4"), ("2", "0", "1", "4"), ("3", "1", "1", "4")]
    assert run_on_ranks(rendezvous_of_this_rank, 2)[1]["LOCAL_RANK"] == "1"  # one node by default


def test_only_global_rank_zero_writes(monkeypatch):
    assert launch.writes_run_files()  # the launching parent, or the only process
    monkeypatch.setenv("SLURM_PROCID", "3")
    assert launch.global_rank() == 3 and not launch.writes_run_files()
    monkeypatch.setenv("RANK", "0")  # torchrun's RANK is the global rank
    assert launch.global_rank() == 0 and launch.writes_run_files()


def test_an_external_world_of_another_size_is_rejected_with_the_fix(monkeypatch):
    assert launch.external_world_errors(4) == []  # nothing started this process
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launch.external_world_errors(4) == []
    (problem,) = launch.external_world_errors(1)
    assert "started 4 processes" in problem and "runs 1" in problem and "Fix: torchrun" in problem
    assert launch.external_world_errors(4, sweep=True) == []  # srun's ranks sweep under hydra/launcher=slurm
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    (problem,) = launch.external_world_errors(4, sweep=True)
    assert "-m (a sweep) under torchrun" in problem and "Fix: one torchrun command per point" in problem


def test_when_nvml_cannot_count_a_separate_process_does(monkeypatch):
    pretend_gpus(monkeypatch.setattr, -1)  # NVML failed: counting here would initialise CUDA
    commands = []

    def probe(command, **keywords):
        commands.append(command)
        return subprocess.CompletedProcess(command, 0, stdout="3\n", stderr="")

    monkeypatch.setattr(launch.subprocess, "run", probe)
    assert launch.local_gpu_count() == 3
    assert commands[0][0] == sys.executable and "device_count()" in commands[0][-1]


# ----- No wall-clock deadline on training (issue 28 item 0) ----------------------------------------

class DayPerReading:
    """A clock on which every reading is a day later than the last: any deadline the launcher kept
    would pass on its first check, so a run that still completes under it keeps none."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 86_400.0
        return self.now

    def __getattr__(self, name):  # sleep, perf_counter, ... stay real
        return getattr(time, name)


def sleep_then_name_the_rank(rank):
    time.sleep(1.0)  # a few of the launcher's polls, each a day on its clock
    return rank


def test_ranks_run_as_long_as_they_work_when_no_deadline_is_asked(monkeypatch):
    monkeypatch.setattr(launch, "time", DayPerReading())
    assert launch.run_ranks(sleep_then_name_the_rank, 2) == [0, 1]


def test_a_deadline_asked_for_bounded_work_still_ends_it(monkeypatch):
    # The same clock fails a call that does ask for a deadline: the test above can fail.
    monkeypatch.setattr(launch, "time", DayPerReading())
    with pytest.raises(launch.RankError, match="no result in 60 s"):
        launch.run_ranks(sleep_then_name_the_rank, 2, timeout=60.0)


def test_a_training_run_outlives_days_on_the_launchers_clock(monkeypatch, tmp_path):
    """train() through the real local launcher, ten steps of two ranks, each launcher clock
    reading a day later: it completes (before the fix it died at the first reading past 900 s,
    blaming a healthy rank)."""
    from layerwise.run.fit import train
    monkeypatch.setattr(launch, "time", DayPerReading())
    cfg = compose_config(*QUICK, "strategy=ddp", "trainer.max_steps=10", "trainer.val_check_interval=10")
    summary = train(cfg, tmp_path / "run", validate(cfg))
    assert summary["status"] == "completed" and summary["steps"] == 10


# ----- A local GPU launch fits the GPUs this machine has (issue 37, item 4) ------------------------

def test_a_local_gpu_launch_needing_more_gpus_than_nvml_counts_names_the_fix(monkeypatch):
    """devices_per_node above the local GPUs would fail in every spawned child (invalid device)."""
    pretend_gpus(monkeypatch.setattr, 2)
    with pytest.raises(ConfigError, match=r"hardware.devices_per_node=4 ranks on this machine's 2 GPUs"):
        validate(compose_config(*GPU_RUN, "hardware.devices_per_node=4"))
    assert validate(compose_config(*GPU_RUN, "strategy=single", "hardware.devices_per_node=4")) == 1


def test_emulated_nodes_on_one_gpu_machine_are_refused(monkeypatch):
    """hardware.nodes=2 without Slurm or torchrun: rank r gets LOCAL_RANK r mod devices_per_node,
    so ranks 0 and 2 would share GPU 0 (NCCL: "Duplicate GPU detected")."""
    pretend_gpus(monkeypatch.setattr, 4)
    with pytest.raises(ConfigError, match=r"hardware.nodes=2 .* would share"):
        validate(compose_config(*GPU_RUN, "hardware.nodes=2", "data.global_batch_size=8"))
    monkeypatch.setenv("LOCAL_RANK", "0")  # torchrun started this node's ranks: its GPUs are its own
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert validate(compose_config(*GPU_RUN, "hardware.nodes=2", "data.global_batch_size=8")) == 4
