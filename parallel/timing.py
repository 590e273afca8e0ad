"""Clocks that time the device's work, not the host's launches of it (CUDA events on GPUs: README, "What has run on GPUs").

On CUDA a kernel launch returns at once: reading `time.perf_counter` around a step measures the
Python that queued it. A step is timed with CUDA events recorded on the stream, and so is each
action of a pipeline's timed steps (`EventClock`: the executor calls it twice per action, so it must
be cheap on CPU: there it is perf_counter itself). Memory on CUDA comes from the caching
allocator's own counters.
"""

import time
from typing import Callable

import torch

from parallel.flight import synchronizing


def synchronised_clock(device: torch.device) -> Callable[[], float]:
    """perf_counter, after the device has finished what was queued on it (CUDA); perf_counter on CPU."""
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return clock


class EventClock:
    """The executor's clock on CUDA: each call records an event on the current stream (the host
    does not wait) and returns the event's number; `resolve(records)` waits once, when the records
    are read, and turns numbers into seconds on the host's clock (perf_counter at a synchronised
    origin + the events' elapsed time), so ranks on one node share the time axis as perf_counter
    does. On CPU it is perf_counter and `resolve` returns the records unchanged.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.events = []
        if self.cuda:  # timed steps only (metered or not): one synchronisation gives the events a host origin
            torch.cuda.synchronize(device)
            self.origin = time.perf_counter()
            self.events.append(self._record())

    @staticmethod
    def _record():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def __call__(self) -> float:
        if not self.cuda:
            return time.perf_counter()
        self.events.append(self._record())
        return float(len(self.events) - 1)

    def resolve(self, records: list) -> list:
        """Records whose start/end are this clock's readings, in seconds."""
        if not self.cuda:
            return records
        self.events[-1].synchronize()
        seconds = [self.origin + self.events[0].elapsed_time(event) / 1000.0 for event in self.events]
        return [record._replace(start=seconds[int(record.start)], end=seconds[int(record.end)])
                for record in records]


class StepTimer:
    """Seconds of one step: CUDA events on a GPU, perf_counter elsewhere. Reading it on a GPU waits
    for the device, and so for any collective still in flight: with a flight `recorder` that wait
    is the rank's current wait for the watchdog (parallel/flight.py `synchronizing`)."""

    def __init__(self, device: torch.device, recorder=None):
        self.device, self.recorder = device, recorder
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        if self.cuda:
            self._start, self._end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            self._start.record()
        else:
            self._started = time.perf_counter()

    def stop(self) -> float:
        if not self.cuda:
            return time.perf_counter() - self._started
        self._end.record()
        with synchronizing(self.recorder):
            self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1000.0  # elapsed_time is in milliseconds


def allocator_peak_bytes(device: torch.device) -> float | None:
    """The caching allocator's peak since the last reset (CUDA only; None elsewhere)."""
    return float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def reset_allocator_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
