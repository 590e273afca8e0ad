"""Evidence that costs nothing when it is not measuring (docs/evidence.md, "Sampled steps").

The compute-memory meter runs only on sampled steps: the first WARM_UP_MEASURED_STEPS after start or
resume, every trainer.measure_every_n_steps, and the last; a pipeline's gathered timeline on those and on
the step after each, which the meter leaves alone (its bubble is the one reported: evidence.is_timed_step).
Every step issues exactly one collective for its evidence (loss, times, bytes, calls, peaks).
"""

import csv
import json

import pytest

import torch.distributed as dist

from layerwise.run.evidence import RunEvidence, is_measured_step
from layerwise.run.fit import fit_rank, train
from layerwise.preflight import validate
from tests.ranks import QUICK, compose_config, run_on_ranks

# Everything torch.distributed offers that involves every rank of a group (sends are not collectives),
# under the names of every torch we accept: those this torch lacks are skipped (2.11, 2.12 have no *_single;
# parallel/compat.py calls whichever it has, so a call is counted once either way).
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "all_gather_object",
               "broadcast", "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor",
               "reduce_scatter_single", "gather", "gather_object", "scatter", "scatter_object_list",
               "all_to_all", "all_to_all_single", "barrier", "monitored_barrier")


def overrides(steps: int, every: int, *extra) -> list:
    return [*QUICK, f"trainer.max_steps={steps}", f"trainer.measure_every_n_steps={every}",
            "trainer.val_check_interval=100", *extra]


def metrics(directory):
    with (directory / "metrics.csv").open() as handle:
        return list(csv.DictReader(handle))


def measured_steps(rows) -> list:
    return [int(row["step"]) for row in rows if row["memory_measured"] == "1"]


def test_sampling_rule():
    # warm-up (first 2 of this process), every 4th, the last (10)
    assert [s for s in range(1, 11) if is_measured_step(s, s - 1, 4, 10)] == [1, 2, 4, 8, 10]
    # after a resume at step 5: steps 6 and 7 are the process's first two
    assert [s for s in range(6, 11) if is_measured_step(s, s - 6, 100, 10)] == [6, 7, 10]
    assert [s for s in range(1, 6) if is_measured_step(s, s - 1, 0, 5)] == [1, 2, 5]


def test_meter_runs_on_sampled_steps_only(tmp_path):
    cfg = compose_config(*overrides(6, 4, "strategy=single"))
    summary = train(cfg, tmp_path, validate(cfg))
    rows = metrics(tmp_path)
    assert measured_steps(rows) == [1, 2, 4, 6]
    assert all(float(row["peak_compute_bytes"]) > 0 for row in rows if row["memory_measured"] == "1")
    assert all(row["peak_compute_bytes"] == "" for row in rows if row["memory_measured"] == "0")
    assert summary["peak_compute_bytes"] == max(float(row["peak_compute_bytes"]) for row in rows
                                                if row["memory_measured"] == "1")
    assert summary["precision"] == "32-true"  # read from the sampled steps' matrix products
    assert summary["comm_calls_per_step"] == 0 and {row["comm_calls"] for row in rows} == {"0"}
    # the speeds are the unmetered steps' (3 and 5): the meter's dispatch mode slows the step it watches
    unmetered = sorted(float(row["step_time_s"]) for row in rows if row["memory_measured"] == "0")
    assert summary["step_time_s_median"] == pytest.approx(sum(unmetered) / 2, rel=1e-6)


def test_a_resumed_run_measures_its_first_steps_again(tmp_path):
    first = compose_config(*overrides(5, 100, "strategy=single"))
    train(first, tmp_path, 1)
    resumed = compose_config(*overrides(9, 100, "strategy=single"))
    summary = train(resumed, tmp_path, 1)
    assert summary["steps"] == 9
    assert measured_steps(metrics(tmp_path)) == [1, 2, 5, 6, 7, 9]


def fit_counting_collectives(rank, cfg, directory, world):
    """fit_rank, with every torch.distributed collective named as it is called, grouped by
    training step (from the evidence callback's step start to the end of its step end)."""
    steps, calls = [], []

    def counted(name, original):
        def call(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)
        return call
    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, counted(name, getattr(dist, name)))
    start, end = RunEvidence.on_train_batch_start, RunEvidence.on_train_batch_end

    def on_start(self, trainer, *args):
        calls.clear()
        start(self, trainer, *args)

    def on_end(self, trainer, *args):
        end(self, trainer, *args)
        steps.append(sorted(calls))
    RunEvidence.on_train_batch_start, RunEvidence.on_train_batch_end = on_start, on_end
    fit_rank(rank, cfg, directory, world)
    return steps


def test_one_evidence_collective_per_step_and_timelines_on_timed_steps(tmp_path):
    """pp2: a step's training traffic is the loss broadcast (comm_calls = 1); the evidence adds one
    all-gather of its numbers, and the pipeline's record gather on timed steps only: the sampled
    ones (1, 2, 4, 8) and the step after each (3, 5), which the meter leaves alone."""
    cfg = compose_config(*overrides(8, 4, "strategy=modular_pipeline", "model.layers=4",
                                    "strategy.pipeline_degree=2", "trainer.limit_val_batches=0"))
    steps_by_rank = run_on_ranks(fit_counting_collectives, 2, cfg, tmp_path, 2)
    rows = metrics(tmp_path)
    assert measured_steps(rows) == [1, 2, 4, 8]
    assert [row["comm_calls"] for row in rows] == ["1"] * 8
    for steps in steps_by_rank:
        # the evidence's one gather per step is the list form (all_gather), which independent
        # counters of training traffic (tests/test_zero_layered.py) do not wrap
        expected = [["all_gather", "all_gather_object", "broadcast"] if step in (1, 2, 3, 4, 5, 8)
                    else ["all_gather", "broadcast"] for step in range(1, 9)]
        assert steps == expected
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert 0 <= summary["bubble_fraction"]["measured"] < 1 and summary["comm_calls_per_step"] == 1
    order = json.loads((tmp_path / "schedule.json").read_text())
    assert order["executed_last_step"] == order["plan"]


def test_rows_carry_their_own_step_numbers_however_often_the_exchange_is_read(tmp_path, monkeypatch):
    """Each row is completed by the NEXT step's exchange; a reader of the current step's exchange
    after the step's end (the Slurm preemption check, the guard of strategies that update inside
    their own step) must not complete the row just ended with the previous step's numbers."""
    import lightning.pytorch as pl

    import layerwise.run.fit
    reads, build = [], layerwise.run.fit.build_trainer

    class LateReader(pl.Callback):
        def __init__(self, evidence):
            self.evidence = evidence

        def on_train_batch_end(self, trainer, *args):
            reads.append(self.evidence.world_loss_sum(trainer))

    def build_with_reader(cfg, run_directory, world_size, strategy, evidence):
        trainer = build(cfg, run_directory, world_size, strategy, evidence)
        trainer.callbacks.append(LateReader(evidence))
        return trainer
    monkeypatch.setattr(layerwise.run.fit, "build_trainer", build_with_reader)
    cfg = compose_config(*overrides(5, 2, "strategy=single"))
    summary = train(cfg, tmp_path, validate(cfg))
    rows = metrics(tmp_path)
    assert [int(row["step"]) for row in rows] == [1, 2, 3, 4, 5] and reads == summary["losses"]
    # sampled steps (1, 2, 4, 5) carry a measured peak, the others none: a row completed with its
    # neighbour's numbers would break the pattern
    assert [row["peak_compute_bytes"] != "" for row in rows] == [True, True, False, True, True]
    assert all(float(row["step_time_s"]) > 0 for row in rows)
