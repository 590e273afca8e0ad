"""Schedule IR: generators match TECHNIQUES.md §1 under unit cost, passes and validator, executor, plotter.

Test ids: p = pipeline degree, m = micro-batches, v = loops (stages per rank), bf = breadth-first micro-batches.
"""

import itertools

import pytest

from strategies.schedule import (BACKWARD, FINISH, FORWARD, KINDS, RECV_ACTIVATION, REDUCE_GRADIENT, SCHEDULES,
                                 SEND_ACTIVATION, Action, Plan, PlanError, Timeline, add_communication,
                                 add_gradient_reductions, build_plan, dependencies, execute, flop_cost, gpipe,
                                 interleaved_one_f_one_b, layered, looped_breadth_first, one_f_one_b, parse_action,
                                 parse_row, plot_timeline, simulate, stage_placement, unit_cost, validate_plan)

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
# Generators under unit cost: TECHNIQUES.md §1


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


SCHEDULE_GRID = [(schedule, *case) for schedule in SCHEDULES for case in GRID
                 if schedule not in ("gpipe", "one_f_one_b") or case[2] == 1]  # those put one stage per rank


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
