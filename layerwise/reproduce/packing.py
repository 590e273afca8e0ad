"""PipeFisher's packing on the FLOP cost model: K-FAC work / bubble, k, fill and packing efficiency.

One BERT-Base block per stage (h = 768, s = 128, micro-batch 32), p = m = 8, looped breadth-first
holding v = 2 blocks per rank; V100 fp32 FLOP rate (it cancels in every ratio). The claim's table
(reproduce/pipefisher.py) and benchmarks/pipefisher_packing.py (which also draws the cycles) read it.
"""

import math
import statistics

from strategies.schedule import add_communication, add_gradient_reductions, build_plan, simulate
from strategies.schedule import curvature as units

BERT_BASE = units.BlockShape(hidden=768, mlp_ratio=4, sequence_length=128, tokens=32 * 128)
V100_FP32 = 15.7e12  # FLOP/s
SCHEDULES = {"gpipe": 8, "one_f_one_b": 8, "looped_breadth_first": 16}  # schedule -> stages


def packed_cycle(schedule: str, stages: int, cost):
    """One schedule's plan and its K-FAC cycle packed into the bubbles (checked)."""
    plan = add_gradient_reductions(add_communication(build_plan(schedule, pipeline_degree=8, stages=stages,
                                                                micro_batches=8)))
    cycle = units.pack(plan, cost)
    units.check_cycle(plan, cycle.plans)
    return plan, cycle


def row(schedule: str, stages: int, cost) -> dict:
    """The figures of the packing table for one schedule."""
    plan, cycle = packed_cycle(schedule, stages, cost)
    with_kfac = statistics.mean(simulate(step_plan, cost).bubble_fraction for step_plan in cycle.plans)
    return {"schedule": schedule, "bubble": simulate(plan, cost).bubble_fraction, "ratio": cycle.ratio,
            "k": cycle.refresh_interval, "ceil": math.ceil(cycle.ratio), "fill": cycle.fill,
            "fill_before_last": cycle.fill_before_last, "packing": cycle.packing, "with_kfac": with_kfac,
            "split": "+".join(cycle.report()["split_in_token_halves"])}


def table_rows() -> list:
    """Every schedule's row, on the V100 FLOP model."""
    cost = units.pipefisher_cost(BERT_BASE, flops_per_second=V100_FP32)
    return [row(schedule, stages, cost) for schedule, stages in SCHEDULES.items()]
