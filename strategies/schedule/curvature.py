"""K-FAC work units as actions, their FLOP cost, and the pass that packs them into a plan's bubbles.
(The K-FAC math itself, factors and inverses of a model, is strategies/kfac.py.)

Units of stage s (docs/strategies/pipefisher.md, PipeFisher, Osawa et al. 2023), written compactly:
    "sKaq i" curvature A (A += aᵀa) of the qkv Linears, micro-batch i, after F(s,i); q p i o =
             attention.qkv, attention.proj, mlp.fc_in, mlp.fc_out   "sKbq i" curvature B, after B(s,i)
    "sKaqh i", "sKaqt i"  the same over the head / tail half of micro-batch i's tokens (a split unit)
    "sSa"    sync A over the stage's data-parallel replicas          "sSb"    sync B
    "sIa"    inverse of A (π-damping needs A and B synced)           "sIb"    inverse of B
One unit per Linear, as the reference schedules them: whole-stage units (~2 forwards) would not
fit the one-forward gaps of 1F1B. A Linear's unit that is still too large for the smallest gap is
split over its tokens (A = Σ_tokens aᵀa, so head + tail = whole); the tail runs after the head.
Every producer of a unit runs on the unit's own rank, so a rank's list order carries the dependency:
a unit sits after its producers in the same step, or in a later step of the k-step cycle (spilled).
So the kinds have no dependency rule; `check_cycle` checks order.
Under a split backward (zero-bubble schedules, Qi et al. 2023) the curvature B of (s, i) waits for
W(s, i): I captures each Linear's output gradient g on its way to the stage input, and W, which
retraverses that path for the weights' gradients, captures it again; after W it is final.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence

from .ir import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, SEND_ARROW, Action, KindInfo, Plan, PlanError,
                 is_post)
from .simulate import Cost, TimedAction, Timeline, simulate
from .validate import validate_plan

# A unit's part: the block's linears of one role (models.BlockDescription): the attention's column
# linears (GPT's fused qkv, Llama's q, k, v), its row linear, the MLP's column linears (fc_in; SwiGLU's
# gate and up) and its row linear. Name suffixes; a block holds one architecture's.
LINEAR_PARTS = {"q": ("attention.qkv", "attention.q", "attention.k", "attention.v"), "p": ("attention.proj",),
                "i": ("mlp.fc_in", "mlp.gate", "mlp.up"), "o": ("mlp.fc_out",)}
CURVATURE = {(factor, part): f"KFAC_CURVATURE_{factor}_{part}" for factor in "AB" for part in LINEAR_PARTS}
SYNC_A, SYNC_B = "KFAC_SYNC_A", "KFAC_SYNC_B"
INVERT_A, INVERT_B = "KFAC_INVERT_A", "KFAC_INVERT_B"
CURVATURE_A = tuple(CURVATURE["A", part] for part in LINEAR_PARTS)
CURVATURE_B = tuple(CURVATURE["B", part] for part in LINEAR_PARTS)
HALVES = {kind: (f"{kind}_HEAD", f"{kind}_TAIL") for kind in CURVATURE.values()}  # whole -> (head, tail)
TOKEN_HALF = {half: index for pair in HALVES.values() for index, half in enumerate(pair)}  # half -> 0 | 1
WHOLE = {half: kind for kind, pair in HALVES.items() for half in pair}  # half -> the unit it is half of
UNITS = {kind: (factor, part) for (factor, part), kind in CURVATURE.items()}  # kind -> (factor, Linear part)
UNITS.update({half: UNITS[kind] for kind, pair in HALVES.items() for half in pair})
UNITS.update({SYNC_A: ("A", None), SYNC_B: ("B", None), INVERT_A: ("A", None), INVERT_B: ("B", None)})
PRIORITY = tuple(piece for kind in CURVATURE_A + CURVATURE_B for piece in (kind, *HALVES[kind])) + (
    SYNC_A, SYNC_B, INVERT_A, INVERT_B)  # §2's greedy order; a half takes its whole unit's place

# Registered by strategies/schedule/__init__.py, like every pass module's table. A curvature unit
# is written "Kaq", its token halves "Kaqh" and "Kaqt".
ACTION_KINDS = {piece: KindInfo(f"K{factor.lower()}{part}{suffix}", None, True, True, False)
                for (factor, part), kind in CURVATURE.items()
                for piece, suffix in zip((kind, *HALVES[kind]), ("", "h", "t"))}
ACTION_KINDS.update({SYNC_A: KindInfo("Sa", None, False, False, True), SYNC_B: KindInfo("Sb", None, False, False, True),
                     INVERT_A: KindInfo("Ia", None, False, True, False), INVERT_B: KindInfo("Ib", None, False, True, False)})
# No rules: every producer of a unit runs on the unit's own rank, so list order carries them (module docstring).
DEPENDENCY_RULES = {}


def is_curvature(kind: str) -> bool:
    return kind in UNITS and UNITS[kind][1] is not None


PIPELINE = (FORWARD, BACKWARD, BACKWARD_WEIGHT)  # the pipeline actions a unit can wait for


def gradient_kind(plan: Plan) -> str:
    """The action after which a micro-batch's output gradients g are final: W in a split plan, else B."""
    return BACKWARD_WEIGHT if BACKWARD_WEIGHT in plan.kinds else BACKWARD


def producers(unit: Action, micro_batches: int, split: frozenset = frozenset(), backward: str = BACKWARD) -> tuple:
    """What must run before `unit`, all on the unit's own rank (the step's F/B (W), or earlier units).

    `split`: the curvature kinds run as token halves (their tail waits for their head); `backward`:
    `gradient_kind` of the plan.
    """
    stage, factor = unit.stage, UNITS[unit.kind][0]
    if TOKEN_HALF.get(unit.kind) == 1:
        return (Action(HALVES[WHOLE[unit.kind]][0], stage, unit.micro_batch),)
    if is_curvature(unit.kind):
        return (Action(FORWARD if factor == "A" else backward, stage, unit.micro_batch),)
    if unit.kind in (SYNC_A, SYNC_B):
        return tuple(curvature_units(stage, CURVATURE_A if factor == "A" else CURVATURE_B, micro_batches, split))
    return Action(SYNC_A, stage), Action(SYNC_B, stage)


def curvature_units(stage: int, kinds: Sequence[str], micro_batches: int, split: frozenset = frozenset()) -> list:
    """The stage's curvature units of `kinds` by kind, then micro-batch; a kind in `split` as head, tail."""
    return [Action(piece, stage, i) for kind in kinds for i in range(micro_batches)
            for piece in (HALVES[kind] if kind in split else (kind,))]


def stage_units(stage: int, micro_batches: int, split: frozenset = frozenset()) -> list:
    """Every unit of one stage for one refresh, in priority order."""
    per_batch = curvature_units(stage, CURVATURE_A + CURVATURE_B, micro_batches, split)
    return per_batch + [Action(kind, stage) for kind in (SYNC_A, SYNC_B, INVERT_A, INVERT_B)]


# -----------------------------------------------------------------------------
# Cost model: FLOPs of a transformer block's forward and of each K-FAC unit


class BlockShape(NamedTuple):
    """What the FLOP counts need: width, MLP ratio, sequence length, tokens per micro-batch, blocks
    per stage, and the block's linears by part ((part, in, out), ...; None: the GPT block's)."""

    hidden: int
    mlp_ratio: int
    sequence_length: int
    tokens: int  # tokens of one micro-batch on one rank
    layers_per_stage: int = 1
    linears: tuple = None


def block_linears(description) -> tuple:
    """(part, in, out) of each linear of a models.BlockDescription, its part by LINEAR_PARTS."""
    part_of = {suffix: part for part, suffixes in LINEAR_PARTS.items() for suffix in suffixes}
    return tuple((part_of[linear.name], linear.fan_in, linear.fan_out) for linear in description.linears)


def linear_shapes(shape: BlockShape) -> dict:
    """(in, out) of the block's Linears by part, a tuple per part: GPT's qkv, proj, fc_in, fc_out
    one each; Llama's q, k, v and gate, up three and two (a part's linears read one input)."""
    if shape.linears is None:
        h, wide = shape.hidden, shape.mlp_ratio * shape.hidden
        return {"q": ((h, 3 * h),), "p": ((h, h),), "i": ((h, wide),), "o": ((wide, h),)}
    return {part: tuple((fan_in, fan_out) for owner, fan_in, fan_out in shape.linears if owner == part)
            for part in LINEAR_PARTS}


def every_linear(shapes: dict) -> list:
    """Every (in, out) of `linear_shapes`' parts."""
    return [pair for pairs in shapes.values() for pair in pairs]


def forward_flops(shape: BlockShape) -> float:
    """2·T·(weights) for the Linears + 4·T·s·h for QKᵀ and AV, per stage."""
    linears = sum(2 * shape.tokens * fan_in * fan_out for fan_in, fan_out in every_linear(linear_shapes(shape)))
    return shape.layers_per_stage * (linears + 4 * shape.tokens * shape.sequence_length * shape.hidden)


def unit_flops(shape: BlockShape) -> dict:
    """FLOPs of each compute unit of one stage: aᵀa / gᵀg are 2·T·n² (a half: T/2); Cholesky + inverse ≈ n³."""
    shapes, blocks = linear_shapes(shape), shape.layers_per_stage
    flops = {kind: blocks * 2 * shape.tokens * sum(pair[factor == "B"] ** 2 for pair in shapes[part])
             for (factor, part), kind in CURVATURE.items()}
    flops.update({half: flops[kind] / 2 for kind, pair in HALVES.items() for half in pair})  # ±1 token
    flops[INVERT_A] = blocks * sum(fan_in ** 3 for fan_in, _ in every_linear(shapes))
    flops[INVERT_B] = blocks * sum(fan_out ** 3 for _, fan_out in every_linear(shapes))
    return flops


def sync_bytes(shape: BlockShape, factor: str, data_degree: int, bytes_per_element: int = 4) -> float:
    """Logical all-reduce bytes of one stage's A or B factors: 2(n−1)/n · elements · bytes."""
    dims = [pair[factor == "B"] for pair in every_linear(linear_shapes(shape))]
    elements = shape.layers_per_stage * sum(n * n for n in dims)
    return 2 * (data_degree - 1) / data_degree * elements * bytes_per_element


def pipefisher_cost(shape: BlockShape, flops_per_second: float, backward_factor: float = 2.0,
                    data_degree: int = 1, bytes_per_second: float | None = None) -> Cost:
    """FLOP cost of F, B (backward_factor × F) and the K-FAC units; syncs by bandwidth; the rest 0."""
    seconds = {kind: flops / flops_per_second for kind, flops in unit_flops(shape).items()}
    seconds[FORWARD] = forward_flops(shape) / flops_per_second
    seconds[BACKWARD] = backward_factor * seconds[FORWARD]
    seconds[BACKWARD_INPUT] = seconds[BACKWARD_WEIGHT] = seconds[BACKWARD] / 2  # as simulate.flop_cost
    for kind, factor in ((SYNC_A, "A"), (SYNC_B, "B")):
        seconds[kind] = sync_bytes(shape, factor, data_degree) / bytes_per_second if bytes_per_second else 0.0
    return lambda action: seconds.get(action.kind, 0.0)


# -----------------------------------------------------------------------------
# Step 0: one synchronous K-FAC step


def synchronous_plan(plan: Plan) -> Plan:
    """Curvature right after each F / B (after its sends), sync and inversion at the end of the rank's list."""
    rows = []
    for rank, row in enumerate(plan.ranks):
        actions = [a for a in row if a is not None]
        new_row = []
        for slot, action in enumerate(actions):
            new_row.append(action)
            new_row += _curvature_after(actions, slot)
        new_row += [Action(kind, stage) for stage in plan.stages_on(rank)
                    for kind in (SYNC_A, SYNC_B, INVERT_A, INVERT_B)]
        rows.append(new_row)
    return dataclasses.replace(plan, ranks=rows, name=f"{plan.name} + synchronous K-FAC")


def _issues_transfer(action: Action) -> bool:
    """A send or a receive post: issued right after the compute it follows, before any curvature unit."""
    return action.info.arrow == SEND_ARROW or is_post(action)


def _curvature_after(actions: list, slot: int) -> list:
    """The curvature unit of the compute at the end of a compute-sends-and-posts run ending at `slot`."""
    compute = slot
    while compute >= 0 and _issues_transfer(actions[compute]):
        compute -= 1  # a row may start with receive posts
    following = actions[slot + 1] if slot + 1 < len(actions) else None
    if compute < 0 or actions[compute].kind not in PIPELINE \
            or (following is not None and _issues_transfer(following)):
        return []
    kinds = CURVATURE_A if actions[compute].kind == FORWARD else CURVATURE_B
    return [Action(kind, actions[compute].stage, actions[compute].micro_batch) for kind in kinds]


# -----------------------------------------------------------------------------
# The packing pass


@dataclasses.dataclass(frozen=True)
class Cycle:
    """The k plans of one refresh cycle, and how well the K-FAC work filled their bubbles.

    `plans[j]` is step j of the cycle (j = 0 captures curvature); `ratio` is K-FAC work / bubble
    time of one step (the busiest rank's); `fill` is filled / bubble time over the whole cycle,
    `fill_before_last` over its first k−1 steps, `packing` filled / (filled + time a unit that was
    ready did not fit), i.e. the bubble time the dependencies leave usable that the pass used;
    `split` the curvature kinds run as token halves.
    """

    plans: tuple
    needed: int  # steps the packing needed: ceil of the work with this schedule's bubbles
    ratio: float
    fill: float
    fill_before_last: float | None
    packing: float
    spilled_to_critical_path: int  # units appended after the last action (k forced too small)
    split: frozenset = frozenset()
    spilled_work: float = 0.0  # their share of the refresh's K-FAC work (cost), the part that did not fit

    @property
    def refresh_interval(self) -> int:
        return len(self.plans)

    def report(self) -> dict:
        return {"refresh_interval": self.refresh_interval, "needed": self.needed, "ratio": self.ratio,
                "fill": self.fill, "fill_before_last": self.fill_before_last, "packing": self.packing,
                "spilled_to_critical_path": self.spilled_to_critical_path, "spilled_work": self.spilled_work,
                "split_in_token_halves": sorted(ACTION_KINDS[kind].letter for kind in self.split)}


class _Gap(NamedTuple):
    position: int  # insert before the row's action at this index (len(row): at the end)
    length: float


def pack(plan: Plan, cost: Cost, refresh_interval: int | None = None, margin: float = 0.05,
         max_steps: int = 64) -> Cycle:
    """Place every K-FAC unit of one refresh in the bubbles of consecutive steps of `plan`.

    1. split into token halves the curvature units too large for the plan's smallest gap (`split_kinds`);
    2. walk each rank's gaps in time order, step after step; in each gap repeatedly place the
       highest-priority ready unit whose cost fits in what is left of the gap × (1 − margin) (§2).
    k = the steps that needs, unless `refresh_interval` forces it: extra steps stay empty, and
    units that do not fit in k steps go after the last action of step k (on the critical path).
    Each step's plan is validated (units add no transfer, so `plan`'s point-to-point order stays).
    """
    timeline = simulate(plan, cost)
    split = split_kinds(plan, timeline, cost, margin)
    limit = refresh_interval or max_steps
    per_rank = [_pack_rank(plan, rank, timeline, cost, margin, limit, split) for rank in range(plan.pipeline_degree)]
    needed = max(len(steps) for steps, _, _ in per_rank)
    if refresh_interval is None and any(leftover for _, leftover, _ in per_rank):
        raise ValueError(f"K-FAC work of {plan.name} does not fit in the bubbles of {max_steps} steps")
    k = refresh_interval or needed
    plans = tuple(validate_plan(_step_plan(plan, per_rank, step, k)) for step in range(k))  # each step runs as is
    spilled = sum(cost(unit) for _, leftover, _ in per_rank for unit in leftover)
    work = sum(cost(unit) for stage in range(plan.stages) for unit in stage_units(stage, plan.micro_batches, split))
    return Cycle(plans, needed, *_fill_figures(plan, timeline, cost, per_rank, k, split),
                 spilled_to_critical_path=sum(len(leftover) for _, leftover, _ in per_rank), split=split,
                 spilled_work=spilled / work if work else 0.0)


def split_kinds(plan: Plan, timeline: Timeline, cost: Cost, margin: float) -> frozenset:
    """Curvature kinds whose unit does not fit the plan's smallest gap (× (1 − margin)) but whose halves do.

    Large gaps take whole units anyway; the small ones (1F1B's one-forward steady-state and
    cool-down gaps) would stay empty of a unit that never fits them, and that costs a whole step of k.
    A = Σ_tokens aᵀa (and B = Σ gᵀg), so the head and tail halves add up to the whole unit's factor.
    """
    room = (1 - margin) * min((gap.length for row in timeline.ranks for gap in _gaps(row, timeline.makespan)),
                              default=0.0)
    return frozenset(kind for kind in CURVATURE.values() for stage in range(plan.stages)
                     if cost(Action(HALVES[kind][0], stage, 0)) <= room < cost(Action(kind, stage, 0)))


def _pack_rank(plan: Plan, rank: int, timeline: Timeline, cost: Cost, margin: float, limit: int, split: frozenset):
    """Per step, {gap position: units}; the units left after `limit` steps; the packing waste."""
    row = [a for a in plan.ranks[rank] if a is not None]
    waiting = [unit for stage in plan.stages_on(rank) for unit in stage_units(stage, plan.micro_batches, split)]
    done, steps, waste = set(), [], 0.0
    while waiting and len(steps) < limit:
        placed = {}
        for gap in _gaps(timeline.ranks[rank], timeline.makespan):
            before = set(row[:gap.position])  # this step's F/B that precede the gap
            ready = [unit for unit in waiting if _ready(unit, done, before, len(steps), plan, split)]
            room, units = (1 - margin) * gap.length, []
            while (unit := _first_fitting(ready, room, cost)) is not None:
                units.append(unit)
                done.add(unit)
                waiting.remove(unit)
                room -= cost(unit)
                ready = [u for u in waiting if _ready(u, done, before, len(steps), plan, split)]
            if units:
                placed[gap.position] = units
            if ready:
                waste += max(0.0, room) + margin * gap.length  # a ready unit did not fit
        steps.append(placed)
    return steps, waiting, waste


def _gaps(records: Sequence[TimedAction], makespan: float) -> list:
    """Idle intervals of one rank: before each action, and from its last action to the makespan."""
    ends = [0.0] + [record.end for record in records]
    starts = [record.start for record in records] + [makespan]
    return [_Gap(position, start - end) for position, (end, start) in enumerate(zip(ends, starts))
            if start - end > 1e-12 * max(1.0, makespan)]


def _ready(unit: Action, done: set, before: set, step: int, plan: Plan, split: frozenset) -> bool:
    """Every producer is placed already, or is an F/B (W): earlier in this step's list, or in the cycle's step 0."""
    return all(need in done or need in before or (step > 0 and need.kind in PIPELINE)
               for need in producers(unit, plan.micro_batches, split, gradient_kind(plan)))


def _first_fitting(ready: list, room: float, cost: Cost):
    return next((unit for unit in ready if cost(unit) <= room + 1e-12), None)


def _step_plan(plan: Plan, per_rank: list, step: int, k: int) -> Plan:
    rows = []
    for rank, (steps, leftover, _) in enumerate(per_rank):
        row = [a for a in plan.ranks[rank] if a is not None]
        placed = steps[step] if step < len(steps) else {}
        new_row = [unit for position, action in enumerate(row + [None])
                   for unit in placed.get(position, []) + ([action] if action is not None else [])]
        rows.append(new_row + (list(leftover) if step == k - 1 else []))
    return dataclasses.replace(plan, ranks=rows, name=f"{plan.name} + K-FAC, step {step + 1}/{k}")


def _fill_figures(plan: Plan, timeline: Timeline, cost: Cost, per_rank: list, k: int, split: frozenset) -> tuple:
    """ratio (busiest rank's work / bubble), fill over k steps, fill over k−1 steps, packing efficiency."""
    bubble = [timeline.makespan - timeline.busy(rank) for rank in range(plan.pipeline_degree)]
    work = [sum(cost(unit) for stage in plan.stages_on(rank) for unit in stage_units(stage, plan.micro_batches, split))
            for rank in range(plan.pipeline_degree)]
    filled = [[sum(cost(u) for units in placed.values() for u in units) for placed in steps] for steps, _, _ in per_rank]
    per_step = [sum(rank_steps[j] for rank_steps in filled if j < len(rank_steps)) for j in range(k)]
    total_bubble, total_filled = sum(bubble), sum(per_step)
    ratio = max(w / b if b else math.inf for w, b in zip(work, bubble))
    before_last = sum(per_step[:-1]) / ((k - 1) * total_bubble) if k > 1 else None
    waste = sum(w for _, _, w in per_rank)
    return ratio, total_filled / (k * total_bubble), before_last, total_filled / (total_filled + waste or 1.0)


# -----------------------------------------------------------------------------
# Checks and evidence


def check_cycle(base: Plan, cycle_plans: Sequence[Plan]) -> None:
    """PlanError unless each rank runs every unit of its stages once, after its producers, base order kept.

    A kind run as token halves anywhere in the cycle must run as head and tail everywhere.
    """
    split = frozenset(WHOLE[a.kind] for plan in cycle_plans for row in plan.ranks for a in row
                      if a is not None and a.kind in WHOLE)
    for rank in range(base.pipeline_degree):
        expected = [a for a in base.ranks[rank] if a is not None]
        seen = {}
        for step, plan in enumerate(cycle_plans):
            row = [a for a in plan.ranks[rank] if a is not None]
            if [a for a in row if a.kind not in PRIORITY] != expected:
                raise PlanError(f"step {step} of the K-FAC cycle changed rank {rank}'s pipeline actions", plan)
            for slot, action in enumerate(row):
                _check_unit(action, rank, step, slot, row, seen, plan, base.micro_batches, split, gradient_kind(base))
        _check_complete(base, rank, seen, split, cycle_plans[-1])


def _check_unit(action, rank, step, slot, row, seen, plan, micro_batches, split, backward) -> None:
    if action.kind not in PRIORITY:
        return
    if action in seen:
        raise PlanError(f"{action} runs twice in the K-FAC cycle (steps {seen[action][0]} and {step})", plan,
                        [(rank, slot)])
    for need in producers(action, micro_batches, split, backward):
        early = (seen.get(need, (step + 1,))[0] < step) or need in row[:slot]
        if not (early or (need.kind in PIPELINE and step > 0)):
            raise PlanError(f"{action} runs before {need} (step {step} of the K-FAC cycle)", plan, [(rank, slot)])
    seen[action] = (step, slot)


def _check_complete(base: Plan, rank: int, seen: dict, split: frozenset, plan: Plan) -> None:
    expected = [u for s in base.stages_on(rank) for u in stage_units(s, base.micro_batches, split)]
    missing, extra = [u for u in expected if u not in seen], set(seen) - set(expected)
    if extra:  # first: a whole unit in place of its halves also leaves the halves missing
        raise PlanError(f"rank {rank} runs K-FAC units not of its stages, or whole where split elsewhere: "
                        f"{', '.join(map(str, sorted(extra, key=str)))}", plan)
    if missing:
        raise PlanError(f"rank {rank} never runs K-FAC units {', '.join(map(str, missing))}", plan)


def cycle_timeline(plans: Sequence[Plan], cost: Cost) -> Timeline:
    """The k steps of a cycle simulated and laid end to end: the Gantt chart of PipeFisher."""
    ranks, offset = None, 0.0
    for plan in plans:
        timeline = simulate(plan, cost)
        shifted = [[TimedAction(r.action, r.start + offset, r.end + offset) for r in row] for row in timeline.ranks]
        ranks = shifted if ranks is None else [a + b for a, b in zip(ranks, shifted)]
        offset += timeline.makespan
    return Timeline(tuple(tuple(row) for row in ranks), plans[0].name.split(",")[0])
