"""The L2L relay as a plan: a single-rank layered plan plus the host<->device actions (docs/strategies/l2l.md).

    plan = add_host_transfers(relay_plan(stages, micro_batches), prefetch=True)

`layered(stages, m)` already runs every micro-batch through stage 0, then stage 1, ... and back.
`add_host_transfers` wraps each stage's run of forwards (backwards) in a weight copy to the device
and a release, and follows each run of backwards by the gradient's trip to the host, the optional
data-parallel reduction and the host's eager update of that stage. With `prefetch`, the copy of the
next stage is issued before this stage computes (Pudipeddi et al. 2020: two layers in flight).
"""

from __future__ import annotations

import dataclasses
import itertools

from .generators import layered
from .ir import BACKWARD, FORWARD, REDUCE_GRADIENT, Action, KindInfo, Plan, Rule

# The host<->device kinds. One kind per sweep, because each stage's weights travel twice per step
# and an action occurs once per plan.
WEIGHTS_FORWARD = "WEIGHTS_FORWARD"  # "3Wf": copy stage 3's weights host -> device for its forwards
WEIGHTS_BACKWARD = "WEIGHTS_BACKWARD"  # "3Wb": copy them again for its recompute + backwards
RELEASE_FORWARD = "RELEASE_FORWARD"  # "3Ef": free stage 3's device weights after its forwards
RELEASE_BACKWARD = "RELEASE_BACKWARD"  # "3Eb": free them (and their gradients) after its backwards
GRADIENT_TO_HOST = "GRADIENT_TO_HOST"  # "3Gh": copy stage 3's accumulated gradient device -> host
UPDATE_ON_HOST = "UPDATE_ON_HOST"  # "3Uh": the host optimizer updates stage 3, eagerly, in the background

_LOAD = {FORWARD: WEIGHTS_FORWARD, BACKWARD: WEIGHTS_BACKWARD}


def offloads(plan: Plan) -> bool:
    """Whether weights travel host -> device explicitly (after `add_host_transfers`)."""
    return WEIGHTS_FORWARD in plan.kinds


def _weights_on_device(action: Action, plan: Plan) -> tuple[Action, ...]:
    """In an offloaded plan, a stage's F and B also wait for its weights to reach the device."""
    return (Action(_LOAD[action.kind], action.stage),) if offloads(plan) else ()


def _every_micro_batch(kind: str, *stage_kinds: str) -> Rule:
    """Rule: every `kind` action of the stage (one per micro-batch), then the stage-level `stage_kinds`."""
    return lambda action, plan: tuple(Action(kind, action.stage, micro_batch)
                                      for micro_batch in range(plan.micro_batches)) + tuple(
        Action(stage_kind, action.stage) for stage_kind in stage_kinds)


# Registered by strategies/schedule/__init__.py, like every pass module's table.
ACTION_KINDS = {
    WEIGHTS_FORWARD: KindInfo("Wf", None, False, False, True),
    WEIGHTS_BACKWARD: KindInfo("Wb", None, False, False, True),
    RELEASE_FORWARD: KindInfo("Ef", None, False, False, False),
    RELEASE_BACKWARD: KindInfo("Eb", None, False, False, False),
    GRADIENT_TO_HOST: KindInfo("Gh", None, False, False, True),
    UPDATE_ON_HOST: KindInfo("Uh", None, False, False, False),
}
# Weights are freed and gradients leave once every micro-batch of the stage has run.
DEPENDENCY_RULES = {
    FORWARD: _weights_on_device,
    BACKWARD: _weights_on_device,
    RELEASE_FORWARD: _every_micro_batch(FORWARD),
    GRADIENT_TO_HOST: _every_micro_batch(BACKWARD),
    RELEASE_BACKWARD: _every_micro_batch(BACKWARD, GRADIENT_TO_HOST),
    UPDATE_ON_HOST: lambda action, plan: (Action(GRADIENT_TO_HOST, action.stage),),
}


def relay_plan(stages: int, micro_batches: int, prefetch: bool = True, reduce: bool = False) -> Plan:
    """The whole L2L step: `layered` with every micro-batch breadth-first, then the host transfers."""
    plan = add_host_transfers(layered(stages, micro_batches), prefetch=prefetch, reduce=reduce)
    return dataclasses.replace(plan, name=f"l2l_relay stages={stages} m={micro_batches}"
                                          f"{' prefetch' if prefetch else ''}{' dp' if reduce else ''}")


def add_host_transfers(plan: Plan, prefetch: bool = True, reduce: bool = False) -> Plan:
    """Insert Wf/Wb (weights to device), Ef/Eb (release), Gh (gradient to host), R (reduce), Uh (update).

    Needs a one-rank plan whose stages each run all their micro-batches in one go (breadth-first =
    m): the relay copies each stage's weights once per sweep, so transfers do not grow with m.
    """
    if plan.pipeline_degree != 1 or offloads(plan):
        raise ValueError(f"plan {plan.name!r}: add_host_transfers expects a compute-only one-rank plan")
    runs = _runs(plan.ranks[0])
    if len({(kind, stage) for kind, stage, _ in runs}) != len(runs):
        raise ValueError(f"plan {plan.name!r} visits a stage twice per sweep: the relay needs "
                         f"strategy.breadth_first_micro_batches = strategy.micro_batches")
    row = []
    for index, (kind, stage, actions) in enumerate(runs):
        if index == 0 or not prefetch:
            row.append(_load(runs[index]))
        if prefetch and index + 1 < len(runs):
            row.append(_load(runs[index + 1]))  # copy the next stage while this one computes
        row += actions
        row += _after_backward(stage, reduce) if kind == BACKWARD else [Action(RELEASE_FORWARD, stage)]
    return dataclasses.replace(plan, ranks=[row])


def _runs(row) -> list[tuple[str, int, list[Action]]]:
    """Consecutive compute actions grouped by (kind, stage)."""
    compute = [action for action in row if action is not None]
    return [(kind, stage, list(group))
            for (kind, stage), group in itertools.groupby(compute, key=lambda a: (a.kind, a.stage))]


def _load(run) -> Action:
    kind, stage, _ = run
    return Action(_LOAD[kind], stage)


def _after_backward(stage: int, reduce: bool) -> list[Action]:
    # The gradient must leave before its device copy is freed; the host then reduces and updates it
    # while the device already runs the earlier stages (the eager parameter server).
    reduction = [Action(REDUCE_GRADIENT, stage)] if reduce else []
    return [Action(GRADIENT_TO_HOST, stage), Action(RELEASE_BACKWARD, stage), *reduction,
            Action(UPDATE_ON_HOST, stage)]


def transfer_cost(stage_bytes, bandwidth: float, forward_seconds, backward_factor: float = 2.0):
    """Cost model for `simulate`: compute from `forward_seconds(stage)`, copies from bytes / bandwidth.

    The simulator runs one rank's list in order, so copies are not overlapped with compute here: the
    makespan is the relay's upper bound (a CUDA copy stream hides them when T ≥ bytes·F/(2·BW)).
    """
    def cost(action: Action) -> float:
        if action.kind == FORWARD:
            return forward_seconds(action.stage)
        if action.kind == BACKWARD:
            return backward_factor * forward_seconds(action.stage)
        if action.kind in (WEIGHTS_FORWARD, WEIGHTS_BACKWARD, GRADIENT_TO_HOST):
            return stage_bytes(action.stage) / bandwidth
        return 0.0
    return cost
