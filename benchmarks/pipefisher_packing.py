"""PipeFisher's packing, simulated: K-FAC work / bubble, k, fill and packing efficiency per schedule.

    .venv/bin/python benchmarks/pipefisher_packing.py

FLOP cost model (V100 fp32 rate; it cancels in every ratio), one BERT-Base block per stage
(h = 768, s = 128, micro-batch 32), p = m = 8; looped breadth-first holds v = 2 blocks per rank.
Prints one table row per schedule and draws the GPipe and 1F1B cycles (K-FAC units in magenta)
as docs/strategies/pipefisher_{schedule}_bert_base.png. Pure simulation: seconds on one core.
"""

import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strategies.schedule import (add_communication, add_gradient_reductions, build_plan,  # noqa: E402
                                 plot_timeline, simulate)
from strategies.schedule import curvature as units  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BERT_BASE = units.BlockShape(hidden=768, mlp_ratio=4, sequence_length=128, tokens=32 * 128)
V100_FP32 = 15.7e12  # FLOP/s
SCHEDULES = {"gpipe": 8, "one_f_one_b": 8, "looped_breadth_first": 16}  # schedule -> stages
DRAWN = ("gpipe", "one_f_one_b")


def row(schedule: str, stages: int, cost, drawn=DRAWN) -> dict:
    """Pack one schedule's plan; the figures of the docs' table (and its chart if in `drawn`)."""
    plan = add_gradient_reductions(add_communication(build_plan(schedule, pipeline_degree=8, stages=stages,
                                                                micro_batches=8)))
    cycle = units.pack(plan, cost)
    units.check_cycle(plan, cycle.plans)
    with_kfac = statistics.mean(simulate(step_plan, cost).bubble_fraction for step_plan in cycle.plans)
    if schedule in drawn:
        draw(schedule, cycle, cost)
    return {"schedule": schedule, "bubble": simulate(plan, cost).bubble_fraction, "ratio": cycle.ratio,
            "k": cycle.refresh_interval, "ceil": math.ceil(cycle.ratio), "fill": cycle.fill,
            "fill_before_last": cycle.fill_before_last, "packing": cycle.packing, "with_kfac": with_kfac,
            "split": "+".join(cycle.report()["split_in_token_halves"])}


def draw(schedule: str, cycle, cost) -> None:
    path = ROOT / "docs" / "strategies" / f"pipefisher_{schedule}_bert_base.png"
    title = (f"PipeFisher {schedule}, BERT-Base block per stage, p = m = 8: k = {cycle.refresh_interval} "
             f"(magenta: K-FAC units; steps laid end to end)")
    plot_timeline(units.cycle_timeline(cycle.plans, cost), path, title=title, time_unit="s (V100 fp32 FLOP model)")
    print(f"wrote {path.relative_to(ROOT)}")


def main() -> None:
    cost = units.pipefisher_cost(BERT_BASE, flops_per_second=V100_FP32)
    rows = [row(schedule, stages, cost) for schedule, stages in SCHEDULES.items()]
    print("| schedule | bubble (plan) | K-FAC work / bubble | k | ceil(ratio) | filled, whole cycle | "
          "filled, steps before the last | packing efficiency | bubble with K-FAC | split in token halves |")
    for r in rows:
        print(f"| {r['schedule']} | {r['bubble']:.1%} | {r['ratio']:.2f} | {r['k']} | {r['ceil']} | {r['fill']:.1%} | "
              f"{r['fill_before_last']:.1%} | {r['packing']:.1%} | {r['with_kfac']:.1%} | {r['split']} |")


if __name__ == "__main__":
    main()
