"""The one simulator: a plan and a cost model in, a `Timeline` out.

Each rank runs its list in order; an action starts when its rank is free and every action it
depends on (`ir.dependencies`, a receive waits for its send) has finished. `None` slots cost
nothing: they are drawn bubbles, the idle time comes from dependencies — otherwise a plan's makespan
would depend on how many bubbles its generator chose to draw. Measured executor records become
the same `Timeline` type, so bubble fractions are computed one way for both.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Sequence

from .ir import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, RECV_ACTIVATION, RECV_GRADIENT, Action, Plan, PlanError, dependencies

Cost = Callable[[Action], float]


class TimedAction(NamedTuple):
    """An action with its start and end time (seconds, or units under `unit_cost`)."""

    action: Action
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Per-rank (action, start, end) records of one step, simulated or measured, starting at time 0."""

    ranks: tuple[tuple[TimedAction, ...], ...]
    name: str = ""

    @classmethod
    def from_records(cls, records_by_rank: Sequence[Sequence[tuple[Action, float, float]]], name: str = "") -> Timeline:
        """Measured (action, start, end) triples per rank (e.g. the executor's), shifted so the earliest start is 0."""
        origin = min((start for row in records_by_rank for _, start, _ in row), default=0.0)
        ranks = tuple(tuple(TimedAction(action, start - origin, end - origin) for action, start, end in row)
                      for row in records_by_rank)
        return cls(ranks, name)

    @property
    def makespan(self) -> float:
        """End of the last action on any rank."""
        return max((record.end for row in self.ranks for record in row), default=0.0)

    def busy(self, rank: int) -> float:
        """Time `rank` spends on compute (communication and waiting are not busy)."""
        return sum(record.end - record.start for record in self.ranks[rank] if record.action.info.is_compute)

    @property
    def ideal(self) -> float:
        """Makespan without bubbles: the busiest rank's compute time."""
        return max((self.busy(rank) for rank in range(len(self.ranks))), default=0.0)

    @property
    def bubble_fraction(self) -> float:
        """Idle compute time / (makespan × ranks)."""
        capacity = self.makespan * len(self.ranks)
        busy = sum(self.busy(rank) for rank in range(len(self.ranks)))
        return 1.0 - busy / capacity if capacity else 0.0


# -----------------------------------------------------------------------------
# Cost models


def unit_cost(action: Action) -> float:
    """docs/strategies/modular_pipeline.md's unit cost: every compute action takes 1, communication and reductions 0."""
    return 1.0 if action.info.is_compute else 0.0


def flop_cost(forward_flops_per_stage: Sequence[float] | float, flops_per_second: float, backward_factor: float = 2.0,
              bytes_per_second: float | None = None, activation_bytes: float = 0) -> Cost:
    """Cost model from FLOPs: F(s) = flops[s] / (FLOP/s), B(s) = backward_factor × F(s); a split backward's
    I(s) and W(s) take half of B(s) each (the input- and weight-gradient products have equal FLOPs).

    A receive's wait takes activation_bytes / bytes_per_second (gradients are the same size); sends
    and receive posts cost nothing on their rank (issued asynchronously); other kinds cost 0.
    """
    def forward_seconds(stage: int) -> float:
        flops = forward_flops_per_stage if isinstance(forward_flops_per_stage, (int, float)) \
            else forward_flops_per_stage[stage]
        return flops / flops_per_second

    def cost(action: Action) -> float:
        if action.kind == FORWARD:
            return forward_seconds(action.stage)
        if action.kind == BACKWARD:
            return backward_factor * forward_seconds(action.stage)
        if action.kind in (BACKWARD_INPUT, BACKWARD_WEIGHT):  # each half of B (Qi et al. 2023: T_B ≈ T_W)
            return backward_factor / 2 * forward_seconds(action.stage)
        is_receive = action.kind in (RECV_ACTIVATION, RECV_GRADIENT)
        return activation_bytes / bytes_per_second if is_receive and bytes_per_second else 0.0

    return cost


# -----------------------------------------------------------------------------
# The simulator


def simulate(plan: Plan, cost: Cost = unit_cost, core_share: float = 1.0) -> Timeline:
    """Time `plan` under `cost`; PlanError with the waiting actions marked if it gets stuck (a cyclic wait).

    Walks the plan's run order (`Plan.order`, numbered once per plan): an action starts at the later
    of its rank's previous end and its dependencies' ends, so any order a dry run can take gives the
    same times, and the layout search's many cost models of one plan share its order.
    `core_share` < 1 (cores ÷ ranks of a CPU node) runs the same rules in time order with the cores
    shared (`_shared_cores`): `cost` is then a compute action's seconds on a core of its own.
    """
    order = plan.order  # each action starts when its rank's previous one and its needs have ended
    if order.stuck is not None:  # a cyclic wait: a property of the plan, whatever the costs
        raise _stuck(plan, order.stuck, set(order.actions))
    if core_share < 1:
        return _shared_cores(plan, cost, core_share)
    ends: list[float] = []
    timed: list[list[TimedAction]] = [[] for _ in plan.ranks]
    for action, rank, previous, needs in zip(order.actions, order.rank, order.previous, order.needs):
        start = ends[previous] if previous >= 0 else 0.0
        for need in needs:
            if ends[need] > start:
                start = ends[need]
        ends.append(start + cost(action))
        timed[rank].append(TimedAction(action, start, ends[-1]))
    return Timeline(tuple(tuple(row) for row in timed), plan.name)


def _shared_cores(plan: Plan, cost: Cost, share: float) -> Timeline:
    """Processor sharing (Kleinrock 1967): the node's ranks time-share its cores, so while n of the
    plan's p ranks compute (each standing for ranks ÷ p of the node: its data and tensor peers run
    the same list) each advances at min(1, share · p ÷ n) of a core; a rank that waits (a bubble, a
    message's or a reduction's latency: non-compute actions keep their cost) leaves its core to the
    others. Event by event: start what can start, run to the next completion (`simulate` has refused
    a plan with a cyclic wait, so every action starts)."""
    cursor, now, end = [0] * plan.pipeline_degree, 0.0, {}
    timed: list[list[TimedAction]] = [[] for _ in plan.ranks]
    running: dict[int, list] = {}  # rank -> [action, start, seconds left] (a wait's at full speed)
    while True:
        for rank, row in enumerate(plan.ranks):  # every dependency that has ended, ended by now
            while rank not in running and cursor[rank] < len(row):
                action = row[cursor[rank]]
                if action is not None:
                    if any(dependency not in end for dependency in plan.needs[action]):
                        break
                    running[rank] = [action, now, cost(action)]
                cursor[rank] += 1
        if not running:
            break
        computing = sum(action.info.is_compute for action, _, _ in running.values())
        rate = min(1.0, share * plan.pipeline_degree / computing) if computing else 1.0
        speed = {rank: rate if action.info.is_compute else 1.0 for rank, (action, _, _) in running.items()}
        step = min(left / speed[rank] for rank, (_, _, left) in running.items())
        now += step
        for rank in list(running):
            running[rank][2] -= step * speed[rank]
            action, start, left = running[rank]
            if left <= 1e-12 * max(1.0, now):
                end[action] = now
                timed[rank].append(TimedAction(action, start, now))
                del running[rank]
    return Timeline(tuple(tuple(row) for row in timed), plan.name)


def _stuck(plan: Plan, cursor: Sequence[int], ended: set) -> PlanError:
    """Describe every blocked rank: where it waits (its `cursor`), and for what (what has not `ended`)."""
    where = {action: (rank, slot) for rank, slot, action in plan.positions()}
    waits, marks = [], []
    for rank, row in enumerate(plan.ranks):
        if cursor[rank] < len(row):
            action = row[cursor[rank]]
            missing = [_describe(dependency, where, rank) for dependency in dependencies(action, plan)
                       if dependency not in ended]
            waits.append(f"rank {rank} waits at {action} for {', '.join(missing)}")
            marks.append((rank, cursor[rank]))
    return PlanError(f"Dry run is stuck (cyclic wait): {'; '.join(waits)}.", plan, marks)


def _describe(dependency: Action, where: dict, waiting_rank: int) -> str:
    if dependency not in where:
        return f"{dependency} (in no rank's list)"
    rank, slot = where[dependency]
    return f"{dependency} ({'later on its own list' if rank == waiting_rank else f'rank {rank}'}, slot {slot})"
