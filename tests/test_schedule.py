"""Schedule IR: generators match docs/strategies/modular_pipeline.md under unit cost, passes and validator, executor, plotter.

Test ids: p = pipeline degree, m = micro-batches, v = loops (stages per rank), bf = breadth-first micro-batches.
"""

import dataclasses
import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from strategies.schedule import (BACKWARD, FINISH, FORWARD, KINDS, RECV_ACTIVATION, REDUCE_GRADIENT, SCHEDULES,
                                 SEND_ACTIVATION, Action, Plan, PlanError, Timeline, add_communication,
                                 add_gradient_reductions, build_plan, dependencies, execute, flop_cost, gpipe,
                                 interleaved_one_f_one_b, layered, looped_breadth_first, one_f_one_b, parse_action,
                                 parse_row, plot_timeline, simulate, stage_placement, unit_cost, validate_plan)
from strategies.modular_pipeline import forward_only
from strategies.schedule import (POST_RECV_ACTIVATION, RECV_GRADIENT, KindInfo, add_receive_posts,
                                 check_point_to_point_order, curvature, is_post, issue_order, issue_sequences,
                                 message_order, offload, post_of)
from strategies.schedule.curvature import synchronous_plan
from strategies.schedule.ir import register_kinds
from strategies.schedule.zero import add_zero

GRID = [(p, m, v) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p) for v in (1, 2, 4)]


def grid_id(case):
    p, m, v = case
    return f"p{p}_m{m}_v{v}"


def full(plan: Plan) -> Plan:
    """The plan as a strategy runs it: transfers and gradient reductions added."""
    return add_gradient_reductions(add_communication(plan))


# -----------------------------------------------------------------------------
# IR


@pytest.mark.parametrize("text, kind", [
    ("3F1", FORWARD), ("3B1", BACKWARD), ("3F1→4", SEND_ACTIVATION), ("4F1←3", RECV_ACTIVATION),
    ("3B1→2", "SEND_GRADIENT"), ("2B1←3", "RECV_GRADIENT"), ("3R", REDUCE_GRADIENT)])
def test_parse_and_str_round_trip(text, kind):
    action = parse_action(text)
    assert action.kind == kind and str(action) == text and parse_action(str(action)) == action
    assert eval(repr(action)) == action


def test_every_kind_round_trips():
    for kind, info in KINDS.items():
        action = Action(kind, 3, 1 if info.per_micro_batch else None, 4 if info.arrow else None)
        assert parse_action(str(action)) == action


def test_parse_accepts_ascii_arrows_and_rejects_garbage():
    assert parse_action("3F1->4") == Action(SEND_ACTIVATION, 3, 1, 4)
    assert parse_action("4F1<-3") == Action(RECV_ACTIVATION, 4, 1, 3)
    for text in ("F1", "3X1", "3F", "3R1", "3F1→"):
        with pytest.raises(ValueError):
            parse_action(text)


def test_action_checks_its_fields():
    with pytest.raises(ValueError, match="micro_batch"):
        Action(FORWARD, 0)
    with pytest.raises(ValueError, match="peer_stage"):
        Action(SEND_ACTIVATION, 0, 0)
    with pytest.raises(ValueError, match="unknown action kind"):
        Action("FORWARDS", 0, 0)


def _kinds_after_importing(first_module: str) -> str:
    """The kind table, printed by a fresh interpreter that imports `first_module` before anything else."""
    script = f"import {first_module}; import strategies.schedule.ir as ir; print(sorted(ir.KINDS.items()))"
    return subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True, check=True).stdout


def test_registered_kinds_do_not_depend_on_which_module_is_imported_first():
    # Each interpreter costs seconds (torch); two orders that used to give different tables suffice.
    tables = {first: _kinds_after_importing(first) for first in ("strategies.schedule.ir", "strategies.schedule.zero")}
    assert set(tables.values()) == {f"{sorted(KINDS.items())}\n"}, tables
    assert {"WEIGHTS_FORWARD", "GATHER_FORWARD", "KFAC_SYNC_A"} <= set(KINDS)  # offload, zero, curvature


def test_registering_kinds_rejects_clashes_and_changes_nothing_then():
    before = dict(KINDS)
    clashing_tables = [
        {"NEW_KIND": KindInfo("F", None, True, True, False)},  # written like FORWARD
        {"NEW_KIND": KindInfo("Wf", None, False, False, True)},  # written like a pass module's kind
        {FORWARD: KindInfo("Fw", None, True, True, False)},  # a known kind with another row
        {"NEW_KIND": KindInfo("Zz", None, False, False, False),
         "OTHER_NEW_KIND": KindInfo("Zz", None, False, False, False)},  # two new kinds written alike
    ]
    for table in clashing_tables:
        with pytest.raises(ValueError, match="clashes"):
            register_kinds(table, {})
    with pytest.raises(ValueError, match="unknown action kinds"):
        register_kinds({}, {"NO_SUCH_KIND": lambda action, plan: ()})
    assert KINDS == before


def test_registering_a_table_again_changes_nothing():
    plan, forward = offload.relay_plan(2, 2), Action(FORWARD, 1, 0)
    needs = dependencies(forward, plan)
    register_kinds(offload.ACTION_KINDS, offload.DEPENDENCY_RULES)
    assert dependencies(forward, plan) == needs == (Action(FORWARD, 0, 0), Action(offload.WEIGHTS_FORWARD, 1))


def test_placement_and_plan_helpers():
    assert stage_placement(8, 4, "contiguous") == (0, 0, 1, 1, 2, 2, 3, 3)
    assert stage_placement(8, 4, "looping") == (0, 1, 2, 3, 0, 1, 2, 3)
    with pytest.raises(ValueError, match="strategy.placement"):
        stage_placement(8, 4, "random")
    plan = looped_breadth_first(4, 4, 2)
    assert plan.rank_of(5) == 1 and plan.stages_on(1) == (1, 5)
    assert str(plan).splitlines()[2].startswith("rank 0  0F0")


def test_dependencies():
    plan = gpipe(4, 2)
    assert dependencies(parse_action("3B1"), plan) == (parse_action("3F1"),)  # the loss is in the last forward
    assert dependencies(parse_action("1B1"), plan) == (parse_action("1F1"), parse_action("2B1"))
    assert dependencies(parse_action("0F1"), plan) == ()
    assert set(dependencies(parse_action("2R"), plan)) == {parse_action("2B0"), parse_action("2B1")}
    assert dependencies(parse_action("1F1"), add_communication(plan)) == (parse_action("1F1←0"),)
    assert dependencies(parse_action("1F1←0"), plan) == (parse_action("0F1→1"),)


# -----------------------------------------------------------------------------
# Generators under unit cost: docs/strategies/modular_pipeline.md


@pytest.mark.parametrize("p, m", sorted({(p, m) for p, m, _ in GRID}))
@pytest.mark.parametrize("generator", [gpipe, one_f_one_b])
def test_contiguous_pipelines_match_bubble_formula(generator, p, m):
    timeline = simulate(generator(p, m), unit_cost)
    assert timeline.makespan == 2 * (m + p - 1)
    assert timeline.ideal == 2 * m
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p, m, v", GRID, ids=map(grid_id, GRID))
def test_looped_breadth_first_matches_bubble_formula(p, m, v):
    timeline = simulate(full(looped_breadth_first(p, m, v)), unit_cost)
    assert timeline.makespan == 2 * (v * m + p - 1)
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("plan, makespan", [
    (gpipe(4, 4), 14), (looped_breadth_first(4, 4, 2), 22), (looped_breadth_first(4, 4, 4), 38),
    (looped_breadth_first(8, 8, 4), 78), (looped_breadth_first(4, 2, 2), 18)],  # the last: m < p stalls
    ids=["gpipe_p4_m4", "looped_p4_m4_v2", "looped_p4_m4_v4", "looped_p8_m8_v4", "looped_p4_m2_v2"])
def test_techniques_examples(plan, makespan):
    assert simulate(full(plan)).makespan == makespan


LOOPED_GRID = [case for case in GRID if case[2] > 1]


@pytest.mark.parametrize("p, m, v", LOOPED_GRID, ids=map(grid_id, LOOPED_GRID))
def test_interleaved_one_f_one_b_beats_gpipe_on_the_same_model(p, m, v):
    plan = validate_plan(full(interleaved_one_f_one_b(p, m, v)))
    # Same model: GPipe's one stage per rank holds the v stages of the looped plan, so costs v units.
    gpipe_makespan = simulate(gpipe(p, m), lambda action: v * unit_cost(action)).makespan
    assert simulate(plan).makespan < gpipe_makespan


# gpipe, one_f_one_b, zero_bubble_h1 and zero_bubble_h2 put one stage per rank, zbv two (the V);
# zero_bubble_h2 needs m ≥ 2p − 1 (its warm-up; tests/test_zero_bubble_h2.py checks the refusal)
STAGES_PER_RANK = {"gpipe": 1, "one_f_one_b": 1, "zero_bubble_h1": 1, "zero_bubble_h2": 1, "zbv": 2}
SCHEDULE_GRID = [(schedule, *case) for schedule in SCHEDULES for case in GRID
                 if STAGES_PER_RANK.get(schedule, case[2]) == case[2]
                 and not (schedule == "zero_bubble_h2" and case[1] < 2 * case[0] - 1)]


@pytest.mark.parametrize("schedule, p, m, v", SCHEDULE_GRID,
                         ids=[f"{schedule}-{grid_id(case)}" for schedule, *case in SCHEDULE_GRID])
def test_every_schedule_validates_after_passes(schedule, p, m, v):
    degree = 1 if schedule == "layered" else p
    plan = build_plan(schedule, pipeline_degree=degree, stages=degree * v, micro_batches=m)
    validate_plan(plan)
    validate_plan(full(plan))


@pytest.mark.parametrize("p, m, v, bf", [(2, 4, 2, 2), (4, 8, 2, 4), (4, 16, 4, 8), (2, 6, 3, 3)],
                         ids=["p2_m4_v2_bf2", "p4_m8_v2_bf4", "p4_m16_v4_bf8", "p2_m6_v3_bf3"])
def test_depth_first_groups(p, m, v, bf):
    plans = [looped_breadth_first(p, m, v, bf), interleaved_one_f_one_b(p, m, v, bf) if bf % p == 0 else None,
             gpipe(p, m, bf), one_f_one_b(p, m, bf)]
    for plan in filter(None, plans):
        validate_plan(full(plan))
        group_makespan = 2 * ((v if "looped" in plan.name else 1) * bf + p - 1)
        if "interleaved" not in plan.name:  # each group drains before the next starts
            assert simulate(full(plan)).makespan == (m // bf) * group_makespan, plan.name
    assert gpipe(2, 4, 2).ranks[1] == parse_row("· 1F0 1F1 1B0 1B1 1F2 1F3 1B2 1B3")


def test_layered_breadth_first_and_depth_first_orders():
    assert layered(3, 2).ranks[0] == parse_row("0F0 0F1 1F0 1F1 2F0 2F1 2B0 2B1 1B0 1B1 0B0 0B1")
    assert layered(3, 2, breadth_first_micro_batches=1).ranks[0] == parse_row(
        "0F0 1F0 2F0 2B0 1B0 0B0 0F1 1F1 2F1 2B1 1B1 0B1")
    assert layered(2, 4, breadth_first_micro_batches=2).ranks[0] == parse_row(
        "0F0 0F1 1F0 1F1 1B0 1B1 0B0 0B1 0F2 0F3 1F2 1F3 1B2 1B3 0B2 0B3")


def test_one_f_one_b_rows():
    plan = one_f_one_b(3, 4)
    assert plan.ranks[0] == parse_row("0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3")
    assert plan.ranks[2] == parse_row("· · 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3")


@pytest.mark.parametrize("kwargs, field", [
    (dict(schedule="zero_bubble", pipeline_degree=2, stages=2, micro_batches=2), "strategy.schedule"),
    (dict(schedule="looped_breadth_first", pipeline_degree=4, stages=6, micro_batches=4), "strategy.layers_per_stage"),
    (dict(schedule="looped_breadth_first", pipeline_degree=4, stages=8, micro_batches=2), "strategy.micro_batches"),
    (dict(schedule="looped_breadth_first", pipeline_degree=4, stages=8, micro_batches=8,
          breadth_first_micro_batches=2), "strategy.breadth_first_micro_batches"),
    (dict(schedule="looped_breadth_first", pipeline_degree=2, stages=4, micro_batches=6,
          breadth_first_micro_batches=4), "strategy.breadth_first_micro_batches"),
    (dict(schedule="gpipe", pipeline_degree=2, stages=4, micro_batches=4), "strategy.layers_per_stage"),
    (dict(schedule="one_f_one_b", pipeline_degree=2, stages=4, micro_batches=4), "strategy.layers_per_stage"),
    (dict(schedule="interleaved_one_f_one_b", pipeline_degree=4, stages=8, micro_batches=6), "strategy.micro_batches"),
    (dict(schedule="layered", pipeline_degree=2, stages=4, micro_batches=4), "strategy.pipeline_degree"),
])
def test_build_plan_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")) as error:
        build_plan(**kwargs)
    if field == "strategy.schedule":
        assert all(name in str(error.value) for name in SCHEDULES)


# -----------------------------------------------------------------------------
# Passes


def test_add_communication_inserts_receive_compute_send():
    plan = add_communication(gpipe(2, 1))
    assert plan.ranks[0] == parse_row("0F0 0F0→1 0B0←1 0B0")
    assert plan.ranks[1] == parse_row("· 1F0←0 1F0 1B0 1B0→0")


def test_same_rank_stages_exchange_nothing():
    plan = layered(4, 2)
    assert add_communication(plan).ranks == plan.ranks
    contiguous = Plan([parse_row("0F0 1F0 1B0 0B0")], 2, 1, stage_placement(2, 1))
    assert add_communication(contiguous).ranks == contiguous.ranks


def test_reduction_follows_last_backward_and_its_send():
    assert add_gradient_reductions(layered(3, 2)).ranks[0] == parse_row(
        "0F0 0F1 1F0 1F1 2F0 2F1 2B0 2B1 2R 1B0 1B1 1R 0B0 0B1 0R")
    plan = full(gpipe(2, 2))
    assert plan.ranks[1][-3:] == parse_row("1B1 1B1→0 1R")


# -----------------------------------------------------------------------------
# Validator: each broken plan is rejected with the grid and the fault marked


def broken(rows: list[str], stages=2, micro_batches=1, placement=(0, 1)) -> Plan:
    return Plan([parse_row(row) for row in rows], stages, micro_batches, placement, "broken")


@pytest.mark.parametrize("rows, sentence, marked", [
    (["0F0 0F0→1 0B0←1 0B0", "· 1F0 1B0 1B0→0"], "no matching 1F0←0", ">>0F0→1<<"),  # missing receive
    (["0F0 0B0←1 0B0", "1F0←0 1F0 1B0 1B0→0"], "no matching 0F0→1", ">>1F0←0<<"),  # missing send
    (["0B0 0F0", "1F0 1B0"], "before its forward", ">>0B0<<"),
    (["0F0 0F0 0B0", "1F0 1B0"], "occurs twice", ">>0F0<<"),
    (["0F0 1F0 1B0 0B0", ""], "placed on rank 1", ">>1F0<<"),
    (["0F0", "1F0 1B0"], "0B0 is missing", "rank 1"),
    (["0B0←1 0F0 0F0→1 0B0", "1F0←0 1F0 1B0 1B0→0"], "cyclic wait", ">>1F0←0<<"),  # both receive first
    (["0F0 0F0→1 0B0 0B0←1", "1F0←0 1F0 1B0 1B0→0"], "later on its own list", ">>0B0<<"),  # receive too late
    (["0F0 0F0→1 0B0", "1F0←0 1F0 1B0"], "which is in no rank's list", ">>0B0<<"),  # gradient pair dropped
])
def test_validator_rejects_broken_plans(rows, sentence, marked):
    with pytest.raises(PlanError) as error:
        validate_plan(broken(rows))
    message = str(error.value)
    assert sentence in message and marked in message
    assert "rank 0" in message and "rank 1" in message and "slot" in message  # the grid


def test_cyclic_wait_marks_both_ranks():
    with pytest.raises(PlanError) as error:
        validate_plan(broken(["0B0←1 0F0 0F0→1 0B0", "1F0←0 1F0 1B0 1B0→0"]))
    assert ">>0B0←1<<" in str(error.value) and ">>1F0←0<<" in str(error.value)
    assert error.value.marks == ((0, 0), (1, 0))


@pytest.mark.parametrize("schedule, stages_per_rank", [("gpipe", 1), ("interleaved_one_f_one_b", 2), ("zbv", 2),
                                                      ("zero_bubble_h2", 1)])
def test_run_order_numbers_each_action_after_its_rank_predecessor_and_its_needs(schedule, stages_per_rank):
    """Plan.order, the walk `simulate` makes: every action once, each rank's in its list's order, each
    after its rank's previous action and after every action it needs; a cyclic wait stops it where
    both ranks wait, and the simulator reports those slots."""
    plan = full(build_plan(schedule, pipeline_degree=4, stages=4 * stages_per_rank, micro_batches=8))
    order = plan.order
    number = {action: index for index, action in enumerate(order.actions)}
    assert order.stuck is None and len(number) == sum(action is not None for _, _, action in plan.positions())
    for rank, row in enumerate(plan.ranks):
        mine = [number[action] for action in row if action is not None]
        assert mine == sorted(mine) and {order.rank[index] for index in mine} == {rank}
        assert [order.previous[index] for index in mine] == [-1, *mine[:-1]]
    for index, action in enumerate(order.actions):
        assert order.needs[index] == tuple(number[need] for need in plan.needs[action])
        assert all(need < index for need in order.needs[index])
    cyclic = broken(["0B0←1 0F0 0F0→1 0B0", "1F0←0 1F0 1B0 1B0→0"])
    assert cyclic.order.stuck == (0, 0) and cyclic.order.actions == ()
    with pytest.raises(PlanError) as error:
        simulate(cyclic)
    assert error.value.marks == ((0, 0), (1, 0))


def test_validator_accepts_compute_only_and_hand_made_plans():
    validate_plan(broken(["0F0 0B0", "1F0 1B0"]))
    validate_plan(broken(["0F0 0F0→1 0B0←1 0B0 0R", "1F0←0 1F0 1B0 1B0→0 1R"]))


# -----------------------------------------------------------------------------
# Simulator and cost models


def test_flop_cost_prices_compute_and_receives():
    cost = flop_cost([1e9, 2e9], flops_per_second=1e9, bytes_per_second=1e6, activation_bytes=5e5)
    assert cost(parse_action("1F0")) == 2.0 and cost(parse_action("1B0")) == 4.0
    assert cost(parse_action("1F0←0")) == 0.5 and cost(parse_action("0F0→1")) == 0.0
    # F0(1) + recv(0.5) + F1(2) + B1(4) + recv(0.5) + B0(2)
    assert simulate(full(gpipe(2, 1)), cost).makespan == pytest.approx(10.0)
    assert flop_cost(3.0, 1.0)(parse_action("5B2")) == 6.0


def test_timeline_from_records_measures_the_same_way():
    records = [[(parse_action("0F0"), 10.0, 11.0), (parse_action("0F0→1"), 11.0, 11.0)],
               [(parse_action("1F0←0"), 11.0, 11.5), (parse_action("1F0"), 11.5, 12.0)]]
    timeline = Timeline.from_records(records, name="measured")
    assert timeline.ranks[0][0].start == 0.0 and timeline.makespan == 2.0
    assert timeline.busy(1) == 0.5  # the receive wait is not busy
    assert timeline.bubble_fraction == pytest.approx(1 - 1.5 / 4)


# -----------------------------------------------------------------------------
# Executor and plotter


def test_executor_runs_the_plan_in_order():
    plan = full(looped_breadth_first(2, 2, 2))
    ticks = itertools.count()
    for rank, row in enumerate(plan.ranks):
        ran, finished = [], []
        handlers = {kind: ran.append for kind in KINDS} | {FINISH: lambda: finished.append(True)}
        records = execute(row, handlers, clock=lambda: float(next(ticks)))
        assert ran == [action for action in row if action is not None]
        assert [record.action for record in records] == ran and finished == [True]
        assert all(record.end > record.start for record in records)


def test_executor_missing_handler_fails_before_running_anything():
    ran = []
    with pytest.raises(KeyError, match=r"SEND_ACTIVATION \(first needed by 0F0→1\)"):
        execute(add_communication(gpipe(2, 1)).ranks[0], {FORWARD: ran.append, BACKWARD: ran.append})
    assert ran == []


def test_plot_writes_a_png(tmp_path):
    plan = full(looped_breadth_first(4, 4, 2))
    path = plot_timeline(simulate(plan), tmp_path / "gantt.png", time_unit="units")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


# -----------------------------------------------------------------------------
# NCCL's point-to-point rule: each pair of ranks issues its sends and receives in one order


def posts_at_step_start(plan: Plan) -> Plan:
    """The old executor's order as a plan: every receive of the step posted before anything else."""
    rows = []
    for row in plan.ranks:
        kept = [action for action in row if not is_post(action)]
        receives = [a for a in kept if a is not None and a.kind in (RECV_ACTIVATION, RECV_GRADIENT)]
        rows.append([post_of(receive) for receive in receives] + kept)
    return dataclasses.replace(plan, ranks=rows, name=f"{plan.name} (receives posted at step start)")


def without_posts(plan: Plan) -> Plan:
    """Every receive issued at its RECV, where the value is consumed."""
    return dataclasses.replace(plan, ranks=[[a for a in row if not is_post(a)] for row in plan.ranks])


PIPELINE_GRID = [case for case in SCHEDULE_GRID if case[0] != "layered"]


def pipeline_plan(schedule: str, p: int, m: int, v: int) -> Plan:
    return build_plan(schedule, pipeline_degree=p, stages=p * v, micro_batches=m)


@pytest.mark.parametrize("schedule, p, m, v", PIPELINE_GRID,
                         ids=[f"{schedule}-{grid_id(case)}" for schedule, *case in PIPELINE_GRID])
def test_every_plan_issues_point_to_point_in_one_order_per_pair(schedule, p, m, v):
    """Training (reductions or ZeRO), forward-only and K-FAC step-0 plans: both sides of every pair agree."""
    transfers = add_communication(pipeline_plan(schedule, p, m, v))
    plans = [add_gradient_reductions(transfers), add_zero(transfers), forward_only(transfers),
             synchronous_plan(add_gradient_reductions(transfers))]
    for plan in plans:
        check_point_to_point_order(plan)
    sequences = issue_sequences(plans[0])
    assert sequences and all(len(sequences[rank, peer]) == len(sequences[peer, rank]) for rank, peer in sequences)
    assert simulate(plans[0]).makespan == simulate(without_posts(plans[0])).makespan  # posts cost nothing


@pytest.mark.parametrize("schedule, p, m, v", PIPELINE_GRID,
                         ids=[f"{schedule}-{grid_id(case)}" for schedule, *case in PIPELINE_GRID])
def test_each_receive_is_posted_right_after_the_ranks_previous_operation(schedule, p, m, v):
    """As early as the rules allow: each rank issues its messages in the plan's one message order
    (toward all peers: one shared communicator runs them so), and before a post stand only other
    posts, then the rank's previous operation in that order."""
    plan = add_communication(pipeline_plan(schedule, p, m, v))
    order = [message.send for message in message_order(plan)]
    for rank, issued in issue_order(plan).items():
        mine = {item.message for item in issued}
        assert [item.message for item in issued] == [message for message in order if message in mine]
        for previous, item in zip([None, *issued], issued):
            between = plan.ranks[rank][(-1 if previous is None else previous.slot) + 1:item.slot]
            assert not is_post(item.action) or all(a is None or is_post(a) for a in between), (
                str(item.action), plan.grid([(rank, item.slot)]))


def test_receive_posts_in_a_looped_plan():
    """Rank 1 posts micro-batch 1 while waiting for 0; rank 0 posts stage 2's input after its next send."""
    plan = add_communication(looped_breadth_first(2, 4, 2))
    assert plan.ranks[1][:7] == parse_row("· 1F0←0 1f1←0 1F0 1F0→2 1f2←0 1F1←0")
    assert plan.ranks[0][:8] == parse_row("0F0 0F0→1 0F1 0F1→1 2f0←1 0F2 0F2→1 2f1←1")
    assert parse_action("2f0←1").kind == POST_RECV_ACTIVATION and str(parse_action("2b0<-3")) == "2b0←3"
    with pytest.raises(ValueError, match="already has its receive posts"):
        add_receive_posts(plan)


@pytest.mark.parametrize("schedule, p, m, v", PIPELINE_GRID,
                         ids=[f"{schedule}-{grid_id(case)}" for schedule, *case in PIPELINE_GRID])
def test_receives_posted_at_step_start_are_rejected(schedule, p, m, v):
    """The old order: rank r's first operation toward r+1 is a receive, and so is r+1's toward r."""
    plan = posts_at_step_start(full(pipeline_plan(schedule, p, m, v)))
    with pytest.raises(PlanError, match="NCCL matches the point-to-point operations") as error:
        validate_plan(plan)
    assert len(error.value.marks) == 2 and str(error.value).count(">>") == 2  # both sides marked in the grid


def test_receives_issued_where_consumed_deadlock_a_looped_plan():
    """Without posts, rank 1 receives stage 1's input before sending stage 2's: rank 0 sends two first."""
    with pytest.raises(PlanError, match=r"operation #1 of rank 0 toward rank 1 is the send 0F1→1") as error:
        validate_plan(without_posts(full(looped_breadth_first(2, 4, 2))))
    assert ">>0F1→1<<" in str(error.value) and ">>1F0→2<<" in str(error.value)


@pytest.mark.parametrize("rows, sentence, marked", [
    # a receive posted before an earlier send to the same peer: both ranks' first operation is a receive
    (["0b0←1 0F0 0F0→1 0B0←1 0B0", "1F0←0 1F0 1B0 1B0→0"],
     "operation #0 of rank 0 toward rank 1 is the receive 0b0←1", ">>0b0←1<<"),
    # two same-sized messages taken in the wrong order: gloo's tags would hide it, NCCL swaps the data
    (["0F0 0F0→1 0F1 0F1→1 0B0←1 0B0 0B1←1 0B1", "1f1←0 1F0←0 1F0 1F1←0 1F1 1B0 1B0→0 1B1 1B1→0"],
     "is the receive 1f1←0 (message 0F1→1", ">>1f1←0<<"),
    (["0F0 0F0→1 0B0←1 0B0", "1F0←0 1F0 1f0←0 1B0 1B0→0"], "which is not later in rank 1's list", ">>1f0←0<<"),
])
def test_validator_rejects_orders_nccl_cannot_match(rows, sentence, marked):
    plan = broken(rows, micro_batches=2 if "0F1" in rows[0] else 1)
    with pytest.raises(PlanError) as error:
        validate_plan(plan)
    assert sentence in str(error.value) and marked in str(error.value), str(error.value)


def test_validator_accepts_hand_made_posts():
    validate_plan(broken(["0F0 0F0→1 0b0←1 0B0←1 0B0", "1f0←0 1F0←0 1F0 1B0 1B0→0"]))


def test_k_fac_cycle_plans_keep_the_order():
    plan = validate_plan(full(one_f_one_b(4, 8)))
    cost = curvature.pipefisher_cost(curvature.BlockShape(64, 4, 32, 256), flops_per_second=1.0)
    def orders(plan):
        return {pair: [item.action for item in items] for pair, items in issue_sequences(plan).items()}
    for step_plan in curvature.pack(plan, cost).plans:  # validated by pack, the order included
        assert orders(step_plan) == orders(plan)
