"""The one executor: runs one rank's list of actions by dispatching on the action kind.

The executor knows nothing about torch or process groups: a strategy supplies one handler per kind
(forward, backward, isend, blocking recv, reduction, ...) and, optionally, a FINISH handler called
once after the last action (e.g. to wait for outstanding sends).
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, NamedTuple, Sequence

from .ir import Action

FINISH = "FINISH"  # handler key, not an action kind: called with no argument after the last action


class ExecutedAction(NamedTuple):
    """An action as it ran: clock() before and after its handler (same shape as simulate.TimedAction)."""

    action: Action
    start: float
    end: float


def execute(actions: Sequence[Action | None], handlers: Mapping[str, Callable],
            clock: Callable[[], float] = time.perf_counter,
            on_action: Callable[[Action], None] | None = None) -> list[ExecutedAction]:
    """Run `actions` in order with `handlers[action.kind](action)`; bubbles (None) are skipped.

    Every kind is checked for a handler before anything runs, so a step never stops half-way on a
    missing handler. `on_action(action)`, if given, hears each action before it runs (the flight
    record names the action an operation was issued under). Returns the timed records (feed them
    to Timeline.from_records).
    """
    _check_handlers(actions, handlers)
    records = []
    for action in actions:
        if action is None:
            continue
        if on_action is not None:
            on_action(action)
        start = clock()
        handlers[action.kind](action)
        records.append(ExecutedAction(action, start, clock()))
    if FINISH in handlers:
        handlers[FINISH]()
    return records


def _check_handlers(actions: Sequence[Action | None], handlers: Mapping[str, Callable]) -> None:
    for action in actions:
        if action is not None and action.kind not in handlers:
            raise KeyError(f"no handler for action kind {action.kind} (first needed by {action}); "
                           f"handlers exist for: {', '.join(sorted(handlers)) or 'nothing'}")
