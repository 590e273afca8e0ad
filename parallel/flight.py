"""A flight record of every collective and point-to-point operation a rank issues, and what it waits in.

The same idea as PyTorch's NCCL flight recorder (`TORCH_NCCL_TRACE_BUFFER_SIZE`: a ring of the last
collectives, dumped on a timeout), kept for every backend at the counted communicator, which every
operation passes through (parallel/comm.py), and by the run's evidence for its own exchange:

1. issue: an entry — kind, group (its name and ranks) or peer, bytes, its number in its group
   (the n-th collective over those ranks, the n-th send to / receive from that peer), the step and
   plan action it was issued under, the time;
2. wait: while the main thread blocks on it (a synchronous call, or `wait()` on its work handle)
   it is the rank's current wait, read by a watchdog thread (layerwise/run/hangs.py);
3. completion: when that wait returns or `is_completed()` says so.
The last `size` entries are kept (a ring), the per-group numbers for the whole run. The time spent
blocked in waits is summed per step (a step's compute time is its step time minus that) and, for the
whole run, per group and kind (`waits`: each rank's processes/rank-<k>.json at the end).
Cost: one small object and two clock reads per operation (benchmarks/overhead.py measures it).
"""

import threading
import time
from collections import deque
from typing import Optional

COLLECTIVE = "collective"


class Operation:
    """One issued operation; `completed` stays None until it is known to have finished."""

    __slots__ = ("index", "kind", "group", "ranks", "peer", "bytes", "sequence", "step", "action",
                 "issued", "completed")

    def __init__(self, index, kind, group, ranks, peer, nbytes, sequence, step, action, issued):
        self.index, self.kind, self.group, self.ranks, self.peer = index, kind, group, ranks, peer
        self.bytes, self.sequence, self.step, self.action = nbytes, sequence, step, action
        self.issued, self.completed = issued, None

    def as_dict(self) -> dict:
        entry = {name: getattr(self, name) for name in self.__slots__}
        entry["ranks"] = list(self.ranks)
        entry["action"] = None if self.action is None else str(self.action)  # a plan Action: "3F1"
        return entry


class RecordedWork:
    """A work handle whose `wait()` is recorded as the rank's current wait, and whose completion is
    noted (by `wait()` or a true `is_completed()`); everything else is the handle's own."""

    __slots__ = ("_work", "_operation", "_recorder")

    def __init__(self, work, operation: Operation, recorder: "FlightRecorder"):
        self._work, self._operation, self._recorder = work, operation, recorder

    def wait(self, *arguments, **keywords):
        with self._recorder.waiting(self._operation):
            return self._work.wait(*arguments, **keywords)

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        if done and self._operation.completed is None:
            self._operation.completed = time.time()
        return done

    def get_future(self):
        """The handle's future (torch DDP's communication hook waits on it, not on `wait()`): its
        completion is noted too."""
        future = self._work.get_future()
        operation = self._operation
        future.add_done_callback(lambda _: setattr(operation, "completed", operation.completed or time.time()))
        return future

    def __getattr__(self, name):
        return getattr(self._work, name)


class _Waiting:
    """Context manager: `operation` is the rank's current wait while inside."""

    __slots__ = ("recorder", "operation", "start")

    def __init__(self, recorder, operation):
        self.recorder, self.operation = recorder, operation

    def __enter__(self):
        self.start = time.monotonic()
        self.recorder.current = (self.operation, self.start)

    def __exit__(self, kind, value, traceback):
        recorder, now = self.recorder, time.monotonic()
        recorder.current = None
        recorder.blocked_s += now - self.start
        waited = recorder.waited.setdefault((self.operation.group, self.operation.kind), [0, 0.0])
        waited[0] += 1
        waited[1] += now - self.start
        if kind is None:
            self.operation.completed = time.time()
            recorder.last_completed = self.operation
            recorder.last_activity = now
        return False


class FlightRecorder:
    """The ring of a rank's last operations, its current wait, and its per-group numbers.

    The main thread writes; a watchdog thread reads `current` (one tuple, replaced atomically) and
    `snapshot()`. Context the strategies set: `step`, `action` (the plan action being executed),
    `phase` (the watchdog's allowance depends on it).
    """

    def __init__(self, size: int = 64):
        self.operations = deque(maxlen=size)
        self.sequences = {}  # (kind family, ranks or peer) -> operations issued so far
        self.step, self.action, self.phase = 0, None, "setup"
        self.current = None  # (Operation, monotonic start) while the main thread waits on it
        self.last_completed = None
        self.blocked_s = 0.0  # time blocked in waits since the last `take_blocked`
        self.waited = {}  # (group, kind) -> [waits, seconds blocked]: the whole run's, by where it waited
        self.last_activity = time.monotonic()  # the last issue or completed wait
        self._index = 0
        self._lock = threading.Lock()

    def issue(self, kind: str, group: str, ranks: tuple = (), peer: Optional[int] = None,
              nbytes: int = 0) -> Operation:
        """Record an operation as issued; its number counts collectives over the same ranks (one
        process group) or, for point-to-point, the same direction toward the same peer."""
        key = (kind, peer) if peer is not None else (COLLECTIVE, ranks)
        with self._lock:
            sequence = self.sequences.get(key, 0) + 1
            self.sequences[key] = sequence
            self._index += 1
            operation = Operation(self._index, kind, group, ranks, peer, nbytes, sequence, self.step,
                                  self.action, time.time())
            self.operations.append(operation)
        self.last_activity = time.monotonic()
        return operation

    def note_action(self, action) -> None:
        """The plan action the executor runs next (strategies/schedule/execute.py `on_action`)."""
        self.action = action

    def waiting(self, operation: Operation) -> _Waiting:
        return _Waiting(self, operation)

    def track(self, operation: Operation, work):
        """The work handle of an asynchronous operation, recorded; None (a synchronous call) as is."""
        return None if work is None else RecordedWork(work, operation, self)

    def waits(self) -> dict:
        """The run's waits by group and kind ("tensor all_reduce": {"waits", "seconds"}): where this rank's
        communication cost it time (a collective's whole call, a receive's wait for its message)."""
        return {f"{group} {kind}": {"waits": count, "seconds": round(seconds, 6)}
                for (group, kind), (count, seconds) in sorted(self.waited.items())}

    def take_blocked(self) -> float:
        """Seconds blocked in waits since the last call (a step's communication wait)."""
        blocked, self.blocked_s = self.blocked_s, 0.0
        return blocked

    def stalled(self, seconds: float) -> Optional[Operation]:
        """The newest operation in flight longer than `seconds` while this rank issued and finished
        nothing for as long: a wait that does not pass through `wait()` (torch DDP's reducer waits
        on the handle's future inside the backward), seen from the outside. The newest: a rank
        blocks right after it issues what it waits for."""
        if time.monotonic() - self.last_activity <= seconds:
            return None
        now = time.time()
        with self._lock:
            return next((operation for operation in reversed(self.operations)
                         if operation.completed is None and now - operation.issued > seconds), None)

    def snapshot(self, stalled: Optional[Operation] = None) -> dict:
        """What a hang record holds: the ring, the current wait, the per-group numbers."""
        with self._lock:
            operations = [operation.as_dict() for operation in self.operations]
            sequences = [{"kind": kind, "ranks": list(ranks) if kind == COLLECTIVE else None,
                          "peer": None if kind == COLLECTIVE else ranks, "issued": count}
                         for (kind, ranks), count in self.sequences.items()]
        current = self.current
        waiting = None
        if current is not None:
            waiting = {**current[0].as_dict(), "waited_s": round(time.monotonic() - current[1], 3)}
        elif stalled is not None:  # in flight, not waited on through the record: since its issue
            waiting = {**stalled.as_dict(), "waited_s": round(time.time() - stalled.issued, 3), "in_flight": True}
        last = self.last_completed
        return {"step": self.step, "action": self.action, "phase": self.phase, "waiting": waiting,
                "last_completed": None if last is None else last.as_dict(), "operations": operations,
                "issued_by_group": sequences}
