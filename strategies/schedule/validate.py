"""The validator: every plan is checked before it runs, and a fault is shown on the rank × slot grid.

Checks, in order: shape (stage, micro-batch and rank numbers in range), each action on the rank
its stage is placed on, each action at most once and every F and B (or, split, its I and W) exactly
once, F before its B (or I, and I before its W) on a rank, every transfer paired with its other end, every receive post before its RECV, every
dependency present, a unit-time dry run (the simulator itself) that always makes progress, and
NCCL's two rules (point_to_point.py): each pair of ranks issues its point-to-point operations in
one order, and no cycle of ranks each waits for the next when every rank runs its operations
toward all peers one at a time, as a group's one communicator does (torch 2.11-2.13 with an
eagerly initialised group, which Lightning makes on GPUs).
"""

from __future__ import annotations

from .ir import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, SEND_ARROW, Action, Plan, PlanError, counterpart, dependencies, is_post,
                 posted_receive)
from .point_to_point import check_point_to_point_order
from .simulate import simulate, unit_cost

__all__ = ["PlanError", "validate_plan"]


def validate_plan(plan: Plan) -> Plan:
    """Raise PlanError at the first fault (one sentence + the grid with the fault marked); return `plan` if sound."""
    for check in (_check_shape, _check_placement, _check_once, _check_forward_before_backward,
                  _check_transfers_paired, _check_posts_precede_receives, _check_dependencies_present):
        check(plan)
    simulate(plan, unit_cost)  # the dry run: raises PlanError on a cyclic wait
    check_point_to_point_order(plan)
    return plan


def _check_shape(plan: Plan) -> None:
    if len(plan.placement) != plan.stages or not all(0 <= rank < plan.pipeline_degree for rank in plan.placement):
        raise PlanError(f"placement {plan.placement} must give one rank in 0..{plan.pipeline_degree - 1} "
                        f"for each of the {plan.stages} stages.", plan)
    for rank, slot, action in plan.positions():
        stages_ok = all(0 <= stage < plan.stages for stage in (action.stage, action.peer_stage) if stage is not None)
        if not stages_ok or not (action.micro_batch is None or 0 <= action.micro_batch < plan.micro_batches):
            raise PlanError(f"{action} names a stage or micro-batch outside the plan's "
                            f"{plan.stages} stages and {plan.micro_batches} micro-batches.", plan, [(rank, slot)])


def _check_placement(plan: Plan) -> None:
    for rank, slot, action in plan.positions():
        if plan.rank_of(action.stage) != rank:
            raise PlanError(f"{action} is on rank {rank} but stage {action.stage} is placed on rank "
                            f"{plan.rank_of(action.stage)}.", plan, [(rank, slot)])


def _check_once(plan: Plan) -> None:
    seen: dict[Action, tuple[int, int]] = {}
    for rank, slot, action in plan.positions():
        if action in seen:
            raise PlanError(f"{action} occurs twice (first at rank {seen[action][0]}, slot {seen[action][1]}).",
                            plan, [seen[action], (rank, slot)])
        seen[action] = (rank, slot)
    for stage in range(plan.stages):
        for micro_batch in range(plan.micro_batches):
            for needed in _compute_of(stage, micro_batch, seen):
                if needed not in seen:
                    raise PlanError(f"{needed} is missing: each stage runs the forward and the backward (fused B, "
                                    f"or split into I and W) of every micro-batch exactly once (stage {stage} is "
                                    f"on rank {plan.rank_of(stage)}).", plan)
            if Action(BACKWARD, stage, micro_batch) in seen and Action(BACKWARD_INPUT, stage, micro_batch) in seen:
                raise PlanError(f"{Action(BACKWARD, stage, micro_batch)} and {Action(BACKWARD_INPUT, stage, micro_batch)}"
                                f" both occur: a micro-batch's backward of a stage is fused (B) or split (I + W), "
                                f"not both.", plan, [seen[Action(BACKWARD, stage, micro_batch)]])


def _compute_of(stage: int, micro_batch: int, seen: dict) -> tuple[Action, ...]:
    """The compute actions (stage, micro_batch) needs: F and B, or F, I and W when the plan splits its backward."""
    split = Action(BACKWARD_INPUT, stage, micro_batch) in seen or Action(BACKWARD_WEIGHT, stage, micro_batch) in seen
    backward = (BACKWARD_INPUT, BACKWARD_WEIGHT) if split else (BACKWARD,)
    return tuple(Action(kind, stage, micro_batch) for kind in (FORWARD, *backward))


_COMES_AFTER = {BACKWARD: FORWARD, BACKWARD_INPUT: FORWARD, BACKWARD_WEIGHT: BACKWARD_INPUT}


def _check_forward_before_backward(plan: Plan) -> None:
    for rank, row in enumerate(plan.ranks):
        done = set()
        for slot, action in enumerate(row):
            if action is not None and action.kind in _COMES_AFTER:
                before = Action(_COMES_AFTER[action.kind], action.stage, action.micro_batch)
                if before not in done:
                    what = "forward" if before.kind == FORWARD else "input gradient"
                    raise PlanError(f"{action} comes before its {what} {before} on rank {rank}.",
                                    plan, [(rank, slot)])
            done.add(action)


def _check_transfers_paired(plan: Plan) -> None:
    present = {action for _, _, action in plan.positions()}
    for rank, slot, action in plan.positions():
        if action.info.arrow is not None and counterpart(action) not in present:
            role = "send" if action.info.arrow == SEND_ARROW else "receive"
            raise PlanError(f"{action} is a {role} with no matching {counterpart(action)} on rank "
                            f"{plan.rank_of(action.peer_stage)}.", plan, [(rank, slot)])


def _check_posts_precede_receives(plan: Plan) -> None:
    for rank, row in enumerate(plan.ranks):
        slots = {action: slot for slot, action in enumerate(row) if action is not None}
        for slot, action in enumerate(row):
            if is_post(action) and slots.get(posted_receive(action), -1) < slot:
                raise PlanError(f"{action} posts the receive {posted_receive(action)}, which is not later "
                                f"in rank {rank}'s list.", plan, [(rank, slot)])


def _check_dependencies_present(plan: Plan) -> None:
    present = {action for _, _, action in plan.positions()}
    for rank, slot, action in plan.positions():
        for dependency in dependencies(action, plan):
            if dependency not in present:
                raise PlanError(f"{action} needs {dependency}, which is in no rank's list "
                                f"(add_communication inserts every transfer).", plan, [(rank, slot)])
