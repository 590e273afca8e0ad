"""Schedule generators: small functions that each return a compute-only `Plan`.

Every generator lists FORWARD/BACKWARD actions per rank; `passes.add_communication` adds the
transfers afterwards. Leading `None`s draw the warm-up idle slots the papers draw (rank r waits r
units for its first input); they cost nothing, the idle time itself comes from dependencies.
Every generator honours Fast-LLM's two knobs, m = breadth_first_micro_batches × depth_first: it
builds the plan of one breadth-first group and runs it depth_first times in a row.
`build_plan` is the registry used by configs: it also checks the combinations a user can get wrong
and names the config field to change.
"""

from __future__ import annotations

import dataclasses

from .ir import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action, Plan

PLACEMENTS = ("contiguous", "looping", "v")


def stage_placement(stages: int, pipeline_degree: int, placement: str = "contiguous") -> tuple[int, ...]:
    """Rank of every stage: "contiguous" puts stage c on rank c // (stages/p); "looping" on rank c mod p.

    Looping is the modular pipeline of Lamy-Poirier 2021: each micro-batch loops v = stages/p
    times around the ring of ranks. "v" (stages = 2p, ZBV: Qi et al. 2024) goes down the ranks and
    back up: stage c on rank c for c < p, else 2p − 1 − c, so rank 0 holds the first and the last.
    """
    if pipeline_degree < 1 or stages % pipeline_degree:
        raise ValueError(f"stages ({stages}) must be a positive multiple of strategy.pipeline_degree "
                         f"({pipeline_degree}): change strategy.layers_per_stage or strategy.pipeline_degree")
    if placement == "contiguous":
        return tuple(stage // (stages // pipeline_degree) for stage in range(stages))
    if placement == "looping":
        return tuple(stage % pipeline_degree for stage in range(stages))
    if placement == "v":
        if stages != 2 * pipeline_degree:
            raise ValueError(f"the V placement holds 2 stages per rank: {stages} stages for "
                             f"strategy.pipeline_degree={pipeline_degree} (set strategy.layers_per_stage to "
                             f"model.layers / (2 × pipeline_degree))")
        return tuple(stage if stage < pipeline_degree else stages - 1 - stage for stage in range(stages))
    raise ValueError(f"unknown strategy.placement {placement!r}; choose one of {', '.join(PLACEMENTS)}")


def _forwards(stages, micro_batches) -> list[Action]:
    return [Action(FORWARD, stage, micro_batch) for stage in stages for micro_batch in micro_batches]


def _backwards(stages, micro_batches) -> list[Action]:
    return [Action(BACKWARD, stage, micro_batch) for stage in stages for micro_batch in micro_batches]


def _breadth_first(micro_batches: int, breadth_first_micro_batches: int | None) -> int:
    """Fast-LLM's knobs: m = breadth_first × depth_first; breadth_first defaults to all micro-batches."""
    breadth_first = breadth_first_micro_batches or micro_batches
    if breadth_first < 1 or micro_batches % breadth_first:
        raise ValueError(f"strategy.breadth_first_micro_batches ({breadth_first}) must divide "
                         f"strategy.micro_batches ({micro_batches})")
    return breadth_first


def _in_depth_first_groups(group: Plan, micro_batches: int, name: str) -> Plan:
    """Run `group`, a plan for breadth_first micro-batches, depth_first = m / breadth_first times in a row.

    Each group drains before the next starts (that is what makes the groups depth-first); the
    micro-batches are renumbered, and only the first group keeps its leading bubble slots.
    """
    depth_first = micro_batches // group.micro_batches
    rows = [_repeat(row, depth_first, group.micro_batches) for row in group.ranks]
    return Plan(rows, group.stages, micro_batches, group.placement, name)


def _repeat(row: tuple[Action | None, ...], times: int, offset: int) -> list[Action | None]:
    lead = next((slot for slot, action in enumerate(row) if action is not None), len(row))
    return list(row[:lead]) + [None if action is None else
                               dataclasses.replace(action, micro_batch=action.micro_batch + copy * offset)
                               for copy in range(times) for action in row[lead:]]


def _name(schedule: str, micro_batches: int, breadth_first: int, **sizes: int) -> str:
    fields = [f"{key}={value}" for key, value in sizes.items()] + [f"m={micro_batches}"]
    return " ".join([schedule, *fields] + ([f"bf={breadth_first}"] if breadth_first != micro_batches else []))


def gpipe(pipeline_degree: int, micro_batches: int, breadth_first_micro_batches: int | None = None) -> Plan:
    """GPipe (Huang et al. 2019), one stage per rank: all forwards, then all backwards (per breadth-first group).

    Backwards run in the same micro-batch order as the forwards (first in, first out), as
    torch.pipelining's ScheduleGPipe does: the upstream rank then receives gradients in the order it
    sent activations, the same pattern as 1F1B and breadth-first, and the makespan is the same.
    """
    breadth_first = _breadth_first(micro_batches, breadth_first_micro_batches)
    placement = stage_placement(pipeline_degree, pipeline_degree, "contiguous")
    rows = [[None] * rank + _forwards([rank], range(breadth_first)) + _backwards([rank], range(breadth_first))
            for rank in range(pipeline_degree)]
    group = Plan(rows, pipeline_degree, breadth_first, placement)
    return _in_depth_first_groups(group, micro_batches, _name("gpipe", micro_batches, breadth_first, p=pipeline_degree))


def one_f_one_b(pipeline_degree: int, micro_batches: int, breadth_first_micro_batches: int | None = None) -> Plan:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021), one stage per rank.

    Rank r runs p−1−r warm-up forwards, then alternates one forward and one backward, then the
    cool-down backwards: at most p−r micro-batches' activations are alive at once.
    """
    breadth_first = _breadth_first(micro_batches, breadth_first_micro_batches)
    placement = stage_placement(pipeline_degree, pipeline_degree, "contiguous")
    rows = []
    for rank in range(pipeline_degree):
        warmup = min(pipeline_degree - 1 - rank, breadth_first)
        forwards = _forwards([rank], range(breadth_first))
        backwards = _backwards([rank], range(breadth_first))
        steady = [action for pair in zip(forwards[warmup:], backwards) for action in pair]
        rows.append([None] * rank + forwards[:warmup] + steady + backwards[breadth_first - warmup:])
    group = Plan(rows, pipeline_degree, breadth_first, placement)
    name = _name("one_f_one_b", micro_batches, breadth_first, p=pipeline_degree)
    return _in_depth_first_groups(group, micro_batches, name)


def looped_breadth_first(pipeline_degree: int, micro_batches: int, loops: int,
                         breadth_first_micro_batches: int | None = None) -> Plan:
    """Breadth-first looped pipeline = modular pipeline + layered gradient accumulation (Lamy-Poirier).

    Looping placement: rank r holds stages r, r+p, ..., r+(v−1)p. Per breadth-first group, rank r
    runs the forwards of every micro-batch for each local stage in order, then the backwards of
    its local stages in reverse order, all micro-batches per stage — so each stage's gradient is
    final early (see passes.add_gradient_reductions). The depth-first groups run one after another.
    """
    breadth_first = _breadth_first(micro_batches, breadth_first_micro_batches)
    stages = pipeline_degree * loops
    placement = stage_placement(stages, pipeline_degree, "looping")
    rows = []
    for rank in range(pipeline_degree):
        local = [stage for stage in range(stages) if placement[stage] == rank]
        rows.append([None] * rank + _forwards(local, range(breadth_first)) +
                    _backwards(reversed(local), range(breadth_first)))
    group = Plan(rows, stages, breadth_first, placement)
    name = _name("looped_breadth_first", micro_batches, breadth_first, p=pipeline_degree, v=loops)
    return _in_depth_first_groups(group, micro_batches, name)


def interleaved_one_f_one_b(pipeline_degree: int, micro_batches: int, loops: int,
                            breadth_first_micro_batches: int | None = None) -> Plan:
    """Megatron-LM's interleaved 1F1B (Narayanan et al. 2021): the looped *depth-first* schedule.

    Looping placement; micro-batches advance in groups of p through one local stage (a "chunk")
    after another. Rank r runs 2(p−1−r) + (v−1)p warm-up forwards, then 1F1B, then the cool-down;
    backwards visit the chunks in reverse. Needs m (and breadth_first) % p == 0.
    """
    if micro_batches % pipeline_degree:
        raise ValueError(f"interleaved_one_f_one_b needs strategy.micro_batches ({micro_batches}) to be a "
                         f"multiple of strategy.pipeline_degree ({pipeline_degree})")
    breadth_first = _breadth_first(micro_batches, breadth_first_micro_batches)
    if breadth_first % pipeline_degree:
        raise ValueError(f"interleaved_one_f_one_b needs strategy.breadth_first_micro_batches ({breadth_first}) "
                         f"to be a multiple of strategy.pipeline_degree ({pipeline_degree})")
    stages = pipeline_degree * loops
    rows = [_interleaved_row(rank, pipeline_degree, breadth_first, loops) for rank in range(pipeline_degree)]
    group = Plan(rows, stages, breadth_first, stage_placement(stages, pipeline_degree, "looping"))
    name = _name("interleaved_one_f_one_b", micro_batches, breadth_first, p=pipeline_degree, v=loops)
    return _in_depth_first_groups(group, micro_batches, name)


def _interleaved_row(rank: int, pipeline_degree: int, micro_batches: int, loops: int) -> list[Action | None]:
    """Rank `rank`'s list: its k-th forward/backward maps to (chunk, micro-batch) in groups of p micro-batches."""
    p, total = pipeline_degree, micro_batches * loops

    def action(kind: str, k: int) -> Action:
        chunk = (k % (p * loops)) // p
        chunk = chunk if kind == FORWARD else loops - 1 - chunk
        return Action(kind, chunk * p + rank, (k // (p * loops)) * p + k % p)

    warmup = min(2 * (p - 1 - rank) + (loops - 1) * p, total)
    steady = [a for k in range(total - warmup) for a in (action(FORWARD, warmup + k), action(BACKWARD, k))]
    cooldown = [action(BACKWARD, k) for k in range(total - warmup, total)]
    return [None] * rank + [action(FORWARD, k) for k in range(warmup)] + steady + cooldown


def zero_bubble_h1(pipeline_degree: int, micro_batches: int, breadth_first_micro_batches: int | None = None) -> Plan:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism" §3.1): 1F1B's peak memory, a third of its bubble.

    Each backward is split into I (input gradient, on the critical path) and W (weight gradient).
    Rank r runs 1F1B's p−1−r warm-up forwards, then F, I pairs, each followed by a W from its
    (r+1)-th pair on (W lags I by r micro-batches), then the cool-down Is with their Ws, then the r
    Ws left. At most p micro-batches are between F and W on any rank (1F1B's peak, on rank 0);
    the deferred Ws fill the cool-down: bubble (p−1)(T_F+T_B−T_W) vs 1F1B's (p−1)(T_F+T_B+T_W).
    """
    breadth_first = _breadth_first(micro_batches, breadth_first_micro_batches)
    placement = stage_placement(pipeline_degree, pipeline_degree, "contiguous")
    rows = [_zero_bubble_h1_row(rank, pipeline_degree, breadth_first) for rank in range(pipeline_degree)]
    group = Plan(rows, pipeline_degree, breadth_first, placement)
    name = _name("zero_bubble_h1", micro_batches, breadth_first, p=pipeline_degree)
    return _in_depth_first_groups(group, micro_batches, name)


def _zero_bubble_h1_row(rank: int, pipeline_degree: int, micro_batches: int) -> list[Action | None]:
    warmup = min(pipeline_degree - 1 - rank, micro_batches)
    row: list[Action | None] = [None] * rank + [Action(FORWARD, rank, i) for i in range(warmup)]
    for k in range(micro_batches):
        if warmup + k < micro_batches:
            row.append(Action(FORWARD, rank, warmup + k))
        row.append(Action(BACKWARD_INPUT, rank, k))
        if k >= rank:  # W lags I by `rank` micro-batches: the later ranks' Is reach rank 0 sooner
            row.append(Action(BACKWARD_WEIGHT, rank, k - rank))
    return row + [Action(BACKWARD_WEIGHT, rank, k) for k in range(max(micro_batches - rank, 0), micro_batches)]


def zbv(pipeline_degree: int, micro_batches: int, breadth_first_micro_batches: int | None = None) -> Plan:
    """ZBV (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory" §4): split backward on the V placement.

    2p stages, rank r holding stages r and 2p−1−r (`stage_placement` "v"), so the loss and the
    first input are on rank 0 and the turn of the V needs no transfer. Each rank's order comes
    from a unit-time list schedule (T_F = T_I = T_W per stage): at each unit a free rank starts the
    first ready of its pending Is (the later stage first: it feeds the chain back), its next F
    (the later stage first) while fewer than 2p stage-micro-batches are between F and W (1F1B's
    peak memory: p micro-batches of two half-size stages), its oldest W. With m ≥ 2p − 1 the
    paper's own table instead (`_zbv_table_row`): at unit time it is as short or one unit shorter,
    and at the costs measured here (I ≈ 1.3 T_F, W ≈ 1.0 T_F) 7–15% shorter, since each W follows
    its I; below 2p − 1 micro-batches the table idles where the list schedule does not
    (docs/strategies/modular_pipeline.md, "ZBV's order").
    """
    breadth_first = _breadth_first(micro_batches, breadth_first_micro_batches)
    stages = 2 * pipeline_degree
    placement = stage_placement(stages, pipeline_degree, "v")
    if breadth_first >= 2 * pipeline_degree - 1:
        rows = [_zbv_table_row(rank, pipeline_degree, breadth_first) for rank in range(pipeline_degree)]
    else:
        rows = _list_schedule(pipeline_degree, breadth_first, placement, cap=2 * pipeline_degree)
    group = Plan(rows, stages, breadth_first, placement)
    return _in_depth_first_groups(group, micro_batches, _name("zbv", micro_batches, breadth_first, p=pipeline_degree))


def _zbv_table_row(rank: int, pipeline_degree: int, micro_batches: int) -> list[Action]:
    """Rank `rank`'s order in ZBV's table (Qi et al. 2024 §6; torch.distributed.pipelining's
    ScheduleZBVZeroBubble runs the same), m ≥ 2p − 1, its stages `first` = r and `second` = 2p − 1 − r:
    warm-up 2(p − r) − 1 forwards of `first`, r pairs (F `second`, F `first`), p − r triples
    (F, I, W of `second`); steady: (F `first` while any remain, I, W of `first`; F, I, W of `second`)
    until both have run every forward; cool-down r pairs of Is (`first`, `second`), p − r (I, W) of
    `first`, then the Ws left, `second`'s first."""
    p, m = pipeline_degree, micro_batches
    first, second = rank, 2 * p - 1 - rank
    done = {(kind, stage): 0 for kind in (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT) for stage in (first, second)}
    row: list[Action] = [None] * rank

    def run(kind: str, stage: int) -> None:
        row.append(Action(kind, stage, done[kind, stage]))
        done[kind, stage] += 1

    def steps(*pairs) -> None:
        for kind, stage in pairs:
            run(kind, stage)
    for _ in range(2 * (p - rank) - 1):
        run(FORWARD, first)
    for _ in range(rank):
        steps((FORWARD, second), (FORWARD, first))
    for _ in range(p - rank):
        steps((FORWARD, second), (BACKWARD_INPUT, second), (BACKWARD_WEIGHT, second))
    while done[FORWARD, second] < done[FORWARD, first] or done[FORWARD, first] < m:
        if done[FORWARD, first] < m:
            run(FORWARD, first)
        steps((BACKWARD_INPUT, first), (BACKWARD_WEIGHT, first),
              (FORWARD, second), (BACKWARD_INPUT, second), (BACKWARD_WEIGHT, second))
    for _ in range(rank):
        steps((BACKWARD_INPUT, first), (BACKWARD_INPUT, second))
    for _ in range(p - rank):
        steps((BACKWARD_INPUT, first), (BACKWARD_WEIGHT, first))
    for stage in (second, first):
        while done[BACKWARD_WEIGHT, stage] < m:
            run(BACKWARD_WEIGHT, stage)
    return row


def zero_bubble_h2(pipeline_degree: int, micro_batches: int, breadth_first_micro_batches: int | None = None) -> Plan:
    """ZB-H2 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism" §3.1): no bubble for (2p−1)× a stage's stash.

    One stage per rank, backward split into I and W. Rank r fills the wait for its first I with
    forwards (2(p−1−r)+1 of them, rank 0 2p−1, where 1F1B runs p−r), then runs I > F > W by
    priority while at most 2p−1 micro-batches are between F and W (the paper's (2p−1)M_B), so the
    Ws drift to the tail and each rank works without a gap from its first input to its end: the
    parallelogram of Figure 3, bubble (p−1)(T_F+T_B−2T_W) = 0 at T_F = T_B = T_W once the step's
    synchronisation is bypassed (their §4). Needs m ≥ 2p−1 (the warm-up forwards); the order is the
    unit-time list schedule zbv uses below 2p − 1 micro-batches, on the contiguous placement.
    """
    breadth_first = _breadth_first(micro_batches, breadth_first_micro_batches)
    _check_h2_batches(pipeline_degree, micro_batches, breadth_first)
    placement = stage_placement(pipeline_degree, pipeline_degree, "contiguous")
    rows = _list_schedule(pipeline_degree, breadth_first, placement, cap=2 * pipeline_degree - 1)
    rows = [[None] * rank + row for rank, row in enumerate(rows)]  # rank r's first input arrives after r forwards
    group = Plan(rows, pipeline_degree, breadth_first, placement)
    name = _name("zero_bubble_h2", micro_batches, breadth_first, p=pipeline_degree)
    return _in_depth_first_groups(group, micro_batches, name)


def _check_h2_batches(pipeline_degree: int, micro_batches: int, breadth_first: int) -> None:
    # Rank 0 runs 2p−1 forwards before its first I arrives (Qi et al. 2023 §3.1, ZB-H2's warm-up).
    needed = 2 * pipeline_degree - 1
    if micro_batches < needed:
        raise ValueError(f"strategy.schedule=zero_bubble_h2 needs strategy.micro_batches ({micro_batches}) >= "
                         f"2 × strategy.pipeline_degree − 1 = {needed}: its warm-up runs that many forwards on "
                         f"rank 0. Fix: raise strategy.micro_batches, or use strategy.schedule=zero_bubble_h1")
    if breadth_first < needed:
        raise ValueError(f"strategy.schedule=zero_bubble_h2 needs strategy.breadth_first_micro_batches "
                         f"({breadth_first}) >= 2 × strategy.pipeline_degree − 1 = {needed} (each depth-first "
                         f"group has its own warm-up): raise it, or set it to null")


def _list_schedule(pipeline_degree: int, micro_batches: int, placement: tuple, cap: int) -> list[list[Action | None]]:
    """Every rank's F/I/W order (zbv's docstring), at most `cap` stage-micro-batches between F and W per
    rank; ends become visible one unit after a start, on every rank alike."""
    stages = len(placement)
    finished: dict[tuple[str, int, int], int] = {}  # (kind, stage, micro-batch) -> end time
    state = _ListState(next_forward=[0] * stages, inputs=[[] for _ in range(stages)],
                       weights=[[] for _ in range(pipeline_degree)], alive=[0] * pipeline_degree)
    rows: list[list[Action | None]] = [[] for _ in range(pipeline_degree)]
    time = 0
    while sum(len(row) for row in rows) < 3 * stages * micro_batches:
        def done(kind, stage, micro_batch):
            return finished.get((kind, stage, micro_batch), time + 1) <= time
        started = []
        for rank in range(pipeline_degree):
            local = sorted((stage for stage in range(stages) if placement[stage] == rank), reverse=True)
            action = _first_ready(rank, local, stages, micro_batches, cap, state, done)
            if action is not None:
                started.append(action)
                rows[rank].append(action)
        for action in started:
            finished[action.kind, action.stage, action.micro_batch] = time + 1
        time += 1
        if time > 6 * stages * (micro_batches + stages):  # cannot happen: some rank always has a ready action
            raise AssertionError(f"list schedule stalled at p={pipeline_degree}, m={micro_batches}")
    return rows


@dataclasses.dataclass
class _ListState:
    next_forward: list  # per stage: its next micro-batch to run forward
    inputs: list  # per stage: micro-batches whose F ran and whose I has not, oldest first
    weights: list  # per rank: its I actions whose W has not run, oldest first
    alive: list  # per rank: stage-micro-batches between F and W


def _first_ready(rank, local, stages, micro_batches, cap, state, done) -> Action | None:
    for stage in local:
        pending = state.inputs[stage]
        if pending and done(FORWARD, stage, pending[0]) and \
                (stage == stages - 1 or done(BACKWARD_INPUT, stage + 1, pending[0])):
            action = Action(BACKWARD_INPUT, stage, pending.pop(0))
            state.weights[rank].append(action)
            return action
    if state.alive[rank] < cap:
        for stage in local:
            micro_batch = state.next_forward[stage]
            if micro_batch < micro_batches and (stage == 0 or done(FORWARD, stage - 1, micro_batch)):
                state.next_forward[stage] += 1
                state.inputs[stage].append(micro_batch)
                state.alive[rank] += 1
                return Action(FORWARD, stage, micro_batch)
    if state.weights[rank]:
        state.alive[rank] -= 1
        return dataclasses.replace(state.weights[rank].pop(0), kind=BACKWARD_WEIGHT)
    return None


def layered(stages: int, micro_batches: int, breadth_first_micro_batches: int | None = None) -> Plan:
    """Single-rank layered gradient accumulation: `looped_breadth_first` at p = 1.

    breadth_first = m: every micro-batch through stage 0, then stage 1, ...; breadth_first = 1:
    ordinary depth-first accumulation (one micro-batch through all stages, forward then backward).
    """
    plan = looped_breadth_first(1, micro_batches, stages, breadth_first_micro_batches)
    breadth_first = _breadth_first(micro_batches, breadth_first_micro_batches)
    return dataclasses.replace(plan, name=_name("layered", micro_batches, breadth_first, stages=stages))


# -----------------------------------------------------------------------------
# Registry with the config-time checks


SCHEDULES = ("gpipe", "one_f_one_b", "looped_breadth_first", "interleaved_one_f_one_b", "layered",
             "zero_bubble_h1", "zero_bubble_h2", "zbv")
ZERO_BUBBLE = ("zero_bubble_h1", "zero_bubble_h2", "zbv")  # split backward (I + W): one stage per rank, two (V) for zbv
ONE_STAGE_PER_RANK = ("gpipe", "one_f_one_b", "zero_bubble_h1", "zero_bubble_h2")  # layers_per_stage = layers / p


def build_plan(schedule: str, *, pipeline_degree: int, stages: int, micro_batches: int,
               breadth_first_micro_batches: int | None = None) -> Plan:
    """The compute-only plan named `schedule`.

    ValueError naming the config field and the fix when the combination is wrong.
    """
    _check_combination(schedule, pipeline_degree, stages, micro_batches, breadth_first_micro_batches)
    loops = stages // pipeline_degree
    breadth_first = breadth_first_micro_batches
    if schedule == "gpipe":
        return gpipe(pipeline_degree, micro_batches, breadth_first)
    if schedule == "one_f_one_b":
        return one_f_one_b(pipeline_degree, micro_batches, breadth_first)
    if schedule == "looped_breadth_first":
        return looped_breadth_first(pipeline_degree, micro_batches, loops, breadth_first)
    if schedule == "interleaved_one_f_one_b":
        return interleaved_one_f_one_b(pipeline_degree, micro_batches, loops, breadth_first)
    if schedule == "zero_bubble_h1":
        return zero_bubble_h1(pipeline_degree, micro_batches, breadth_first)
    if schedule == "zero_bubble_h2":
        return zero_bubble_h2(pipeline_degree, micro_batches, breadth_first)
    if schedule == "zbv":
        return zbv(pipeline_degree, micro_batches, breadth_first)
    return layered(stages, micro_batches, breadth_first)


def _check_combination(schedule, pipeline_degree, stages, micro_batches, breadth_first) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown strategy.schedule {schedule!r}; valid names: {', '.join(SCHEDULES)}")
    if pipeline_degree < 1 or micro_batches < 1:
        raise ValueError(f"strategy.pipeline_degree ({pipeline_degree}) and strategy.micro_batches "
                         f"({micro_batches}) must be at least 1")
    stage_placement(stages, pipeline_degree)  # stages must be a multiple of p
    if schedule == "zbv" and stages != 2 * pipeline_degree:
        raise ValueError(f"strategy.schedule=zbv puts two stages on each rank (the V placement) but there are "
                         f"{stages} stages for strategy.pipeline_degree={pipeline_degree}: set "
                         f"strategy.layers_per_stage to model.layers / (2 × pipeline_degree)")
    if schedule in ONE_STAGE_PER_RANK and stages != pipeline_degree:
        raise ValueError(f"strategy.schedule={schedule} puts one stage on each rank but there are {stages} "
                         f"stages for strategy.pipeline_degree={pipeline_degree}: set strategy.layers_per_stage "
                         f"to model.layers / pipeline_degree, or use strategy.schedule=looped_breadth_first")
    if schedule == "layered" and pipeline_degree != 1:
        raise ValueError(f"strategy.schedule=layered runs on one rank: set strategy.pipeline_degree=1 "
                         f"(got {pipeline_degree}) or use strategy.schedule=looped_breadth_first")
    if schedule == "zero_bubble_h2":
        _check_h2_batches(pipeline_degree, micro_batches, breadth_first or micro_batches)
    if schedule == "looped_breadth_first" and stages > pipeline_degree:
        _check_looped_batches(pipeline_degree, micro_batches, breadth_first or micro_batches)


def _check_looped_batches(pipeline_degree, micro_batches, breadth_first) -> None:
    # With fewer micro-batches in flight than ranks, every loop transition waits for the ring (docs/strategies/modular_pipeline.md).
    if micro_batches < pipeline_degree:
        raise ValueError(f"strategy.micro_batches ({micro_batches}) must be >= strategy.pipeline_degree "
                         f"({pipeline_degree}) for a looped schedule, which otherwise stalls at every loop "
                         f"transition: raise strategy.micro_batches or lower strategy.pipeline_degree")
    if breadth_first < pipeline_degree:
        raise ValueError(f"strategy.breadth_first_micro_batches ({breadth_first}) must be >= "
                         f"strategy.pipeline_degree ({pipeline_degree}): each depth-first group of a looped "
                         f"schedule stalls at every loop transition otherwise")
