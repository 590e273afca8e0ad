"""Hangs (issue 33): a stuck rank is named by our watchdog (its paragraph, not a process group's timeout,
which the chain of timeouts sets later: `timeout_chain`), every rank exits non-zero, nothing is left running, summary.json says "hung", and the rerun resumes.

Faults are injected by test-only callbacks added to every Trainer fit.py builds (before the ranks
fork, so they inherit them): a rank stops itself (SIGSTOP) inside a step's forward, a rank skips one
collective (the test's communicator subclass), a rank is killed, a rank is slowed.
Legend: `modular_pipeline` with 4 ranks is a 4-stage pipeline (one block per stage); `ddp` 2 ranks.
"""

import json
import os
import signal
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest

from layerwise.preflight import validate
from layerwise.run.fit import train
from layerwise.run.hangs import HUNG_EXIT_CODE, StragglerDetector, Watchdog, diagnose
from layerwise.run.timeouts import timeout_chain
from layerwise.run.launch import HangError, RankError
from parallel.flight import FlightRecorder
from tests.ranks import QUICK, add_callbacks, compose_config, process_parents
from tests.warm_python import server_pids

TIMEOUT_S = 5.0  # the watchdog's allowance per wait: the ranks' answers come within it plus 2 polls and 2 s;
# at 3 s a rank of a 4-rank run once answered too late with a busy loop on each core beside the suite
# (issue 55 item 9) and the diagnosis named it instead of the rank that skipped the collective
STEPS, EVERY = 6, 2
BASE = [*QUICK, f"trainer.max_steps={STEPS}", f"trainer.val_check_interval={STEPS}",
        f"trainer.checkpoint_every_n_steps={EVERY}", f"trainer.collective_timeout_s={TIMEOUT_S}",
        "trainer.long_timeout_factor=4"]
PIPELINE_4 = ["strategy=modular_pipeline", "strategy.pipeline_degree=4", "hardware.devices_per_node=4",
              "model.layers=4"]


def run(directory: Path, *overrides: str) -> dict:
    cfg = compose_config(*BASE, *overrides)
    return train(cfg, directory, validate(cfg))


def children() -> list:
    """This process's descendants still in the process table (zombies included), read from /proc;
    the suite's warm interpreter (tests/warm_python.py, alive all session) and its tree left out."""
    parents = {}
    for child, parent in process_parents().items():
        parents.setdefault(parent, []).append(child)
    found, frontier = [], [os.getpid()]
    while frontier:
        born = [pid for pid in parents.get(frontier.pop(), []) if pid not in server_pids()]
        found += born
        frontier += born
    return found


def summary_of(directory: Path) -> dict:
    return json.loads((directory / "summary.json").read_text())


def saved_step(directory: Path) -> int:
    from strategies.checkpoint.per_rank import read_checkpoint_file
    path = directory / "checkpoints" / "last.ckpt"
    return read_checkpoint_file(path / "rank0.pt" if path.is_dir() else path)["global_step"]


def hung_run(tmp_path, monkeypatch, capfd, *overrides) -> tuple:
    """Run to the hang; (the HangError, seconds from start to diagnosis, printed paragraph, diagnosis)."""
    start = time.monotonic()
    with pytest.raises(HangError) as hung:
        run(tmp_path, *overrides)
    elapsed = time.monotonic() - start
    monkeypatch.undo()
    assert children() == []  # nothing left running: the stopped rank too
    err = capfd.readouterr().err
    printed = [line for line in err.splitlines() if "hang diagnosis" in line.lower()]
    if not printed:
        report(tmp_path, elapsed, [err[-3000:]])
    diagnosis = json.loads((tmp_path / "hang" / "diagnosis.json").read_text())
    return hung.value, elapsed, printed, diagnosis


def report(directory: Path, elapsed: float, printed: list, codes=None) -> None:
    """Keep what a reader of the closing note wants: the time to the diagnosis and its paragraph."""
    out = os.environ.get("LAYERWISE_HANG_REPORT")
    if out:
        with open(out, "a") as handle:
            handle.write(f"{directory.name}: diagnosed in {elapsed:.1f} s, exit codes {codes}\n"
                         f"{printed[0] if printed else None}\n\n")


def assert_reruns(tmp_path, capfd, *overrides) -> None:
    step = saved_step(tmp_path)
    summary = run(tmp_path, *overrides)
    assert f"resuming from {tmp_path}" in capfd.readouterr().out
    assert summary["status"] == "completed" and summary["steps"] == STEPS and step >= EVERY
    assert len(summary["losses"]) == STEPS


class StopSelf(pl.Callback):
    """Rank `rank` stops itself (SIGSTOP) in the forward of its block during step `step`."""

    def __init__(self, rank: int, step: int, sig=signal.SIGSTOP):
        self.rank, self.step, self.sig = rank, step, sig

    def on_train_batch_start(self, trainer, module, batch, batch_index):
        if trainer.global_rank == self.rank and trainer.global_step + 1 == self.step:
            block = next(iter(module.model.blocks.values()))
            block.register_forward_hook(lambda *_: os.kill(os.getpid(), self.sig))


def test_a_stopped_rank_is_named_and_the_rerun_resumes(tmp_path, monkeypatch, capfd):
    add_callbacks(monkeypatch.setattr, StopSelf(rank=2, step=4))
    error, elapsed, printed, diagnosis = hung_run(tmp_path, monkeypatch, capfd, *PIPELINE_4)
    report(tmp_path, elapsed, printed, error.exit_codes)
    assert error.rank == 2 and diagnosis["stuck_rank"] == 2
    # the stopped rank is killed; the others exit 124 themselves (or, on a loaded machine, are killed
    # by the launcher when they take over 5 s to see the diagnosis): all non-zero
    codes = error.exit_codes
    assert codes[2] == -signal.SIGKILL and codes[0] == HUNG_EXIT_CODE and set(codes) <= {HUNG_EXIT_CODE, -9}
    assert diagnosis["states"]["2"].startswith("stopped (SIGSTOP")
    assert len(printed) == 1 and "rank 2 stopped progressing" in printed[0]
    summary = summary_of(tmp_path)
    assert summary["status"] == "hung" and summary["hung_rank"] == 2
    assert sorted(diagnosis["records"]) == [0, 1, 3]  # the stopped rank cannot answer
    assert_reruns(tmp_path, capfd, *PIPELINE_4)


# ============================================================ a rank skips one collective

PIPELINE_2_DATA_2 = ["strategy=modular_pipeline", "strategy.pipeline_degree=2", "strategy.data_degree=2",
                     "hardware.devices_per_node=4"]


def skip_one_all_reduce(monkeypatch, rank: int, step: int) -> None:
    """Test-only fault: on `rank`, the first data-group all-reduce of step `step` is never issued
    (the communicator's own method is wrapped in the forked ranks; library code is untouched)."""
    from parallel.comm import Communicator
    original = Communicator.all_reduce
    skipped = []

    def all_reduce(self, tensor, group, *arguments, **keywords):
        recorder = self.recorder
        if (os.environ.get("RANK") == str(rank) and group.name == "data" and not skipped
                and recorder is not None and recorder.step == step):
            skipped.append(True)
            return None
        return original(self, tensor, group, *arguments, **keywords)
    monkeypatch.setattr(Communicator, "all_reduce", all_reduce)


def test_a_rank_that_skips_a_collective_is_named(tmp_path, monkeypatch, capfd):
    skip_one_all_reduce(monkeypatch, rank=3, step=3)
    error, elapsed, printed, diagnosis = hung_run(tmp_path, monkeypatch, capfd, *PIPELINE_2_DATA_2)
    report(tmp_path, elapsed, printed, error.exit_codes)
    assert error.rank == 3 and diagnosis["stuck_rank"] == 3
    assert error.exit_codes[0] == HUNG_EXIT_CODE and set(error.exit_codes) <= {HUNG_EXIT_CODE, -signal.SIGKILL}
    assert "never issued all_reduce" in printed[0]
    assert summary_of(tmp_path)["status"] == "hung"
    assert_reruns(tmp_path, capfd, *PIPELINE_2_DATA_2)


# ============================================================ a rank killed

def test_a_killed_rank_is_named(tmp_path, monkeypatch, capfd):
    add_callbacks(monkeypatch.setattr, StopSelf(rank=1, step=4, sig=signal.SIGKILL))
    start = time.monotonic()
    with pytest.raises(RankError) as failed:
        run(tmp_path, *PIPELINE_4)
    elapsed = time.monotonic() - start
    monkeypatch.undo()
    assert children() == []
    captured = capfd.readouterr().err.splitlines()
    printed = [line for line in captured if "failure diagnosis" in line]
    report(tmp_path, elapsed, printed, failed.value.exit_codes)
    assert failed.value.rank == 1 and "killed by signal 9" in printed[0]
    codes = failed.value.exit_codes
    assert codes[1] == -signal.SIGKILL and all(code != 0 for code in codes)
    assert summary_of(tmp_path)["status"] in ("hung", "failed")
    assert_reruns(tmp_path, capfd, *PIPELINE_4)


# ============================================================ a straggler

class Slow(pl.Callback):
    """Rank `rank`'s block sleeps `seconds` in each forward from step `step` on."""

    def __init__(self, rank: int, seconds: float):
        self.rank, self.seconds = rank, seconds

    def on_train_start(self, trainer, module):
        if trainer.global_rank == self.rank:
            block = next(iter(module.model.blocks.values()))
            block.register_forward_hook(lambda *_: time.sleep(self.seconds))


def test_a_slowed_rank_is_flagged_as_a_straggler(tmp_path, monkeypatch, capfd):
    add_callbacks(monkeypatch.setattr, Slow(rank=1, seconds=0.1))
    summary = run(tmp_path, "strategy=modular_pipeline", "trainer.straggler_window=3")
    printed = [line for line in capfd.readouterr().out.splitlines() if "straggler" in line]
    report(tmp_path, 0.0, printed)
    # rank 0 is never slower than 1.5x the median of two when rank 1 sleeps (the median is their mean)
    (flagged,) = summary["stragglers"]
    assert (flagged["rank"], flagged["node"], flagged["ratio"] > 1.5) == (1, 0, True)
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    column = rows[0].split(",").index("stragglers")
    flags = {int(row.split(",")[0]): row.split(",")[column] for row in rows[1:]}
    assert set(flags.values()) <= {"", "1"} and flags[flagged["first_step"]] == "1"
    assert len(printed) == 1 and "rank 1 (node 0)" in printed[0]


# ============================================================ the diagnosis alone

def operation(kind, sequence, ranks, peer=None, step=4, completed=None):
    return {"index": 1, "kind": kind, "group": "data" if peer is None else "pipeline", "ranks": ranks,
            "peer": peer, "bytes": 4, "sequence": sequence, "step": step, "action": None, "issued": 0.0,
            "completed": completed}


def record(waiting, issued_by_group, time_=100.0, waited=3.0, last=None):
    return {"step": 4, "time": time_, "waiting": {**waiting, "waited_s": waited}, "last_completed": last,
            "issued_by_group": issued_by_group}


def test_diagnosis_follows_waits_to_the_rank_that_skipped_and_to_a_silent_rank():
    # rank 0 blocked first in all-reduce #5 over (0, 1); rank 1 issued only 4 there and went on to
    # wait in a receive from rank 0 that rank 0 never sent: a cycle, and rank 1 skipped
    group = {"kind": "collective", "ranks": [0, 1], "peer": None}
    records = {0: record(operation("all_reduce", 5, [0, 1]), [{**group, "issued": 5}], waited=5.0),
               1: record(operation("receive", 2, [0, 1], peer=0), [{**group, "issued": 4}], waited=1.0)}
    verdict = diagnose(records, 2, {0: "alive", 1: "alive"})
    assert (verdict["stuck_rank"], verdict["cycle"]) == (1, True)
    assert "rank 1 never issued all_reduce #5" in verdict["paragraph"].lower()
    # rank 1 silent (stopped): rank 0 waits for it
    verdict = diagnose({0: records[0]}, 2, {0: "alive", 1: "stopped"})
    assert verdict["stuck_rank"] == 1 and "stopped (SIGSTOP" in verdict["paragraph"]


def test_straggler_needs_the_whole_window():
    detector = StragglerDetector(window=3)
    assert [detector.update(times) for times in ([1, 1, 2], [1, 1, 2], [1, 2, 1], [1, 1, 2], [1, 1, 2],
                                                 [1, 1, 2])] == [[], [], [], [], [], [2]]


def test_the_slurm_launcher_reads_this_job_s_diagnosis_only(tmp_path):
    from layerwise.cluster.slurm import hang_diagnosis
    (tmp_path / "hang").mkdir()
    (tmp_path / "hang" / "diagnosis.json").write_text(json.dumps({"stuck_rank": 2, "paragraph": "…"}))
    assert hang_diagnosis(tmp_path, since=0.0)["stuck_rank"] == 2
    assert hang_diagnosis(tmp_path, since=time.time() + 60) is None  # a previous job's


def test_a_stopped_ddp_rank_is_named_though_ddp_waits_outside_the_record(tmp_path, monkeypatch, capfd):
    # torch DDP's reducer waits on the all-reduce's future inside the backward: no recorded wait;
    # the watchdog sees the all-reduce in flight with nothing issued since
    add_callbacks(monkeypatch.setattr, StopSelf(rank=1, step=3))
    error, elapsed, printed, diagnosis = hung_run(tmp_path, monkeypatch, capfd, "strategy=ddp")
    report(tmp_path, elapsed, printed, error.exit_codes)
    assert error.rank == 1 and diagnosis["states"]["1"].startswith("stopped (SIGSTOP")
    assert "in flight" in printed[0]
    assert_reruns(tmp_path, capfd, "strategy=ddp")


def test_each_rank_records_its_waits_by_group_and_kind(tmp_path):
    """processes/rank-<k>.json ends with the run's waits by group and kind (parallel/flight.py `waits`):
    a 1-D tensor pair waits on every all-reduce of its grid (cost/traffic.py's count for the block
    and head), both ranks on the same number; a 2-stage pipeline's ranks wait on every receive of
    their plan. The seconds are measured, so only their sign is checked."""
    from layerwise.planning.inputs import shape_of, training_plan_of
    from cost.traffic import grid_collectives
    from strategies.schedule.ir import RECV_ACTIVATION, RECV_GRADIENT
    common = [*QUICK, "trainer.max_steps=3", "trainer.limit_val_batches=0", "trainer.val_check_interval=3",
              "trainer.collective_timeout_s=60"]
    tensor = compose_config(*common, "strategy=tp_1d", "strategy.tensor_grid=2")
    train(tensor, tmp_path / "tensor", validate(tensor))
    per_step = grid_collectives("1d", tensor.model.layers, True, shape_of(tensor))
    for rank in (0, 1):
        record = json.loads((tmp_path / "tensor" / "processes" / f"rank-{rank}.json").read_text())
        assert record["steps"] == 3 and record["pid"] > 0
        assert record["waits"]["tensor all_reduce"]["waits"] == 3 * per_step
        assert record["waits"]["tensor all_reduce"]["seconds"] > 0
    pipeline = compose_config(*common, "strategy=modular_pipeline")
    train(pipeline, tmp_path / "pipeline", validate(pipeline))
    plan = training_plan_of(pipeline)
    for rank, row in enumerate(plan.ranks):
        receives = sum(1 for action in row if action is not None and action.kind in (RECV_ACTIVATION, RECV_GRADIENT))
        record = json.loads((tmp_path / "pipeline" / "processes" / f"rank-{rank}.json").read_text())
        assert receives > 0 and record["waits"]["pipeline receive"]["waits"] == 3 * receives, record["waits"]


# ============================================================ the chain of timeouts (issue 54, defect 2)

@pytest.mark.parametrize("overrides, step_s, process_group_s", [
    ([], 60.0, 726.0),  # the cpu profile: 60 s, × 10 outside steady steps
    (["hardware=dgx_h100"], 600.0, 6666.0),  # every GPU profile: 600 s
    (["trainer.collective_timeout_s=5", "trainer.long_timeout_factor=3"], 5.0, 15 + 1 + 9 + 1 + 60),
    (["trainer.collective_timeout_s=0"], 60.0, 726.0),  # the watchdog off: the profile's bound stays
], ids=["cpu", "gpu", "custom", "off"])
def test_every_process_group_outlasts_the_watchdog_s_longest_allowance(overrides, step_s, process_group_s):
    """The backend's own timeout (NCCL's watchdog aborts the rank after it) is longer than the
    watchdog's longest allowance (first step, validation, checkpoints) plus the time its diagnosis
    takes, by PROCESS_GROUP_MARGIN_S: our paragraph is written before any rank is aborted."""
    from layerwise.run.timeouts import PROCESS_GROUP_MARGIN_S, run_timeout_chain
    cfg = compose_config(*overrides)
    chain = run_timeout_chain(cfg)
    assert (chain.step_s, chain.process_group_s) == (step_s, process_group_s)
    assert chain.long_s == step_s * cfg.trainer.long_timeout_factor
    assert chain.process_group_s - PROCESS_GROUP_MARGIN_S >= chain.long_s + chain.poll_s + chain.answers_s


class GroupTimeouts(pl.Callback):
    """Each rank writes the backend timeout of every process group it holds (torch's own list,
    distributed_c10d._world.pg_map: the world, the layout's groups and any other) at fit start."""

    def __init__(self, directory: Path):
        self.directory = directory

    def on_fit_start(self, trainer, module):
        import torch
        import torch.distributed as dist
        held = {}
        for group in dist.distributed_c10d._world.pg_map:
            timeout = group._get_backend(torch.device("cpu")).options._timeout
            held[",".join(map(str, dist.get_process_group_ranks(group)))] = timeout.total_seconds()
        layout = [",".join(map(str, g.ranks)) for g in trainer.strategy.layout.groups.values()
                  if g is not None and g.process_group is not None]
        (self.directory / f"groups-{trainer.global_rank}.json").write_text(json.dumps(
            {"held": held, "layout": layout}))


def test_the_world_and_every_subgroup_get_the_chain_s_timeout(tmp_path, monkeypatch):
    """A 2-D tensor grid on 4 gloo ranks (the world, its rows and columns, the tensor axis): every
    group any rank holds reads back the chain's process-group timeout, not 300 s nor torch's default."""
    from layerwise.run.timeouts import run_timeout_chain
    add_callbacks(monkeypatch.setattr, GroupTimeouts(tmp_path))
    overrides = [*QUICK, "trainer.max_steps=1", "trainer.val_check_interval=1", "trainer.limit_val_batches=0",
                 "strategy=tp_2d", "strategy.tensor_grid=2", "hardware.devices_per_node=4",
                 "trainer.collective_timeout_s=7"]
    cfg = compose_config(*overrides)
    train(cfg, tmp_path / "run", validate(cfg))
    expected = run_timeout_chain(cfg).process_group_s
    for rank in range(4):
        found = json.loads((tmp_path / f"groups-{rank}.json").read_text())
        assert len(found["held"]) >= 3 and set(found["layout"]) <= set(found["held"]), found
        assert set(found["held"].values()) == {expected}, found


# ============================================================ NCCL's early wait() (issue 54, defect 3)

class Witness(Watchdog):
    """The run's watchdog, except that when it fires it keeps its record for the test instead of
    writing files and ending the process."""

    verdict = None

    def _hung(self, reason: str) -> None:
        self.fired = True
        self.verdict = {"reason": reason, **self.record(reason)}
        (self.run_directory / f"named-by-rank-{self.rank}").touch()  # the late peer may come now


def late_peer_on_fake_nccl(rank: int, directory: Path, late_s: float, recorded_sync: bool) -> dict:
    """Rank 1 computes `late_s`, and until rank 0's watchdog has named the wait, before its all-reduce
    (an order, not a race: however the machine is loaded, rank 0 waits past its allowance); rank 0
    issues its own at once, on emulated NCCL (tests/fake_nccl.py): the synchronous call returns at
    once, and the host blocks later, in a sync of the compute stream — one that says so to the
    flight record, or one nobody records."""
    import torch
    import torch.distributed as dist
    from parallel.comm import Communicator, Group
    from tests import fake_nccl
    stream = fake_nccl.install()
    dist.init_process_group(fake_nccl.BACKEND)
    communicator, recorder = Communicator(), FlightRecorder(16, stream)
    communicator.recorder, recorder.phase = recorder, "step"
    watchdog = Witness(recorder, rank, 2, directory, timeout_chain(0.5, 1.0), {})
    watchdog.start()
    tensor, started = torch.ones(4), time.perf_counter()
    if rank == 1:
        time.sleep(late_s)  # its compute
        deadline = time.monotonic() + 120  # a bound, so a broken watchdog fails the test, not hangs it
        while not (directory / "named-by-rank-0").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    communicator.all_reduce(tensor, Group("world", (0, 1), dist.group.WORLD))
    returned_s = time.perf_counter() - started
    if recorded_sync:
        with recorder.synchronizing():  # as StepTimer's, the exchange's .tolist(), the scaler's .item()
            stream.synchronize()
    else:
        stream.synchronize()
    step_s = time.perf_counter() - started
    watchdog.stop()
    return {"returned_s": returned_s, "step_s": step_s, "compute_s": step_s - recorder.take_blocked(),
            "sum": tensor.tolist(), "waits": recorder.waits(), "verdict": watchdog.verdict}


@pytest.mark.parametrize("recorded_sync", [False, True], ids=["unrecorded_sync", "recorded_sync"])
def test_a_rank_waiting_on_emulated_nccl_is_seen_and_its_wait_counted(tmp_path, recorded_sync):
    """NCCL's wait() returns before the collective ran; the flight record still (1) keeps the
    all-reduce in flight until the work completes, so the watchdog names it while the host blocks
    in a later sync (as in flight when nobody recorded the sync, as the current wait when the sync
    says so), and (2) counts the time the stream waited for the late peer, so the late rank is
    the straggler, not the one that waited for it."""
    from tests.ranks import run_on_ranks
    late_s = 2.0
    early, late = run_on_ranks(late_peer_on_fake_nccl, 2, tmp_path, late_s, recorded_sync)
    assert early["sum"] == [2.0] * 4 and early["returned_s"] < early["step_s"] / 2  # NCCL-like: wait returned
    verdict = early["verdict"]
    assert verdict is not None and late["verdict"] is None, (early, late)
    waiting = verdict["waiting"]
    assert (waiting["kind"], waiting["group"], waiting["sequence"]) == ("all_reduce", "world", 1)
    assert bool(waiting.get("in_flight")) is not recorded_sync
    # the wait is counted where the stream waited: rank 0 waited for nearly all of rank 1's compute
    assert early["waits"]["world all_reduce"]["seconds"] >= 0.5, early["waits"]  # the allowance it outlasted
    assert StragglerDetector(window=1).update([early["compute_s"], late["compute_s"]]) == [1], (early, late)


# ============================================================ NCCL's own flight recorder (issue 54, defect 5)

def test_nccl_s_flight_recorder_dumps_into_a_folder_made_at_fit_start_named_by_the_known_rank(tmp_path, monkeypatch):
    """On a GPU profile the dump folder exists before any watchdog fires (NCCL's own watchdog may
    dump first, into an existing folder only), and our dump is named by the global rank the trainer
    knows, not by RANK, which srun does not set. torch's CPU build has no NCCL dump: a stand-in
    returns the bytes NCCL would."""
    import torch.distributed as dist
    from layerwise.run.hangs import dump_nccl_trace, hang_directory, nccl_flight_recorder_environment
    cfg = compose_config("hardware=dgx_h100")
    environment = nccl_flight_recorder_environment(cfg, tmp_path)
    assert hang_directory(tmp_path).is_dir()  # made now, at fit start
    assert environment["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(hang_directory(tmp_path) / "nccl_trace_rank_")
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("RANK", raising=False)  # as under srun
    monkeypatch.setattr(dist.distributed_c10d, "_dump_nccl_trace", lambda: b"trace of rank 5", raising=False)
    dump_nccl_trace(5)
    assert (hang_directory(tmp_path) / "nccl_trace_rank_5").read_bytes() == b"trace of rank 5"
    assert nccl_flight_recorder_environment(compose_config(), tmp_path / "cpu") == {}  # gloo: none
    assert not hang_directory(tmp_path / "cpu").exists()
