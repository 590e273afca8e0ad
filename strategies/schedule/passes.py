"""Passes: functions Plan -> Plan that insert the non-compute actions a strategy needs.

Executor semantics the passes rely on: sends and receive posts are issued asynchronously (isend,
irecv: they never block); a RECV blocks at its position in the list until its message is there. So
on gloo the only possible deadlock is a rank waiting on a receive whose send comes later, which the
validator's dry run detects; NCCL also needs both ranks of a pair to issue their operations in one
order, which add_communication arranges (point_to_point.add_receive_posts) and the validator checks.
Later passes insert no transfers, so they keep that order.
"""

from __future__ import annotations

import dataclasses

from .ir import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, RECV_ACTIVATION, RECV_GRADIENT, REDUCE_GRADIENT, SEND_ACTIVATION,
                 SEND_GRADIENT, Action, Plan, is_post)
from .point_to_point import add_receive_posts

# Per compute kind: (step to the stage it receives from, receive kind, step to the stage it sends to, send kind).
_FLOW = {
    FORWARD: (-1, RECV_ACTIVATION, +1, SEND_ACTIVATION),
    BACKWARD: (+1, RECV_GRADIENT, -1, SEND_GRADIENT),
    BACKWARD_INPUT: (+1, RECV_GRADIENT, -1, SEND_GRADIENT),  # a split backward's I moves B's messages; W none
}


def add_communication(plan: Plan) -> Plan:
    """Insert SEND_*/RECV_* wherever consecutive stages live on different ranks, then the receive posts.

    Each compute action becomes the body receive → compute → send: the receive (its wait) right
    before the action that consumes the value, the send right after the action that produces it.
    Consecutive stages on the same rank exchange nothing. Each receive is then issued as early as
    NCCL's in-order matching allows (point_to_point.add_receive_posts).
    """
    if plan.communicates:
        raise ValueError(f"plan {plan.name!r} already has its transfers; add_communication expects a compute-only plan")
    rows = [[step for action in row for step in _with_transfers(action, plan)] for row in plan.ranks]
    return add_receive_posts(dataclasses.replace(plan, ranks=rows))


def _with_transfers(action: Action | None, plan: Plan) -> list[Action | None]:
    if action is None or action.kind not in _FLOW:
        return [action]
    source_step, receive_kind, target_step, send_kind = _FLOW[action.kind]
    receive = _transfer(plan, receive_kind, action, action.stage + source_step)
    send = _transfer(plan, send_kind, action, action.stage + target_step)
    return [*receive, action, *send]


def _transfer(plan: Plan, kind: str, action: Action, peer_stage: int) -> list[Action]:
    crosses_ranks = 0 <= peer_stage < plan.stages and plan.rank_of(peer_stage) != plan.rank_of(action.stage)
    return [Action(kind, action.stage, action.micro_batch, peer_stage)] if crosses_ranks else []


def add_gradient_reductions(plan: Plan) -> Plan:
    """Insert REDUCE_GRADIENT(s) right after the last BACKWARD (split: BACKWARD_WEIGHT) of stage s on its rank.

    Under layered accumulation that is long before the step ends, so the data-parallel reduction of
    stage s overlaps the backward of the earlier stages. If the backward's gradient send (and
    receive posts) follow it, the reduction goes after them: the upstream rank is waiting for that
    gradient, and a posted receive lets the next message land.
    """
    if any(action.kind == REDUCE_GRADIENT for _, _, action in plan.positions()):
        raise ValueError(f"plan {plan.name!r} already has its gradient reductions")
    return dataclasses.replace(plan, ranks=[_reduce_after_last_backward(row) for row in plan.ranks])


def _reduce_after_last_backward(row: tuple[Action | None, ...]) -> list[Action | None]:
    last_backward = {action.stage: slot for slot, action in enumerate(row)
                     if action is not None and action.kind in (BACKWARD, BACKWARD_WEIGHT)}
    reduce_after = {_after_its_sends(row, slot): stage for stage, slot in last_backward.items()}
    result = []
    for slot, action in enumerate(row):
        result.append(action)
        if slot in reduce_after:
            result.append(Action(REDUCE_GRADIENT, reduce_after[slot]))
    return result


def _after_its_sends(row: tuple[Action | None, ...], slot: int) -> int:
    """The last slot of the sends and receive posts that immediately follow the compute action at `slot`."""
    stage = row[slot].stage
    while slot + 1 < len(row) and (is_post(row[slot + 1]) or row[slot + 1] is not None
                                   and row[slot + 1].kind == SEND_GRADIENT and row[slot + 1].stage == stage):
        slot += 1
    return slot
