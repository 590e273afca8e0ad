"""A flight record of every collective and point-to-point operation a rank issues, and what it waits in.

The same idea as PyTorch's NCCL flight recorder (`TORCH_NCCL_TRACE_BUFFER_SIZE`: a ring of the last
collectives, dumped on a timeout), kept for every backend at the counted communicator, which every
operation passes through (parallel/comm.py), and by the run's evidence for its own exchange:

1. issue: an entry — kind, group (its name and ranks) or peer, bytes, its number in its group
   (the n-th collective over those ranks, the n-th send to / receive from that peer), the step and
   plan action it was issued under, the time;
2. wait: while the main thread blocks on it (a synchronous call, or `wait()` on its work handle)
   it is the rank's current wait, read by a watchdog thread (layerwise/run/hangs.py);
3. completion: only when the work says so (`is_completed()`, polled), never because `wait()`
   returned. On NCCL `wait()` and a synchronous collective return once the compute stream is made
   to wait for the collective (ProcessGroupNCCL's WorkNCCL::wait → synchronizeStream); the host
   blocks later, in a sync nobody passes through `wait()` for (a `.tolist()`, an event's
   `synchronize()`, the fp16 scaler's `.item()`). Those syncs say so (`synchronizing`): while the
   host blocks in one, the oldest operation still in flight is the rank's current wait. Until it
   completes, an operation stays in flight, so `stalled()` finds it whatever the host does.
The time a wait blocked is measured on the timeline that blocks (`marks`): on CPU the host's
clock (gloo's `wait()` blocks the host); on CUDA two events on the current stream, one where the
stream reached the wait and one after it, i.e. how long the compute stream stalled for the
collective — its peers included, this rank's own queued compute not (so a slow rank is not
mistaken for a waiting one). It is counted when the work completes and both marks have passed.
The last `size` entries are kept (a ring), the per-group numbers for the whole run. The time spent
blocked in waits is summed per step (a step's compute time is its step time minus that) and, for the
whole run, per group and kind (`waits`: each rank's processes/rank-<k>.json at the end).
Cost: one small object and two clock reads per operation (benchmarks/overhead.py measures it).
"""

import contextlib
import threading
import time
from collections import deque
from typing import Optional

import torch

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


class HostMarks:
    """The timeline a CPU rank blocks on: the host's clock (gloo's `wait()` blocks the host)."""

    @staticmethod
    def mark() -> float:
        return time.perf_counter()

    @staticmethod
    def passed(mark) -> bool:
        return True

    @staticmethod
    def seconds(start, end) -> float:
        return end - start


class CudaMarks:
    """The timeline a GPU rank blocks on: events recorded on the current (compute) stream, which
    NCCL's `wait()` makes wait for the collective; `passed` asks the event without blocking."""

    @staticmethod
    def mark():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def passed(mark) -> bool:
        return mark.query()

    @staticmethod
    def seconds(start, end) -> float:
        return start.elapsed_time(end) / 1000.0  # milliseconds


def marks_for(device: torch.device):
    """The timeline waits on `device` block: CUDA events on a GPU, the host's clock elsewhere."""
    return CudaMarks() if torch.device(device).type == "cuda" else HostMarks()


class RecordedWork:
    """A work handle whose `wait()` is recorded as the rank's current wait (module docstring, 2) and
    whose completion is noted when the work says so (3); everything else is the handle's own."""

    __slots__ = ("_work", "_operation", "_recorder")

    def __init__(self, work, operation: Operation, recorder: "FlightRecorder"):
        self._work, self._operation, self._recorder = work, operation, recorder

    def wait(self, *arguments, **keywords):
        with self._recorder.waiting(self._operation, self._work):
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


class _StreamOrdered:
    """The work of a synchronous call: done once the mark after it has passed. On CUDA that mark
    is an event the compute stream reaches only after the collective (NCCL made the stream wait
    before returning); on CPU the call itself blocked, and the host's mark has passed."""

    @staticmethod
    def is_completed() -> bool:
        return True


SYNCHRONOUS = _StreamOrdered()


class _Waiting:
    """Context manager: `operation` is the rank's current wait while inside; the wait is marked on
    the blocking timeline on entry and exit, and the operation stays in flight until its `work`
    (SYNCHRONOUS for a synchronous call) completes and the exit mark has passed (module docstring, 3)."""

    __slots__ = ("recorder", "operation", "work", "arrived")

    def __init__(self, recorder, operation, work=None):
        self.recorder, self.operation, self.work = recorder, operation, work or SYNCHRONOUS

    def __enter__(self):
        self.recorder.current = (self.operation, time.monotonic())
        self.arrived = self.recorder.marks.mark()

    def __exit__(self, kind, value, traceback):
        recorder = self.recorder
        recorder.current = None
        if kind is None:
            recorder._in_flight(self.operation, self.work, self.arrived, recorder.marks.mark())
        return False


class _Synchronizing:
    """Context manager around a host sync (module docstring, 2): while the host blocks in it, the
    oldest operation in flight is the rank's current wait."""

    __slots__ = ("recorder",)

    def __init__(self, recorder):
        self.recorder = recorder

    def __enter__(self):
        recorder = self.recorder
        recorder.poll()
        oldest = recorder.oldest_in_flight()
        if oldest is not None:
            recorder.current = (oldest, time.monotonic())

    def __exit__(self, kind, value, traceback):
        self.recorder.current = None
        self.recorder.poll()
        return False


def synchronizing(recorder: Optional["FlightRecorder"]):
    """`recorder.synchronizing()`, or nothing when no watchdog watches this rank."""
    return contextlib.nullcontext() if recorder is None else recorder.synchronizing()


class FlightRecorder:
    """The ring of a rank's last operations, its current wait, and its per-group numbers.

    The main thread writes; a watchdog thread reads `current` (one tuple, replaced atomically) and
    `snapshot()`. Context the strategies set: `step`, `action` (the plan action being executed),
    `phase` (the watchdog's allowance depends on it).
    """

    def __init__(self, size: int = 64, marks=None):
        self.marks = marks or HostMarks()  # the timeline a wait blocks (marks_for(device))
        self.operations = deque(maxlen=size)
        self.sequences = {}  # (kind family, ranks or peer) -> operations issued so far
        self.step, self.action, self.phase = 0, None, "setup"
        self.current = None  # (Operation, monotonic start) while the main thread waits on it
        self.last_completed = None
        self.blocked_s = 0.0  # time blocked in waits since the last `take_blocked`
        self.waited = {}  # (group, kind) -> [waits, seconds blocked]: the whole run's, by where it waited
        self.last_activity = time.monotonic()  # the last issue or completed wait
        self.flying = []  # [operation, work, arrived mark, left mark] waited on, not yet complete
        self._index = 0
        self._lock = threading.Lock()

    def issue(self, kind: str, group: str, ranks: tuple = (), peer: Optional[int] = None,
              nbytes: int = 0) -> Operation:
        """Record an operation as issued; its number counts collectives over the same ranks (one
        process group) or, for point-to-point, the same direction toward the same peer."""
        key = (kind, peer) if peer is not None else (COLLECTIVE, ranks)
        self.poll()
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

    def waiting(self, operation: Operation, work=None) -> _Waiting:
        return _Waiting(self, operation, work)

    def synchronizing(self) -> _Synchronizing:
        """Around a host sync that may block on operations in flight (a `.tolist()`, an event's
        `synchronize()`, a `.item()`): the watchdog sees the oldest of them as the current wait."""
        return _Synchronizing(self)

    def _complete(self, operation: Operation, blocked_s: float) -> None:
        """`operation` completed after blocking this rank `blocked_s` seconds in its wait."""
        self.blocked_s += blocked_s
        waited = self.waited.setdefault((operation.group, operation.kind), [0, 0.0])
        waited[0] += 1
        waited[1] += blocked_s
        operation.completed = operation.completed or time.time()
        self.last_completed = operation
        self.last_activity = time.monotonic()

    def _in_flight(self, operation: Operation, work, arrived, left) -> None:
        """A wait on `operation` returned: complete if its work is (gloo, always), else in flight."""
        with self._lock:
            if work.is_completed() and self.marks.passed(left):
                self._complete(operation, max(0.0, self.marks.seconds(arrived, left)))
            else:
                self.flying.append((operation, work, arrived, left))

    def poll(self) -> None:
        """Complete every waited-on operation whose work completed and whose marks have passed,
        counting the time its wait blocked on the marks' timeline (main thread and watchdog)."""
        if not self.flying:
            return
        with self._lock:
            done = [entry for entry in self.flying if entry[1].is_completed() and self.marks.passed(entry[3])]
            for entry in done:
                self.flying.remove(entry)
                operation, _, arrived, left = entry
                self._complete(operation, max(0.0, self.marks.seconds(arrived, left)))

    def oldest_in_flight(self) -> Optional[Operation]:
        """The oldest operation waited on and not complete: what a host sync blocks on first (the
        compute stream waits only for works whose `wait()` was called)."""
        with self._lock:
            return self.flying[0][0] if self.flying else None

    def track(self, operation: Operation, work):
        """The work handle of an asynchronous operation, recorded; None (a synchronous call) as is."""
        return None if work is None else RecordedWork(work, operation, self)

    def waits(self) -> dict:
        """The run's waits by group and kind ("tensor all_reduce": {"waits", "seconds"}): where this rank's
        communication cost it time (a collective's whole call, a receive's wait for its message)."""
        self.poll()
        return {f"{group} {kind}": {"waits": count, "seconds": round(seconds, 6)}
                for (group, kind), (count, seconds) in sorted(self.waited.items())}

    def take_blocked(self) -> float:
        """Seconds blocked in waits since the last call (a step's communication wait): call it after a
        sync (on CUDA, the marks of a wait not yet passed are counted at a later call)."""
        self.poll()
        blocked, self.blocked_s = self.blocked_s, 0.0
        return blocked

    def stalled(self, seconds: float) -> Optional[Operation]:
        """The newest operation in flight longer than `seconds` while this rank issued and finished
        nothing for as long: a wait that does not pass through `wait()` (torch DDP's reducer waits
        on the handle's future inside the backward), seen from the outside. The newest: a rank
        blocks right after it issues what it waits for."""
        self.poll()
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
