"""NCCL's host-side timing, emulated over gloo: a `wait()` that returns at once, a work that
completes later, and a compute stream that the host blocks on only when it syncs.

What is emulated (ProcessGroupNCCL, torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp):
1. A collective is enqueued and the call returns; the work completes when every member has
   arrived (here: the gloo work underneath completes; its future's callback stamps the time).
2. `work.wait()` does not block the host: it makes the current stream wait for the work
   (WorkNCCL::synchronizeStream) and returns. A synchronous collective is that same wait
   (distributed_c10d.py: `work.wait()` unless async_op), so it returns at once too.
3. `is_completed()` turns true only once the collective ran (WorkNCCL::isCompleted queries its
   end event).
4. The compute stream (`FakeStream`): an event recorded on it (`marks`, the interface of
   parallel/flight.py's CudaMarks) passes once every work the stream was made to wait for before it
   completed; its time is the later of its recording and those completions. `synchronize()` is the
   host's blocking sync (`.tolist()`, `torch.cuda.synchronize`): it returns when they all have.

Keyed and timed like NCCL, not like our code: nothing here knows about the flight record.
`install()` registers the backend `fake_nccl` (once per process) and returns this rank's stream.
"""

import threading
import time
from datetime import timedelta

import torch.distributed as dist

BACKEND = "fake_nccl"


class FakeEvent:
    """An event on the fake compute stream: recorded at `recorded` (host clock), after `works`."""

    __slots__ = ("recorded", "works")

    def __init__(self, recorded: float, works: list):
        self.recorded, self.works = recorded, works


class FakeStream:
    """The rank's compute stream: the works it waits for, its events, the host's sync on it."""

    def __init__(self):
        self.waits_for = []  # works `wait()` made this stream wait for, in order
        self._lock = threading.Lock()

    def wait_for(self, work: "FakeNcclWork") -> None:
        with self._lock:
            self.waits_for.append(work)

    def pending(self) -> list:
        with self._lock:
            self.waits_for = [work for work in self.waits_for if work.completed_at is None]
            return list(self.waits_for)

    # ----- events: parallel/flight.py's marks interface (mark, passed, seconds)
    def mark(self) -> FakeEvent:
        return FakeEvent(time.perf_counter(), self.pending())

    @staticmethod
    def passed(event: FakeEvent) -> bool:
        return all(work.completed_at is not None for work in event.works)

    @staticmethod
    def seconds(start: FakeEvent, end: FakeEvent) -> float:
        def at(event):
            return max([event.recorded] + [work.completed_at for work in event.works])
        return at(end) - at(start)

    def synchronize(self) -> None:
        """The host blocks until the stream has run everything queued on it."""
        for work in self.pending():
            work.done.wait()


class FakeNcclWork(dist._Work):
    """A work whose `wait()` returns at once (the stream waits) and which completes with gloo's."""

    def __init__(self, inner, stream: FakeStream):
        super().__init__()
        self.inner, self.stream = inner, stream
        self.completed_at, self.done = None, threading.Event()
        inner.get_future().add_done_callback(self._complete)

    def _complete(self, _future) -> None:
        self.completed_at = time.perf_counter()
        self.done.set()

    def wait(self, timeout=None) -> bool:
        self.stream.wait_for(self)
        return True

    def is_completed(self) -> bool:
        return self.completed_at is not None

    def get_future(self):
        return self.inner.get_future()


class FakeNccl(dist.ProcessGroup):
    """A process group whose collectives run on gloo and return FakeNcclWork handles."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta, stream: FakeStream):
        super().__init__(rank, size)
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("fake_nccl", store), rank, size, timeout)
        self.stream = stream

    def _wrap(self, work):
        return FakeNcclWork(work, self.stream)

    def allreduce(self, tensors, options):
        return self._wrap(self.gloo.allreduce(tensors, options))

    def broadcast(self, tensors, options):
        return self._wrap(self.gloo.broadcast(tensors, options))

    def allgather(self, outputs, inputs, options):
        return self._wrap(self.gloo.allgather(outputs, inputs, options))

    def barrier(self, options):
        return self._wrap(self.gloo.barrier(options))

    def send(self, tensors, destination, tag):
        return self._wrap(self.gloo.send(tensors, destination, tag))

    def recv(self, tensors, source, tag):
        return self._wrap(self.gloo.recv(tensors, source, tag))

    def getBackendName(self) -> str:
        return BACKEND


_STREAM = None


def install() -> FakeStream:
    """Register `fake_nccl` in this process (a forked rank) and return its compute stream."""
    global _STREAM
    if _STREAM is None:
        _STREAM = FakeStream()

        def create(options, backend_options=None):
            return FakeNccl(options.store, options.group_rank, options.group_size, options.timeout, _STREAM)
        dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu"])
    return _STREAM
