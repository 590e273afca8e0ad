"""Faults (issue 18, item 3): each leaves the run resumable and loses at most the checkpoint interval.

A killed, damaged, failed or non-finite run is rerun with the same command; it must finish with the
losses (and the checkpoint) of an uninterrupted run, compared exactly (a resume is bit-identical).
Faults are injected with monkeypatches made before the ranks fork, so forked ranks inherit them.
Legend: `single` runs in this process; `modular_pipeline` forks 2 ranks (blocks.1 on pipeline rank 1).
"""

import errno
import io
import json
import math
import os
import signal
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

import strategies.checkpoint.per_rank as checkpoint_module
from layerwise.run.faults import NonFiniteLoss
from layerwise.run.fit import train
from layerwise.preflight import validate
from strategies.checkpoint.per_rank import CheckpointError, load_per_rank, read_checkpoint_file
from strategies.checkpoint.safe_load import load_torch_file
from layerwise.run.launch import RankError, RunInterrupted
from tests.ranks import QUICK, add_callbacks, compose_config
from tests.same_checkpoints import assert_same_checkpoints

STEPS, EVERY = 6, 2  # a checkpoint after steps 2, 4, 6: a fault at step 3 or 4 loses ≤ 2 steps
BASE = [*QUICK, f"trainer.max_steps={STEPS}", f"trainer.val_check_interval={STEPS}",
        f"trainer.checkpoint_every_n_steps={EVERY}"]


def run(directory: Path, strategy: str, *overrides: str) -> dict:
    cfg = compose_config(*BASE, f"strategy={strategy}", *overrides)
    return train(cfg, directory, validate(cfg))


def checkpoint(directory: Path, name: str = "last") -> Path:
    return directory / "checkpoints" / f"{name}.ckpt"


def saved_step(directory: Path, name: str = "last") -> int:
    path = checkpoint(directory, name)
    return read_checkpoint_file(path / "rank0.pt" if path.is_dir() else path)["global_step"]


def summary_of(directory: Path) -> dict:
    return json.loads((directory / "summary.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """`reference(strategy) -> (summary, directory)` of the uninterrupted run, made once."""
    cache = {}

    def get(strategy):
        if strategy not in cache:
            directory = tmp_path_factory.mktemp(f"reference_{strategy}")
            cache[strategy] = (run(directory, strategy), directory)
        return cache[strategy]
    return get


def assert_resumes_like_reference(directory, strategy, reference, capfd):
    """Rerun the same command: it resumes from `last` and ends as the uninterrupted run."""
    summary = run(directory, strategy)
    assert "[layerwise] resuming from" in capfd.readouterr().out
    expected, expected_directory = reference(strategy)
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["losses"] == expected["losses"]  # exactly: a resume replays the same arithmetic
    assert assert_same_checkpoints(directory, expected_directory) > 0
    assert saved_step(directory, "previous") == STEPS - EVERY  # both kept: last and the one before


class Poison(pl.Callback):
    """blocks.1's output becomes NaN during step `step`, on the ranks that hold blocks.1 (or on `rank`)."""

    def __init__(self, step: int, rank=None):
        self.step, self.rank, self.handle = step, rank, None

    def on_train_batch_start(self, trainer, module, batch, batch_index):
        mine = self.rank in (None, trainer.global_rank)
        if trainer.global_step + 1 == self.step and "1" in module.model.blocks and mine:
            self.handle = module.model.blocks["1"].register_forward_hook(lambda m, i, out: out * float("nan"))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


class Snapshot(pl.Callback):
    """After every step, this rank's parameters and optimizer state to `directory/rank{r}_step{s}.pt`."""

    def __init__(self, directory: Path):
        self.directory = directory

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
        state = {"parameters": dict(module.named_parameters()),
                 "optimizer": trainer.optimizers[0].state_dict()["state"]}
        torch.save(state, self.directory / f"rank{trainer.global_rank}_step{trainer.global_step}.pt")


def snapshot(directory: Path, rank: int, step: int) -> dict:
    return load_torch_file(directory / f"rank{rank}_step{step}.pt")


# ============================================================ 1. SIGKILL during a checkpoint write

def test_sigkill_of_a_rank_mid_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch, reference, capfd):
    """Rank 1 of a 2-rank pipeline dies half-way through writing its file of the step-4
    checkpoint; the rerun resumes from step 2's and ends exactly as the uninterrupted run."""
    reference("modular_pipeline")  # before the fault is injected
    write = checkpoint_module.write_checkpoint_file

    def killed_mid_write(state, file):
        if os.environ.get("RANK") == "1" and state["global_step"] == 4:
            buffer = io.BytesIO()
            torch.save(state, buffer)
            file.write_bytes(buffer.getvalue()[: buffer.tell() // 2])  # half a file, then death
            os.kill(os.getpid(), signal.SIGKILL)
        write(state, file)
    monkeypatch.setattr(checkpoint_module, "write_checkpoint_file", killed_mid_write)
    with pytest.raises(RankError) as killed:
        run(tmp_path, "modular_pipeline")
    monkeypatch.undo()
    # whichever the launcher hears of first (rank 1's death, or rank 0's barrier losing its peer),
    # it names the rank the signal killed (layerwise/run/launch.py, docs/faults.md)
    assert killed.value.rank == 1 and "killed by signal 9" in str(killed.value)
    assert killed.value.exit_codes[1] == -9
    assert (checkpoint(tmp_path).with_name("last.ckpt.tmp") / "rank1.pt").stat().st_size > 0
    assert saved_step(tmp_path) == 2  # the step-4 checkpoint never became `last`
    assert_resumes_like_reference(tmp_path, "modular_pipeline", reference, capfd)


# ======================================================= 2. a truncated or corrupt checkpoint file

def test_truncated_last_falls_back_to_the_previous_checkpoint(tmp_path, reference, capfd):
    run(tmp_path, "single")
    last = checkpoint(tmp_path)
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    assert saved_step(tmp_path, "previous") == STEPS - EVERY
    capfd.readouterr()
    summary = run(tmp_path, "single")
    out = capfd.readouterr().out
    assert f"checkpoint {last} is damaged ({last} is unreadable" in out
    assert f"falling back to {checkpoint(tmp_path, 'previous')}" in out
    expected, expected_directory = reference("single")
    assert summary["losses"] == expected["losses"] and summary["steps"] == STEPS
    assert_same_checkpoints(tmp_path, expected_directory)


def test_corrupt_last_without_a_previous_one_names_the_file_and_the_fix(tmp_path):
    """Overwritten tensor bytes load silently with torch.load: the zip CRCs catch them."""
    run(tmp_path, "single", f"trainer.max_steps={EVERY}")
    last = checkpoint(tmp_path)
    data = bytearray(last.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = bytes(64)
    last.write_bytes(bytes(data))
    assert not checkpoint(tmp_path, "previous").exists()
    with pytest.raises(CheckpointError) as caught:
        run(tmp_path, "single")
    message = str(caught.value)
    assert f"no readable checkpoint at {last}" in message and "fails its CRC check" in message
    assert "resume=false" in message and f"delete the damaged checkpoint ({last})" in message


def write_per_rank(path: Path, step: int, layout: dict) -> None:
    path.mkdir(parents=True)
    (path / "layout.json").write_text(json.dumps(layout))
    for rank in range(2):
        torch.save({"global_step": step, "weight": torch.full((3,), float(rank))}, path / f"rank{rank}.pt")


def test_per_rank_checkpoints_fall_back_together_when_one_rank_file_is_damaged(tmp_path, capsys):
    """Rank 1's file of `last` is truncated: rank 1 finds it, rank 0 learns it from the vote, and
    both load `previous` (each its own file); without a vote rank 0 would resume from `last`."""
    layout = {"data": 1, "pipeline": 2}
    last = tmp_path / "last.ckpt"
    write_per_rank(last, 4, layout)
    write_per_rank(tmp_path / "previous.ckpt", 2, layout)
    (last / "rank1.pt").write_bytes((last / "rank1.pt").read_bytes()[:100])
    votes = []

    def vote_of_rank_one(ok):  # what reduce_boolean_decision(all=True) answers rank 0
        votes.append(ok)
        return ok and len(votes) > 1
    rank0 = load_per_rank(last, 0, layout, agree=vote_of_rank_one)
    rank1 = load_per_rank(last, 1, layout)
    assert (rank0["global_step"], rank1["global_step"]) == (2, 2)
    assert torch.equal(rank1["weight"], torch.ones(3)) and torch.equal(rank0["weight"], torch.zeros(3))
    assert "another rank could not read its file" in capsys.readouterr().out
    with pytest.raises(ValueError, match="Fix: resume with the same strategy degrees"):
        load_per_rank(last, 0, {"data": 2, "pipeline": 1})  # another layout is no damage: no fallback


# ==================================================================== 3. NaN/Inf loss

# strategy: where the first non-finite value is reported. ddp: only replica 1's loss is NaN (the
# replicas vote, so both stop); modular_pipeline: blocks.1 lives on pipeline rank 1.
STOPS = {"single": "on rank 0, the output of blocks.1 (its parameters are finite)",
         "ddp": "on rank 1, the output of blocks.1 (its parameters are finite)",
         "modular_pipeline": "on rank 1 (pipeline rank 1 of 2), the output of blocks.1"}


@pytest.mark.parametrize("strategy", list(STOPS))
def test_nonfinite_loss_stops_naming_step_rank_and_layer(strategy, tmp_path, monkeypatch, reference, capfd):
    reference(strategy)  # before the poison: the lazily made reference must not inherit it
    add_callbacks(monkeypatch.setattr, Poison(step=3, rank=1 if strategy == "ddp" else None))
    with pytest.raises((NonFiniteLoss, RankError)) as caught:
        run(tmp_path, strategy)
    monkeypatch.undo()
    message = str(caught.value)
    assert "non-finite training loss (nan) at step 3: first non-finite value " + STOPS[strategy] in message
    assert "trainer.skip_nonfinite_steps=true" in message
    failed = summary_of(tmp_path)  # rank 0's, or the launcher's shorter one if rank 1 reported first
    assert failed["status"] == "failed" and "output of blocks.1" in failed["error"]
    assert saved_step(tmp_path) == 2  # the guard stopped before the update: nothing non-finite saved
    assert_resumes_like_reference(tmp_path, strategy, reference, capfd)


@pytest.mark.parametrize("strategy", ["single", "modular_pipeline"])
def test_skip_nonfinite_steps_leaves_weights_and_optimizer_state_untouched(strategy, tmp_path, monkeypatch, reference):
    expected, _ = reference(strategy)  # before the poison: the lazily made reference must not inherit it
    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    add_callbacks(monkeypatch.setattr, Poison(step=3), Snapshot(snapshots))
    summary = run(tmp_path / "run", strategy, "trainer.skip_nonfinite_steps=true")
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["skipped_steps"] == [3]
    assert summary["losses"][:2] == expected["losses"][:2] and math.isnan(summary["losses"][2])
    assert all(math.isfinite(loss) for loss in summary["losses"][3:])  # nothing NaN was applied
    for rank in range(2 if strategy == "modular_pipeline" else 1):
        torch.testing.assert_close(snapshot(snapshots, rank, 3), snapshot(snapshots, rank, 2), rtol=0, atol=0)
        with pytest.raises(AssertionError):  # the comparison sees an ordinary step's update
            torch.testing.assert_close(snapshot(snapshots, rank, 2), snapshot(snapshots, rank, 1), rtol=0, atol=0)


# ================================================================= 4. disk full while writing

def test_disk_full_during_a_write_keeps_the_previous_last(tmp_path, monkeypatch, reference, capfd):
    reference("single")  # before the fault is injected
    save = torch.save

    def full_at_step_four(state, handle, *arguments, **keywords):
        if isinstance(state, dict) and state.get("global_step") == 4:
            handle.write(b"PK\x03\x04 the first bytes")  # a partial file exists when the disk fills
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return save(state, handle, *arguments, **keywords)
    monkeypatch.setattr(torch, "save", full_at_step_four)
    with pytest.raises(CheckpointError) as caught:
        run(tmp_path, "single")
    monkeypatch.undo()
    temporary = checkpoint(tmp_path).with_name("last.ckpt.tmp")
    message = str(caught.value)
    assert f"could not write checkpoint file {temporary}: No space left on device" in message
    assert "Fix: free space on that file system" in message
    assert not temporary.exists() and saved_step(tmp_path) == 2
    assert summary_of(tmp_path)["status"] == "failed" and str(temporary) in summary_of(tmp_path)["error"]
    assert_resumes_like_reference(tmp_path, "single", reference, capfd)


# ====================================================================== 5. Slurm (no cluster)

def launcher_config(*overrides):
    from hydra import compose, initialize_config_dir

    from layerwise.config.store import register_schemas
    from tests.ranks import CONFIG_DIRECTORY
    register_schemas()
    with initialize_config_dir(config_dir=CONFIG_DIRECTORY, version_base="1.3"):
        return compose(config_name="config", overrides=["hydra/launcher=slurm", *overrides],
                       return_hydra_config=True)


def test_mem_gb_follows_the_hardware_profile():
    """job_resources gets the world size directly (validate's own checks are tested elsewhere)."""
    from layerwise.cluster.slurm import job_resources
    gpu = launcher_config("strategy=modular_pipeline", "hardware=dgx_a100_80g", "model=gpt_small")
    resources, problems = job_resources(gpu, 8)
    assert problems == [] and resources["mem_gb"] == int(0.9 * 2.0e12 / 2 ** 30)  # 2 TB per DGX node
    cpu = launcher_config("strategy=ddp")
    assert job_resources(cpu, 2)[0]["mem_gb"] == int(0.9 * 2.4e10 / 2 ** 30)
    explicit = launcher_config("strategy=ddp", "hydra.launcher.mem_gb=16")
    assert job_resources(explicit, 2)[0]["mem_gb"] == 16
    too_much = launcher_config("strategy=ddp", "hydra.launcher.mem_gb=64")
    _, problems = job_resources(too_much, 2)
    assert len(problems) == 1 and "hydra.launcher.mem_gb=64" in problems[0]
    assert "hardware.host_memory_bytes" in problems[0] and "Fix: drop hydra.launcher.mem_gb" in problems[0]


def test_requeue_is_capped_by_max_requeues(monkeypatch, capsys):
    from layerwise.cluster import slurm
    from layerwise.run import preemption
    calls = []
    monkeypatch.setattr(preemption.subprocess, "run", lambda command, **keywords: calls.append(command))
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    for restarts, expected_calls, code in (("", 1, 0), ("1", 2, 0), ("2", 2, 1)):
        monkeypatch.setenv("SLURM_RESTART_COUNT", restarts)
        with pytest.raises(SystemExit) as exited:
            preemption.exit_after_requeue(0, max_requeues=2)
        assert (len(calls), exited.value.code) == (expected_calls, code)
    assert calls == [["scontrol", "requeue", "7"]] * 2
    line = slurm.FAILURE_LINE.search(capsys.readouterr().err)  # what the launcher reports
    assert line.group(1) == "0" and "hydra.launcher.max_requeues=2" in line.group(2)
    with pytest.raises(SystemExit):  # another rank: no requeue, same exit
        preemption.exit_after_requeue(1, max_requeues=2)
    assert len(calls) == 2


def test_max_requeues_is_read_from_the_launcher_config_and_checked():
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate
    launcher = launcher_config("strategy=ddp").hydra.launcher
    assert instantiate(launcher).max_requeues == 3  # conf/hydra/launcher/slurm.yaml
    assert instantiate(launcher, max_requeues=None).max_requeues is None  # no limit
    with pytest.raises(InstantiationException, match=r"hydra.launcher.max_requeues=-1.*Fix: a whole number"):
        instantiate(launcher, max_requeues=-1)


# ============================================================ SIGTERM on any rank (no Slurm)

class Terminate(pl.Callback):
    """SIGTERM to this process at the end of step `step` on rank `rank` (as `kill` or a scheduler would)."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_on_a_rank_other_than_zero_stops_every_rank_and_the_rerun_resumes(tmp_path, monkeypatch,
                                                                                  reference, capfd):
    # The flag travels in the step's evidence exchange (Lightning's own check broadcasts rank 0's
    # only): rank 1's SIGTERM after step 3 rides in step 4's exchange, both ranks save step 4 and stop
    # (layerwise/run/preemption.py, the agreed stop), rank 0 writes every finished step's row and an
    # "interrupted" summary with the saved step, and the rerun resumes.
    add_callbacks(monkeypatch.setattr, Terminate(step=3, rank=1))
    with pytest.raises(RunInterrupted, match="stopped by SIGTERM"):
        run(tmp_path, "modular_pipeline")
    monkeypatch.undo()
    assert saved_step(tmp_path) == 4  # the step boundary after the signal: nothing finished is lost
    assert summary_of(tmp_path)["status"] == "interrupted" and summary_of(tmp_path)["saved_step"] == 4
    steps = [int(row.split(",")[0]) for row in (tmp_path / "metrics.csv").read_text().splitlines()[1:]]
    assert steps == [1, 2, 3, 4]
    assert_resumes_like_reference(tmp_path, "modular_pipeline", reference, capfd)


def test_a_rank_that_fails_in_setup_reports_that_error_not_a_teardown_one(tmp_path):
    """A rank whose setup raises before its model leaves the meta device (here: degrees of 4 ranks in a
    job of 2, which preflight would stop; on a cluster, e.g. a process group that cannot form) must
    report that error: Lightning's teardown moves the module to the CPU, which on meta tensors raised
    "Cannot copy out of meta tensor" and became the last line a user read."""
    cfg = compose_config(*BASE, "strategy=modular_pipeline", "strategy.tensor_parallel=1d")
    with pytest.raises(RankError) as failed:
        train(cfg, tmp_path, 2)  # validate(cfg) says 4
    message = str(failed.value)
    assert "need 4 ranks, the job has 2" in message.splitlines()[-1]
    assert "meta tensor" not in message
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"
