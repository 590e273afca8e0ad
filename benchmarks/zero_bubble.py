"""Measured vs simulated bubble of the split-backward schedules on CPU ranks (issue 32 item 4).

    .venv/bin/python benchmarks/zero_bubble.py            # 4 ranks, gpt_tiny with 8 blocks, m = 8
    .venv/bin/python benchmarks/zero_bubble.py --ranks 4 --micro-batches 8 --steps 8

Trains the same model under 1F1B, ZB-H1 and ZBV (strategy=modular_pipeline, the schedule set;
ZBV's V holds two stages of one block per rank) with `python train.py`, one run after another, and
prints per schedule, side by side:
  measured          summary.json's bubble_fraction.measured: idle compute time over makespan × ranks
                    of the executed steps the run samples (strategies/modular_pipeline.py `_record`);
  simulated (unit)  its bubble_fraction.simulated: the plan at T_F = 1, T_B = 2, T_I = T_W = 1;
  simulated (meas.) the same plan timed with the run's own durations: each (kind, stage)'s median
                    over the executed last step (schedule.json), transfers free — the bubble the
                    schedule leaves with these T_F, T_B, T_I, T_W;
and the measured T_F, T_I, T_W (ms, a middle stage) and median step seconds. With more ranks than
cores (this machine has 2) a waiting rank frees its core for a busy one, so a compute action's time
includes its wait for a core: a measured bubble here is idle time, not lost throughput; the machine
is shared, so the figures move from run to run.
"""

import argparse
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from layerwise.tools.gpu_check import run_train_py  # noqa: E402
from strategies.schedule import (add_communication, add_gradient_reductions, build_plan, parse_action,  # noqa: E402
                                 simulate)

LAYERS = 8
SCHEDULES = {"one_f_one_b": 1, "zero_bubble_h1": 1, "zbv": 2}  # schedule -> stages per rank


def overrides(schedule: str, ranks: int, micro_batches: int, steps: int) -> list:
    per_stage = LAYERS // (SCHEDULES[schedule] * ranks)
    return ["hardware=cpu", "hardware.nodes=1", f"hardware.devices_per_node={ranks}", "hardware.precision=32-true",
            "model=gpt_tiny", f"model.layers={LAYERS}", "strategy=modular_pipeline", f"strategy.schedule={schedule}",
            f"strategy.pipeline_degree={ranks}", f"strategy.layers_per_stage={per_stage}",
            f"strategy.micro_batches={micro_batches}", f"data.global_batch_size={2 * micro_batches}",
            "data.sequence_length=128", "data.max_bytes=4000000", f"trainer.max_steps={steps}",
            "trainer.val_check_interval=1000", "trainer.limit_val_batches=1", "trainer.checkpoint_every_n_steps=1000",
            "logger=none", "trainer.progress=none", "resume=false"]


def measured_durations(schedule_json: dict) -> dict:
    """(kind, stage) -> median seconds of the compute actions of the executed last step."""
    durations = defaultdict(list)
    for row in schedule_json["executed_last_step_seconds"]:
        for name, start, end in row:
            action = parse_action(name)
            if action.info.is_compute:
                durations[action.kind, action.stage].append(end - start)
    return {key: statistics.median(values) for key, values in durations.items()}


def simulated_with(durations: dict, schedule: str, ranks: int, micro_batches: int) -> float:
    """The plan's bubble with the measured compute times (free transfers and reductions)."""
    plan = add_gradient_reductions(add_communication(build_plan(
        schedule, pipeline_degree=ranks, stages=SCHEDULES[schedule] * ranks, micro_batches=micro_batches)))
    return simulate(plan, lambda action: durations.get((action.kind, action.stage), 0.0)).bubble_fraction


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    arguments = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for schedule in SCHEDULES:
            run_directory = Path(directory) / schedule
            run_directory.mkdir()
            summary = run_train_py(overrides(schedule, arguments.ranks, arguments.micro_batches, arguments.steps),
                                   run_directory)
            if summary.get("status") != "completed":
                raise SystemExit(f"{schedule} failed: {summary.get('error')}")
            durations = measured_durations(json.loads((run_directory / "schedule.json").read_text()))
            middle = 1  # a middle stage: no embedding, no head
            times = {kind: durations.get((kind, middle), float("nan")) * 1e3
                     for kind in ("FORWARD", "BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT")}
            rows.append((schedule, summary["bubble_fraction"]["measured"], summary["bubble_fraction"]["simulated"],
                         simulated_with(durations, schedule, arguments.ranks, arguments.micro_batches),
                         times, summary["step_time_s_median"]))
            print(f"[zero_bubble] {schedule}: done", flush=True)
    print(f"{arguments.ranks} ranks, gpt_tiny × {LAYERS} blocks, {arguments.micro_batches} micro-batches of 2 × 128 "
          f"tokens, {arguments.steps} steps (a shared 2-core machine: figures move between runs)")
    print(f"{'schedule':16s} {'measured':>9s} {'sim. unit':>10s} {'sim. meas. T':>13s}   "
          f"{'T_F ms':>7s} {'T_B ms':>7s} {'T_I ms':>7s} {'T_W ms':>7s} {'step s':>7s}")
    for schedule, measured, unit, timed, times, step in rows:
        print(f"{schedule:16s} {measured:9.3f} {unit:10.3f} {timed:13.3f}   {times['FORWARD']:7.1f} "
              f"{times['BACKWARD']:7.1f} {times['BACKWARD_INPUT']:7.1f} {times['BACKWARD_WEIGHT']:7.1f} {step:7.3f}")


if __name__ == "__main__":
    main()
