"""Zero-bubble schedules (split backward I + W) inside zero_layered and pipefisher (issue 32).

zero_layered: each run of a stage's compute is gathered (I and W share a backward run; one that
starts at a W is gathered by "Aw"), and the stage is reduce-scattered once, after its last W,
when its weight gradient is complete. Proven equal to `single` (AdamW and SGD) on p2 × d2, with
the bytes each rank moves counted below torch.distributed against the plan's gathers and scatters.
pipefisher: the K-FAC units fill whatever bubble is left (curvature B after W); proven equal to
the one-process `kfac` oracle (LAMB and SGD outside) at p = 2, m = 4, k = 2.
Ids: pp{p} pipeline ranks, dp{n} data replicas, m{m} micro-batches, k{k} K-FAC refresh interval.
"""

import math
from collections import Counter

import pytest

from layerwise.config.errors import ConfigError
from layerwise.preflight import validate

from strategies.schedule import (BACKWARD_WEIGHT, Action, add_communication, add_gradient_reductions, build_plan,
                                 simulate, validate_plan)
from strategies.schedule import curvature as units
from strategies.schedule.zero import GATHERS, REDUCE_SCATTER, add_zero
from tests.ranks import QUICK, compose_config
from tests.references import cached_references, compare_under_sgd, consolidated_parameters, tracing_optimizer
from tests.test_zero_layered import BYTES, STEPS, run, run_counted
from tests.tolerances import EXACT_RTOL, OptimizerTrace, assert_same_losses, assert_same_parameters

ZERO_BUBBLE_ZERO = ["strategy=zero_layered", "strategy.pipeline_degree=2", "strategy.layers_per_stage=2",
                    "hardware.devices_per_node=4", "model.layers=4", "strategy.micro_batches=4"]


def stage_padded(parameters: dict, stage: int, data: int) -> int:
    """P of stage `stage` of 2 (2 blocks each; the embedding on the first, the head on the last): its
    matrices and its vectors, each padded to a multiple of n (what is gathered)."""
    names = [n for n in parameters if any(n.startswith(f"model.blocks.{2 * stage + b}.") for b in (0, 1))]
    names += [n for n in parameters if n.startswith("model.embed." if stage == 0 else "model.head.")]
    return sum(math.ceil(sum(parameters[n].numel() for n in names if (parameters[n].dim() >= 2) == matrix) / data)
               * data for matrix in (True, False))


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return cached_references(tmp_path_factory, run)


def test_zero_plans_reduce_scatter_once_after_the_last_w():
    """Every split schedule: per stage one reduce-scatter, right after its last W (after it on the row,
    no W of the stage follows); one gather per run of the stage's forwards or backwards (I, W)."""
    for schedule, stages in (("zero_bubble_h1", 2), ("zero_bubble_h2", 2), ("zbv", 4)):
        for micro_batches in (3, 4, 8):
            plan = validate_plan(add_zero(add_communication(build_plan(
                schedule, pipeline_degree=2, stages=stages, micro_batches=micro_batches))))
            for row in plan.ranks:
                actions = [a for a in row if a is not None]
                for stage in {a.stage for a in actions if a.kind == REDUCE_SCATTER}:
                    mine = [a for a in actions if a.stage == stage]
                    scatter = [i for i, a in enumerate(mine) if a.kind == REDUCE_SCATTER]
                    assert len(scatter) == 1 and all(a.kind not in ("BACKWARD_INPUT", "BACKWARD_WEIGHT")
                                                     for a in mine[scatter[0]:]), (schedule, mine)
                    assert Counter(a.kind for a in mine)["BACKWARD_WEIGHT"] == micro_batches
                assert {a.stage for a in actions if a.kind == REDUCE_SCATTER} == \
                    {a.stage for a in actions if a.kind == "FORWARD"}


@pytest.mark.smoke  # also under torch 2.11: split backward, and the bytes counted on that torch's names
def test_zero_layered_zero_bubble_h1_equals_single_and_moves_the_planned_bytes(references, tmp_path):
    """p = 2 × d = 2, ZB-H1, AdamW: losses and parameters equal `single`'s; each rank's all-gather and
    reduce-scatter bytes, counted on raw torch.distributed tensors every step, are (its gathers) ×
    and 1 × (n−1)/n·P of its stage."""
    expected, reference_directory = references(4)
    parameters = consolidated_parameters(reference_directory, "single")
    summary, tallies = run_counted(tmp_path, *ZERO_BUBBLE_ZERO, "strategy.schedule=zero_bubble_h1")
    assert summary["status"] == "completed" and summary["world_size"] == 4
    assert_same_losses(summary["losses"], expected["losses"])
    assert_same_parameters(consolidated_parameters(tmp_path, "zero_layered"), parameters,
                           OptimizerTrace.load(reference_directory))
    plan = validate_plan(add_zero(add_communication(build_plan("zero_bubble_h1", pipeline_degree=2, stages=2,
                                                               micro_batches=4))))
    data = 2
    for rank, tally in enumerate(tallies):
        pipeline_rank = rank % 2
        counts = Counter(a.kind for a in plan.ranks[pipeline_rank] if a is not None)
        gathers = sum(counts[kind] for kind in GATHERS)
        assert gathers == (3 + 3, 4 + 4)[pipeline_rank] and counts[REDUCE_SCATTER] == 1
        volume = stage_padded(parameters, pipeline_rank, data) * (data - 1) / data * BYTES
        print(f"rank {rank}: {gathers} gathers + 1 reduce-scatter of {volume:.0f} B per step; counted "
              f"{tally['all_gather'] / STEPS:.0f} B and {tally['reduce_scatter'] / STEPS:.0f} B")
        assert tally["all_gather"] / STEPS == pytest.approx(gathers * volume, rel=EXACT_RTOL)
        assert tally["reduce_scatter"] / STEPS == pytest.approx(volume, rel=EXACT_RTOL)


@pytest.mark.parametrize("case", ["zero_layered_zero_bubble_h1_pp2_dp2_m4", "zero_layered_zero_bubble_h2_pp2_dp2_m4",
                                  "zero_layered_zbv_pp2_dp2_m4"])
def test_zero_layered_zero_bubble_equals_single_under_sgd(case, tmp_path, tmp_path_factory):
    """Plain SGD sees the gradient's scale (references.SgdComparison): a W left out of the one
    reduce-scatter, or a gradient buffer restarted between a stage's backward runs, shows here."""
    compare_under_sgd(case, tmp_path, tmp_path_factory).check()


# ----- pipefisher: K-FAC units packed into what bubble the split schedule leaves

BERT_BASE = units.BlockShape(hidden=768, mlp_ratio=4, sequence_length=128, tokens=32 * 128)


@pytest.mark.parametrize("schedule", ["zero_bubble_h1", "zero_bubble_h2", "zbv"])
def test_packing_fills_the_split_schedules_bubbles(schedule):
    """p = 2, m = 4, 4 BERT-Base blocks (2 per stage; ZBV: 1 per stage, 2 stages per rank): every
    unit runs once after its producers (curvature B after W, when the output gradients are final), the
    pipeline's order and makespan are kept; the smaller bubble needs more steps than 1F1B's, and with
    k forced to 1 the report says which share of the K-FAC work went onto the critical path."""
    stages = 4 if schedule == "zbv" else 2
    shape = BERT_BASE._replace(layers_per_stage=1 if schedule == "zbv" else 2)
    plan = validate_plan(add_gradient_reductions(add_communication(build_plan(
        schedule, pipeline_degree=2, stages=stages, micro_batches=4))))
    cost = units.pipefisher_cost(shape, flops_per_second=15.7e12)
    cycle = units.pack(plan, cost)
    units.check_cycle(plan, cycle.plans)
    makespan = simulate(plan, cost).makespan
    for step_plan in cycle.plans:
        assert simulate(step_plan, cost).makespan == pytest.approx(makespan, rel=1e-9)
        for row in step_plan.ranks:  # B curvature after the micro-batch's W
            actions = [a for a in row if a is not None]
            for slot, action in enumerate(actions):
                if units.is_curvature(action.kind) and units.UNITS[action.kind][0] == "B" and step_plan is cycle.plans[0]:
                    weight = Action(BACKWARD_WEIGHT, action.stage, action.micro_batch)
                    assert weight in actions[:slot], action
    assert cycle.spilled_to_critical_path == 0 and cycle.spilled_work == 0
    one_f_one_b = units.pack(validate_plan(add_gradient_reductions(add_communication(build_plan(
        "one_f_one_b", pipeline_degree=2, stages=2, micro_batches=4)))),
        units.pipefisher_cost(BERT_BASE._replace(layers_per_stage=2), 15.7e12))
    assert cycle.refresh_interval > one_f_one_b.refresh_interval
    forced = units.pack(plan, cost, refresh_interval=1)
    units.check_cycle(plan, forced.plans)
    print(f"\n{schedule}: k = {cycle.refresh_interval} (1F1B {one_f_one_b.refresh_interval}), K-FAC work / bubble "
          f"{cycle.ratio:.3f}; at k = 1 {forced.spilled_work:.3f} of the work did not fit")
    assert 0 < forced.spilled_work < 1 and forced.report()["spilled_work"] == forced.spilled_work


@pytest.mark.parametrize("schedule", ["zero_bubble_h1", "zero_bubble_h2", "zbv"])
def test_pipefisher_zero_bubble_equals_one_process_kfac(schedule, tmp_path):
    """p = 2, m = 4, k = 2, LAMB outside: pipefisher on each split schedule (a and g captured through
    the split backward: g on I's way to the stage input and again by W; ZBV's two stages per rank)
    equals the one-process `kfac` oracle."""
    from tests.test_pipefisher import run as kfac_run

    with tracing_optimizer(tmp_path / "kfac"):
        expected = kfac_run(tmp_path / "kfac", "strategy=kfac", "strategy.refresh_interval=2", "strategy.micro_batches=4")
    summary = kfac_run(tmp_path / "pipefisher", "strategy=pipefisher", "strategy.refresh_interval=2",
                       "strategy.micro_batches=4", f"strategy.schedule={schedule}",
                       f"strategy.layers_per_stage={1 if schedule == 'zbv' else 2}", "hardware.devices_per_node=2")
    assert summary["status"] == "completed"
    bubble = summary["bubble_fraction"]
    print(f"\npipefisher {schedule} p2 m4 k2: {bubble}")
    assert bubble["refresh_interval"] == 2 and bubble["simulated_with_kfac"] < bubble["simulated"]
    assert_same_losses(summary["losses"], expected["losses"])
    assert_same_parameters(consolidated_parameters(tmp_path / "pipefisher", "pipefisher"),
                           consolidated_parameters(tmp_path / "kfac", "kfac"), OptimizerTrace.load(tmp_path / "kfac"))


@pytest.mark.parametrize("case", ["pipefisher_zero_bubble_h1_pp2_m4_k2", "pipefisher_zero_bubble_h2_pp2_m4_k2",
                                  "pipefisher_zbv_pp2_m4_k2"])
def test_pipefisher_zero_bubble_equals_kfac_under_sgd(case, tmp_path, tmp_path_factory):
    """Plain SGD outside K-FAC sees the preconditioned gradient's scale (references.SgdComparison)."""
    compare_under_sgd(case, tmp_path, tmp_path_factory).check()


def test_a_k_the_packing_cannot_reach_is_refused_before_launch():
    """refresh_interval=null asks for the k that fits every unit; ZB-H1 at p = 2, m = 4 leaves no gap
    as large as some unit, so the error names strategy.refresh_interval (forced, the rest runs on
    the critical path and the report says how much)."""
    with pytest.raises(ConfigError, match=r"strategy.refresh_interval=null packs .* does not fit in the bubbles "
                                          r"of 64 steps.*Fix: strategy.refresh_interval=<k>"):
        validate(compose_config(*QUICK, "strategy=pipefisher", "strategy.schedule=zero_bubble_h1", "model.layers=4",
                                "strategy.layers_per_stage=2", "strategy.micro_batches=4"))
