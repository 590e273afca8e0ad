"""ZB-H2 (Qi et al. 2023 §3.1): the zero-bubble schedule that spends (2p−1)× a stage's stash.

Equality with `single` (AdamW and SGD) lives with the other pipelines (tests/test_modular_pipeline.py,
cases zero_bubble_h2_*), the executed order with theirs (tests/test_executed_order.py). Here: the
simulated bubble against the paper's formula, the plan's and a real run's peak micro-batches in
flight against 1F1B's, and the constraint on m. Ids: pp{p}_m{m} = p pipeline ranks, m micro-batches.
"""

import pytest

from cost.memory import in_flight
from layerwise.config.errors import ConfigError
from layerwise.preflight import validate
from strategies.schedule import (BACKWARD_INPUT, FORWARD, Plan, add_communication, add_gradient_reductions,
                                 build_plan, flop_cost, simulate, validate_plan)
from tests.ranks import QUICK, compose_config, run_on_ranks
from tests.test_zero_bubble import alive_by_rank, waiting_for_w

EQUAL_TIMES = flop_cost(1.0, 1.0, backward_factor=2.0)  # T_F = T_B = T_W = 1: F = 1, I = W = 1


def built(schedule: str, pipeline: int, micro_batches: int, breadth_first=None) -> Plan:
    return validate_plan(add_gradient_reductions(add_communication(build_plan(
        schedule, pipeline_degree=pipeline, stages=pipeline, micro_batches=micro_batches,
        breadth_first_micro_batches=breadth_first))))


def idle(timeline, work: float) -> tuple[float, float]:
    """(makespan − work: each rank's idle time with a synchronous optimizer step; the longest span from
    a rank's first compute start to its last compute end, minus work: the idle per iteration when
    iterations follow each other with the step's synchronisation bypassed, as Qi et al. 2023 §4 count)."""
    spans = [max(r.end for r in row if r.action.info.is_compute) - min(r.start for r in row if r.action.info.is_compute)
             for row in timeline.ranks]
    return timeline.makespan - work, max(spans) - work


def test_simulated_bubble_against_the_papers_formula():
    """T_F = T_B = T_W = 1. Qi et al. 2023 Table 1: 1F1B (p−1)(T_F+T_B+T_W) = 3(p−1), ZB-H1
    (p−1)(T_F+T_B−T_W) = p−1, ZB-H2 (p−1)(T_F+T_B−2T_W) = 0. Their count is per iteration with the
    step's synchronisation bypassed (the span of each rank's work); ZB-H2's Ws at the tail make it a
    parallelogram, so every rank works without a gap from its first input on. With a synchronous step
    the last rank still waits p−1 forwards for its first input: ZB-H2's makespan idle is that bound,
    p−1, which ZB-H1 already reaches at equal times. p = 8, m = 8 is refused (m < 2p − 1)."""
    print("\n  p   m  1F1B sync/span (formula)  ZB-H1 sync/span (formula)  ZB-H2 sync/span (formula)"
          "  bubble fraction 1F1B ZB-H1 ZB-H2  peak in flight 1F1B ZB-H2")
    for pipeline in (4, 8):
        for micro_batches in (8, 16, 32):
            if micro_batches < 2 * pipeline - 1:
                with pytest.raises(ValueError, match="needs strategy.micro_batches"):
                    built("zero_bubble_h2", pipeline, micro_batches)
                print(f"{pipeline:3} {micro_batches:3}  ZB-H2 refused: m < 2p − 1 = {2 * pipeline - 1}")
                continue
            work = 3 * micro_batches
            plans = {name: built(name, pipeline, micro_batches) for name in ("one_f_one_b", "zero_bubble_h1",
                                                                             "zero_bubble_h2")}
            timelines = {name: simulate(plan, EQUAL_TIMES) for name, plan in plans.items()}
            (a, b), (c, d), (e, f) = (idle(timelines[name], work) for name in plans)
            peaks = {name: max(in_flight(row) for row in plan.ranks) for name, plan in plans.items()}
            print(f"{pipeline:3} {micro_batches:3}  {a:4g}/{b:4g} ({3 * (pipeline - 1):2})"
                  f"           {c:4g}/{d:4g} ({pipeline - 1:2})            {e:4g}/{f:4g} ( 0)"
                  f"                  {timelines['one_f_one_b'].bubble_fraction:.4f} "
                  f"{timelines['zero_bubble_h1'].bubble_fraction:.4f} {timelines['zero_bubble_h2'].bubble_fraction:.4f}"
                  f"                {peaks['one_f_one_b']:2} {peaks['zero_bubble_h2']:2}")
            assert (a, b) == (3 * (pipeline - 1),) * 2 and (c, d) == (pipeline - 1,) * 2
            assert (e, f) == (pipeline - 1, 0)
            assert peaks["one_f_one_b"] == pipeline and peaks["zero_bubble_h2"] == 2 * pipeline - 1


def test_warm_up_and_memory_follow_the_paper():
    """Rank r runs 2(p−1−r)+1 forwards before its first I (1F1B: p−r); every rank holds at most 2p−1
    micro-batches between F and W (Qi et al. 2023 Table 1: (2p−1)M_B), and each rank reaches it."""
    for pipeline in (1, 2, 3, 4):
        for micro_batches in (2 * pipeline - 1, 2 * pipeline, 9):
            plan = built("zero_bubble_h2", pipeline, micro_batches)
            for rank, row in enumerate(plan.ranks):
                computed = [a for a in row if a is not None and a.kind in (FORWARD, BACKWARD_INPUT)]
                first = next(i for i, a in enumerate(computed) if a.kind == BACKWARD_INPUT)
                assert first == 2 * (pipeline - 1 - rank) + 1, (pipeline, micro_batches, rank)
                assert in_flight(row) == 2 * pipeline - 1
    built("zero_bubble_h2", 4, 16, breadth_first=8)  # depth-first groups: each has its own warm-up


def test_fewer_micro_batches_than_the_warm_up_are_refused_before_launch():
    with pytest.raises(ConfigError, match=r"zero_bubble_h2 needs strategy.micro_batches \(2\) >= 2 × "
                                          r"strategy.pipeline_degree − 1 = 3"):
        validate(compose_config(*QUICK, "model.layers=4", "strategy=one_f_one_b", "strategy.schedule=zero_bubble_h2",
                                "strategy.micro_batches=2"))
    with pytest.raises(ConfigError, match=r"strategy.breadth_first_micro_batches \(2\) >= 2 × "):
        validate(compose_config(*QUICK, "model.layers=4", "strategy=one_f_one_b", "strategy.schedule=zero_bubble_h2",
                                "strategy.micro_batches=4", "strategy.breadth_first_micro_batches=2"))


def measured_peaks(schedule: str, micro_batches: int) -> list:
    cfg = compose_config(*QUICK, "strategy=one_f_one_b", f"strategy.schedule={schedule}", "model.layers=4",
                         f"strategy.micro_batches={micro_batches}", f"data.global_batch_size={micro_batches}",
                         "model.dropout=0.0")
    peaks = [steps[-1] for steps in run_on_ranks(alive_by_rank, validate(cfg), cfg)]
    assert [graphs for graphs, _ in peaks] == [in_flight(row) for row in built(schedule, 2, micro_batches).ranks]
    return peaks


def test_measured_activation_memory_is_twice_one_f_one_bs():
    """p = 2, 4 blocks, real runs at m = 4 and m = 16: on each rank the most micro-batches kept (graphs
    between F and W) is the plan's in-flight count, 2p − 1 = 3 on both ranks whatever m (1F1B: 2 and
    1, whatever m: tests/test_zero_bubble.py). Rank 0's saved-activation bytes are that count × 1F1B's
    stash per micro-batch: (2p−1)/p = 1.5× 1F1B's peak rank at p = 2, → 2× as p grows; the last rank,
    which 1F1B lets keep one, keeps 3, two of them past I (without their loss's tensors), the same
    bytes whatever m."""
    one_f_one_b = measured_peaks("one_f_one_b", 4)
    assert [graphs for graphs, _ in one_f_one_b] == [2, 1]
    past_input = set()
    for micro_batches in (4, 16):
        zero_bubble = measured_peaks("zero_bubble_h2", micro_batches)
        ratios = [round(saved / one_saved, 3) for (_, saved), (_, one_saved) in zip(zero_bubble, one_f_one_b)]
        print(f"\nm={micro_batches}: per rank (most micro-batches kept, most saved-activation bytes alive): "
              f"1F1B (m=4) {one_f_one_b}, ZB-H2 {zero_bubble}; ZB-H2 / 1F1B bytes per rank {ratios}")
        assert [graphs for graphs, _ in zero_bubble] == [3, 3]
        (graphs, saved), (one_graphs, one_saved) = zero_bubble[0], one_f_one_b[0]
        assert saved / graphs == one_saved / one_graphs  # rank 0: the same stash per micro-batch
        past_input.add(waiting_for_w(zero_bubble[1], one_f_one_b[1], tokens=32))
    assert len(past_input) == 1, past_input
