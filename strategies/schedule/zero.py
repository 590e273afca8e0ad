"""ZeRO-3 passes: weight all-gathers before each run of a stage's compute, gradient reduce-scatters after.

A *run* is a maximal sequence of one stage's compute actions of one kind on a rank (transfers in
between do not break it). Layered accumulation has two runs per stage and step (all forwards, all
backwards), so a stage is gathered twice and reduce-scattered once: 3(n−1)/n·P per step whatever m
(docs/strategies/zero_layered.md, the ZeRO table). Depth-first accumulation has 2m runs: 3m(n−1)/n·P.

    "0Af0"  all-gather stage 0's weights for the forward run starting at micro-batch 0
    "0Ab0"  all-gather them again for the backward run starting at micro-batch 0
    "0Rs3"  reduce-scatter stage 0's gradient after the backward run ending at micro-batch 3
    "0Aw2"  all-gather them for a split backward's run starting at W of micro-batch 2 (one starting
            at I(2) is "0Ab2")

A split backward (zero-bubble schedules: I and W, Qi et al. 2023) puts I and W in one backward run
(both need the weights; a run starting at a W is gathered by "Aw", one starting at an I by "Ab"); its stage's gradient is complete only after its last W, so
the stage is reduce-scattered once, there, and the flat gradient buffer accumulates over every
backward run before it (sharding.FlatShard.attach_gradients keeps it).

Double buffering is a placement choice: the gather of run k+1 sits right before the first compute
of run k, so it is in flight while run k computes; run k−1 is complete by then, so a rank holds at
most two gathered stages (the executor's handler frees run k−1's weights when it posts run k+1's).
"""

from __future__ import annotations

import dataclasses

from .ir import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, RECV_ACTIVATION, RECV_GRADIENT, SEND_GRADIENT,
                 Action, KindInfo, Plan, is_post, weight_gradient_producer)

GATHER_FORWARD = "GATHER_FORWARD"
GATHER_BACKWARD = "GATHER_BACKWARD"
GATHER_WEIGHT = "GATHER_WEIGHT"  # a backward run that starts at a W
REDUCE_SCATTER = "REDUCE_SCATTER"
GATHER_FOR = {FORWARD: GATHER_FORWARD, BACKWARD: GATHER_BACKWARD, BACKWARD_INPUT: GATHER_BACKWARD,
              BACKWARD_WEIGHT: GATHER_WEIGHT}  # by a run's first action
GATHERS = (GATHER_FORWARD, GATHER_BACKWARD, GATHER_WEIGHT)
PHASE = {FORWARD: FORWARD, BACKWARD: BACKWARD, BACKWARD_INPUT: BACKWARD, BACKWARD_WEIGHT: BACKWARD}

# Registered by strategies/schedule/__init__.py, like every pass module's table.
ACTION_KINDS = {
    GATHER_FORWARD: KindInfo("Af", None, True, False, True),
    GATHER_BACKWARD: KindInfo("Ab", None, True, False, True),
    GATHER_WEIGHT: KindInfo("Aw", None, True, False, True),
    REDUCE_SCATTER: KindInfo("Rs", None, True, False, True),
}
# The reduce-scatter of a backward run needs the run's last backward (list order gives the others);
# under a split backward, the stage's last W.
DEPENDENCY_RULES = {
    REDUCE_SCATTER: lambda action, plan: (weight_gradient_producer(plan, action.stage, action.micro_batch),),
}


def compute_runs(row) -> list[list[tuple[int, Action]]]:
    """(slot, action) of each run of one stage's compute of one phase (forward; backward: B, or I and W), in row order."""
    runs = []
    for slot, action in enumerate(row):
        if action is None or action.kind not in GATHER_FOR:
            continue
        last = runs[-1][-1][1] if runs else None
        if last is not None and (last.stage, PHASE[last.kind]) == (action.stage, PHASE[action.kind]):
            runs[-1].append((slot, action))
        else:
            runs.append([(slot, action)])
    return runs


def add_weight_gathers(plan: Plan) -> Plan:
    """Insert one all-gather per run, posted one run ahead (double buffering): see the module docstring."""
    if any(action.kind in GATHERS for _, _, action in plan.positions()):
        raise ValueError(f"plan {plan.name!r} already has its weight gathers")
    return dataclasses.replace(plan, ranks=[_with_gathers(row) for row in plan.ranks])


def _gather(run) -> Action:
    first = run[0][1]
    return Action(GATHER_FOR[first.kind], first.stage, first.micro_batch)


def _with_gathers(row) -> list[Action | None]:
    runs = compute_runs(row)
    before = {}  # slot -> gathers to post right before it
    for index, run in enumerate(runs):
        ahead = [_gather(runs[index + 1])] if index + 1 < len(runs) else []
        before[_run_start(row, run)] = ([_gather(run)] if index == 0 else []) + ahead
    return [step for slot, action in enumerate(row) for step in [*before.get(slot, []), action]]


def _run_start(row, run) -> int:
    """The run's first slot, moved before the receive that feeds its first compute (post early)."""
    slot = run[0][0]
    first = run[0][1]
    previous = row[slot - 1] if slot > 0 else None
    if previous is not None and previous.kind in (RECV_ACTIVATION, RECV_GRADIENT) \
            and (previous.stage, previous.micro_batch) == (first.stage, first.micro_batch):
        return slot - 1
    return slot


def add_gradient_reduce_scatters(plan: Plan) -> Plan:
    """Insert REDUCE_SCATTER after each backward run, after its gradient sends (the upstream rank waits)
    and the receive posts that follow them (the handler may wait for the previous reduce-scatter)."""
    if any(action.kind == REDUCE_SCATTER for _, _, action in plan.positions()):
        raise ValueError(f"plan {plan.name!r} already has its gradient reduce-scatters")
    return dataclasses.replace(plan, ranks=[_with_reduce_scatters(row) for row in plan.ranks])


def _with_reduce_scatters(row) -> list[Action | None]:
    after = {}
    last_weight = {action.stage: slot for slot, action in enumerate(row)
                   if action is not None and action.kind == BACKWARD_WEIGHT}  # a stage's last W wins
    for run in compute_runs(row):
        slot, last = run[-1]
        if last.kind == BACKWARD or (last.kind == BACKWARD_WEIGHT and last_weight[last.stage] == slot):
            while slot + 1 < len(row) and (is_post(row[slot + 1]) or _sends_gradient_of(row[slot + 1], last)):
                slot += 1
            after[slot] = Action(REDUCE_SCATTER, last.stage, last.micro_batch)
    result = []
    for slot, action in enumerate(row):
        result += [action] + ([after[slot]] if slot in after else [])
    return result


def _sends_gradient_of(action: Action | None, backward: Action) -> bool:
    return action is not None and action.kind == SEND_GRADIENT \
        and (action.stage, action.micro_batch) == (backward.stage, backward.micro_batch)


def add_zero(plan: Plan) -> Plan:
    """The ZeRO-3 passes on a plan with its transfers: gathers, then reduce-scatters (training plans)."""
    return add_gradient_reduce_scatters(add_weight_gathers(plan))


