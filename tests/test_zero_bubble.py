"""Zero-bubble pipelines (issue 32): the split backward (I + W) in the schedule IR, ZB-H1 and ZBV.

Equality with `single` lives with the other pipelines (tests/test_modular_pipeline.py, cases
zero_bubble_h1_*, zbv_*), the executed order with theirs (tests/test_executed_order.py). Here: the
simulated bubble against the paper's formula, the validator's rules for I and W, the peak number of
micro-batches in flight (plan and real run) against 1F1B's, and the errors for what is unsupported.
Ids: pp{p}_m{m} = p pipeline ranks, m micro-batches.
"""

import os
import weakref

import pytest

from cost.memory import in_flight
from layerwise.config.errors import ConfigError
from layerwise.preflight import validate
from strategies.schedule import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action, Plan, PlanError,
                                 add_communication, add_gradient_reductions, build_plan, flop_cost, simulate,
                                 validate_plan)
from tests.ranks import QUICK, compose_config, run_on_ranks

# T_F = T_B = T_W = 1 (Qi et al. 2023 §3.1): F = 1, I = W = 1, a fused B = I + W = 2.
EQUAL_TIMES = flop_cost(1.0, 1.0, backward_factor=2.0)
HALF_STAGES = flop_cost(0.5, 1.0, backward_factor=2.0)  # ZBV: 2p stages of half the layers


def built(schedule: str, pipeline: int, micro_batches: int) -> Plan:
    stages = 2 * pipeline if schedule == "zbv" else pipeline
    return validate_plan(add_gradient_reductions(add_communication(build_plan(
        schedule, pipeline_degree=pipeline, stages=stages, micro_batches=micro_batches))))


def test_simulated_bubble_against_the_papers_formula():
    """Idle time per rank, in units of one rank's share of the model's forward (T_F = T_B = T_W = 1;
    ZBV's half-size stages take ½): 1F1B (p−1)(T_F+T_B+T_W) = 3(p−1) and ZB-H1 (p−1)(T_F+T_B−T_W) =
    p−1, a third, exactly as Qi et al. 2023 §3.1 count. ZBV: their ~0 counts the parallelogram of
    staggered ends as no bubble (the optimizer step's synchronisation bypassed, §4 of the 2023
    paper); with a synchronous step no schedule beats the last rank's wait for its first input, (p−1)
    half-stage forwards = (p−1)/2: ZBV is within ½ of that bound, half ZB-H1's or less."""
    print("\n  p   m  1F1B idle (formula) bubble   ZB-H1 idle (formula) bubble   ZBV idle (bound) bubble")
    for pipeline in (4, 8):
        for micro_batches in (8, 16, 32):
            work = 3 * micro_batches  # F + I + W of every micro-batch through a rank's share of the model
            one_f_one_b = simulate(built("one_f_one_b", pipeline, micro_batches), EQUAL_TIMES)
            zero_bubble = simulate(built("zero_bubble_h1", pipeline, micro_batches), EQUAL_TIMES)
            v_shape = simulate(built("zbv", pipeline, micro_batches), HALF_STAGES)
            print(f"{pipeline:3} {micro_batches:3}  {one_f_one_b.makespan - work:4g} ({3 * (pipeline - 1):2})"
                  f"      {one_f_one_b.bubble_fraction:.4f}  {zero_bubble.makespan - work:4g} ({pipeline - 1:2})"
                  f"       {zero_bubble.bubble_fraction:.4f}  {v_shape.makespan - work:4g} ({(pipeline - 1) / 2:3g})"
                  f"   {v_shape.bubble_fraction:.4f}")
            assert one_f_one_b.makespan - work == 3 * (pipeline - 1)
            assert zero_bubble.makespan - work == pipeline - 1
            assert zero_bubble.bubble_fraction == pytest.approx((pipeline - 1) / (work + pipeline - 1))
            assert (pipeline - 1) / 2 <= v_shape.makespan - work <= pipeline / 2


def test_zbv_table_order_is_no_longer_than_the_list_schedule():
    """Why zbv uses the paper's table at m ≥ 2p − 1 (generators._zbv_table_row): at unit cost it is as
    short as the unit-time list schedule or shorter, and at a split backward's measured costs here
    (I ≈ 1.32 T_F, W ≈ 1.02 T_F: docs/strategies/modular_pipeline.md) strictly shorter; both hold at
    most 2p stage-micro-batches between F and W. Below 2p − 1 the list schedule is kept: shorter there."""
    from strategies.schedule.generators import _list_schedule, stage_placement

    def measured(action) -> float:
        return {FORWARD: 1.0, BACKWARD_INPUT: 1.32, BACKWARD_WEIGHT: 1.02}.get(action.kind, 0.0)
    print("\n  p   m  unit: table list   measured: table   list")
    for pipeline, micro_batches in ((2, 8), (4, 8), (4, 16), (8, 16)):
        placement = stage_placement(2 * pipeline, pipeline, "v")
        listed = Plan(_list_schedule(pipeline, micro_batches, placement, cap=2 * pipeline), 2 * pipeline,
                      micro_batches, placement)
        table = build_plan("zbv", pipeline_degree=pipeline, stages=2 * pipeline, micro_batches=micro_batches)
        unit = [simulate(plan).makespan for plan in (table, listed)]
        costed = [simulate(plan, measured).makespan for plan in (table, listed)]
        print(f"{pipeline:3} {micro_batches:3}  {unit[0]:10g} {unit[1]:4g}  {costed[0]:15.2f} {costed[1]:6.2f}")
        assert unit[0] <= unit[1] and costed[0] < costed[1]
        assert max(in_flight(row) for row in table.ranks) == 2 * pipeline
    small = build_plan("zbv", pipeline_degree=4, stages=8, micro_batches=4)  # m < 2p − 1: the list schedule
    assert small.ranks == Plan(_list_schedule(4, 4, stage_placement(8, 4, "v"), cap=8), 8, 4, small.placement).ranks


def test_every_small_p_m_builds_and_validates():
    """Both generators take any p ≥ 1 and m ≥ 1 (and breadth-first groups); the dry run, NCCL's order
    and the validator's rules hold on each."""
    for schedule in ("zero_bubble_h1", "zbv"):  # zero_bubble_h2 needs m ≥ 2p − 1: tests/test_zero_bubble_h2.py
        for pipeline in (1, 2, 3, 4):
            for micro_batches in (1, 2, 3, 5, 8):
                built(schedule, pipeline, micro_batches)
        stages = 8 if schedule == "zbv" else 4
        validate_plan(add_communication(build_plan(schedule, pipeline_degree=4, stages=stages, micro_batches=8,
                                                   breadth_first_micro_batches=4)))


def test_split_backward_dependencies_and_validator():
    """I(s) waits for I(s+1) (its gradient message), W only for its own I; W before I, a fused B beside
    its I, a missing W are each refused with the fault marked."""
    plan = built("zero_bubble_h1", 2, 2)
    rank1 = plan.ranks[1]
    assert str(rank1[rank1.index(Action(BACKWARD_INPUT, 1, 0)) + 1]) == "1B0→0"  # I sends the gradient
    assert [str(a) for a in plan.ranks[0] if a is not None][-1] == "0R"  # the reduction after the last W
    timeline = simulate(plan, EQUAL_TIMES)
    start = {record.action: record.start for row in timeline.ranks for record in row}
    assert start[Action(BACKWARD_INPUT, 0, 0)] >= start[Action(BACKWARD_INPUT, 1, 0)] + 1
    swapped = [list(row) for row in build_plan("zero_bubble_h1", pipeline_degree=2, stages=2, micro_batches=2).ranks]
    row = swapped[1]
    i, w = row.index(Action(BACKWARD_INPUT, 1, 1)), row.index(Action(BACKWARD_WEIGHT, 1, 1))
    row[i], row[w] = row[w], row[i]
    with pytest.raises(PlanError, match="1W1 comes before its input gradient 1I1"):
        validate_plan(Plan(swapped, 2, 2, (0, 1)))
    fused_too = [list(r) for r in build_plan("zero_bubble_h1", pipeline_degree=2, stages=2, micro_batches=2).ranks]
    fused_too[0].append(Action(BACKWARD, 0, 1))
    with pytest.raises(PlanError, match="0B1 and 0I1 both occur"):
        validate_plan(Plan(fused_too, 2, 2, (0, 1)))
    missing = [[a for a in r if a != Action(BACKWARD_WEIGHT, 0, 0)]
               for r in build_plan("zero_bubble_h1", pipeline_degree=2, stages=2, micro_batches=2).ranks]
    with pytest.raises(PlanError, match="0W0 is missing"):
        validate_plan(Plan(missing, 2, 2, (0, 1)))


def test_peak_in_flight_is_one_f_one_bs():
    """Micro-batches between F and W (their stash kept), in units of one rank's share of the model:
    at most p on every rank, 1F1B's peak (rank 0), whatever m. ZB-H1's later ranks hold more than
    under 1F1B (p−r), since W lags I by r; ZBV holds at most 2p half-size stage stashes."""
    for pipeline in (2, 4, 8):
        for micro_batches in (1, 3, 4, 16):
            one_f_one_b = max(in_flight(row) for row in built("one_f_one_b", pipeline, micro_batches).ranks)
            zero_bubble = max(in_flight(row) for row in built("zero_bubble_h1", pipeline, micro_batches).ranks)
            v_shape = max(in_flight(row) for row in built("zbv", pipeline, micro_batches).ranks)
            assert zero_bubble == one_f_one_b == min(pipeline, micro_batches), (pipeline, micro_batches)
            assert v_shape / 2 <= one_f_one_b, (pipeline, micro_batches, v_shape)


# ----------------------------------------------------------------------------- measured on gloo ranks

def alive_by_rank(rank, cfg):
    """Fit two steps on this rank; per step, the most micro-batches whose graph the rank kept at
    once (StageWork's outputs awaiting B or I + graphs awaiting W) and the most bytes of saved
    activations alive at once (autograd's saved tensors, parameters left out), each measured after
    every compute action."""
    import torch
    from torch.autograd.graph import saved_tensors_hooks

    from layerwise.tools.dry_run import one_rank_step
    from strategies.stages import StageWork

    live, peaks = [0], []

    class Saved:
        def __init__(self, tensor):
            self.tensor = tensor

    def pack(tensor):
        if isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter):
            return tensor
        # detached, as autograd saves outputs: whole, a saved output would hold its own node (a cycle)
        saved, size = Saved(tensor.detach()), tensor.numel() * tensor.element_size()
        live[0] += size
        weakref.finalize(saved, lambda: live.__setitem__(0, live[0] - size))
        return saved

    def unpack(saved):
        return saved.tensor if isinstance(saved, Saved) else saved

    def measured(method):
        def run(work, action):
            with saved_tensors_hooks(pack, unpack):
                method(work, action)
            if work.training:
                graphs = len(work.state.outputs) + len(work.state.weight_work)
                peaks[-1] = (max(peaks[-1][0], graphs), max(peaks[-1][1], live[0]))
        return run

    start, finish = StageWork.start, StageWork.finish

    def starting(work, batch, training, releases=None):
        if training:
            peaks.append((0, 0))
        start(work, batch, training, releases)

    StageWork.start = starting
    for name in ("forward", "backward", "backward_input", "backward_weight"):
        setattr(StageWork, name, measured(getattr(StageWork, name)))
    one_rank_step(cfg, int(os.environ["WORLD_SIZE"]))
    return peaks


@pytest.mark.parametrize("micro_batches", [4, 16])
def test_measured_activation_memory_is_the_plans_and_peaks_as_one_f_one_b(micro_batches):
    """p = 2, 4 blocks, a real run: on each rank the most micro-batches kept is the plan's in-flight
    count, whatever m. ZB-H1: rank 0 keeps 1F1B's count and bytes, and the peak count over ranks is
    1F1B's (p); its last rank keeps p, not 1F1B's 1, those past I without their loss's tensors.
    ZBV's stage-micro-batches are half-size (2 stages per rank)."""
    measured = {}
    for schedule, per_stage in (("one_f_one_b", 2), ("zero_bubble_h1", 2), ("zbv", 1)):
        cfg = compose_config(*QUICK, "strategy=one_f_one_b", f"strategy.schedule={schedule}", "model.layers=4",
                             f"strategy.layers_per_stage={per_stage}", f"strategy.micro_batches={micro_batches}",
                             f"data.global_batch_size={micro_batches}", "model.dropout=0.0")
        world = validate(cfg)
        measured[schedule] = [steps[-1] for steps in run_on_ranks(alive_by_rank, world, cfg)]
        plan = built(schedule, 2, micro_batches)
        assert [graphs for graphs, _ in measured[schedule]] == [in_flight(row) for row in plan.ranks], schedule
    print(f"\nm={micro_batches}: per rank (most stage-micro-batches kept, most saved-activation bytes alive): "
          f"{measured}")
    assert measured["zero_bubble_h1"][0] == measured["one_f_one_b"][0]  # rank 0: the same count and bytes
    assert max(g for g, _ in measured["zero_bubble_h1"]) == max(g for g, _ in measured["one_f_one_b"]) == 2
    assert max(g for g, _ in measured["zbv"]) <= 2 * 2  # 2p half-size stage stashes
    waiting_for_w(measured["zero_bubble_h1"][1], measured["one_f_one_b"][1], tokens=32)


def waiting_for_w(split_last: tuple, one_f_one_b_last: tuple, tokens: int, vocabulary: int = 256) -> float:
    """The last rank's saved bytes per micro-batch between its I and its W, from its peak: one micro-batch
    whole (1F1B's one, awaiting its backward) and the others past I. Those hold less: the loss's
    saved tensors (at least the log-probabilities, tokens × vocabulary fp32) go with I, since a pending
    W keeps the graph only from the head's product down (strategies/split_backward.py)."""
    (graphs, saved), (one_graphs, one_saved) = split_last, one_f_one_b_last
    assert one_graphs == 1 and graphs > 1
    after_input = (saved - one_saved) / (graphs - 1)
    assert one_saved - after_input >= tokens * vocabulary * 4, (saved, one_saved)
    return after_input


@pytest.mark.parametrize("overrides, match", [
    (["strategy=one_f_one_b", "strategy.schedule=zero_bubble_h1", "strategy.layers_per_stage=1"],
     "strategy.schedule=zero_bubble_h1 puts one stage on each rank"),
    (["strategy=one_f_one_b", "strategy.schedule=zero_bubble_h1", "strategy.activation_recompute=full"],
     "strategy.activation_recompute=none"),
    (["strategy=zero_layered", "strategy.schedule=zero_bubble_h1", "strategy.layers_per_stage=1"],
     "strategy.schedule=zero_bubble_h1 puts one stage on each rank"),
    (["strategy=pipefisher", "strategy.schedule=interleaved_one_f_one_b"], "not supported by pipefisher"),
])
def test_unsupported_combinations_name_the_constraint(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(compose_config(*QUICK, "model.layers=4", *overrides))
