"""Clocks that time the device's work, not the host's launches of it (CUDA events on GPUs: README, "What has run on GPUs").

On CUDA a kernel launch returns at once: reading `time.perf_counter` around a step measures the
Python that queued it. A step is timed with CUDA events recorded on the stream; an action of a
schedule with a clock that first waits for the device (the executor calls it twice per action, so
it must be cheap on CPU: there it is perf_counter itself). Memory on CUDA comes from the caching
allocator's own counters.
"""

import time
from typing import Callable

import torch


def synchronised_clock(device: torch.device) -> Callable[[], float]:
    """perf_counter, after the device has finished what was queued on it (CUDA); perf_counter on CPU."""
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return clock


class StepTimer:
    """Seconds of one step: CUDA events on a GPU, perf_counter elsewhere."""

    def __init__(self, device: torch.device):
        self.device = device
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
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1000.0  # elapsed_time is in milliseconds


def allocator_peak_bytes(device: torch.device) -> float | None:
    """The caching allocator's peak since the last reset (CUDA only; None elsewhere)."""
    return float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def reset_allocator_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
