"""The measured bubble on a GPU is timed by the device, on steps the memory meter leaves alone
(issue 54, item 7).

On CUDA a kernel launch returns at once: the device runs the work later, and a device the host
cannot keep fed waits for the launches. The compute-memory meter (a Python dispatch mode on every
operator, docs/evidence.md "Sampled steps") slows the host's launches, so on the steps it watches
a GPU waits for the host between actions and the measured bubble counts that launch lag. Here a
GPU is emulated in its own time (`EmulatedGpu`): its events complete when the work launched before
them has run, never at the host's time of the launch.
"""

import statistics

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

import strategies.modular_pipeline as modular_pipeline
from layerwise.preflight import validate
from layerwise.run.evidence import is_measured_step, is_timed_step
from layerwise.run.fit import train
from parallel.memory import ComputeMemoryMeter
from parallel.timing import EventClock
from strategies.modular_pipeline import reported_bubble
from strategies.schedule import Timeline
from tests.ranks import QUICK, compose_config

KERNEL_S = 1e-4  # device time of one operator's kernel
HOST_S = 1e-5  # the host's time to launch one: the device falls behind the host...
METERED_HOST_S = 3e-4  # ...except under the meter's dispatch mode, whose Python per operator starves it
BOUNDARY_HOST_S = 1e-3  # the host's Python at an action's boundary (executor, handler), an event recorded


def meter_watches() -> bool:
    return any(isinstance(mode, ComputeMemoryMeter) for mode in _get_current_dispatch_mode_stack())


class EmulatedGpu(TorchDispatchMode):
    """One CUDA stream timed in its own seconds. Every operator the host dispatches while it is
    entered is a kernel launched on the stream: launching costs the host HOST_S (METERED_HOST_S
    while the memory meter watches); the kernel runs KERNEL_S from when the stream is free and the
    launch has returned. An event recorded on the stream (BOUNDARY_HOST_S of host time) completes
    when everything launched before it has run: at max(stream free, host's time of the record).
    A synchronisation makes the host wait for the stream."""

    def __init__(self):
        super().__init__()
        self.host = self.free = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.host += METERED_HOST_S if meter_watches() else HOST_S  # the launch has returned
        self.free = max(self.free, self.host) + KERNEL_S
        return func(*args, **(kwargs or {}))

    def event_class(self):
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self, stream=None):
                gpu.host += BOUNDARY_HOST_S
                self.at = max(gpu.free, gpu.host)

            def synchronize(self):
                gpu.host = max(gpu.host, self.at)

            def elapsed_time(self, later) -> float:
                return (later.at - self.at) * 1000.0  # milliseconds, as CUDA's
        return Event


@pytest.fixture
def emulated_gpu(monkeypatch):
    """The pipeline's clock as on cuda:0, with the emulated GPU's events; it watches the operators
    of each step it times, and records (meter watching?, bubble of this rank's records) per step."""
    gpu, timed = EmulatedGpu(), []
    monkeypatch.setattr(torch.cuda, "Event", gpu.event_class())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: setattr(gpu, "host", max(gpu.host, gpu.free)))

    class EmulatedEventClock(EventClock):
        def __init__(self, device):
            assert device.type == "cpu"  # the run's own device; the emulation stands in for cuda:0
            self.metered = meter_watches()
            gpu.__enter__()
            super().__init__(torch.device("cuda", 0))

        def resolve(self, records):
            gpu.__exit__(None, None, None)
            records = super().resolve(records)
            timed.append((self.metered, Timeline.from_records([records]).bubble_fraction))
            return records
    monkeypatch.setattr(modular_pipeline, "EventClock", EmulatedEventClock)
    return timed


def test_the_measured_bubble_comes_from_device_events_on_steps_the_meter_leaves_alone(tmp_path, emulated_gpu):
    """One pipeline rank, two stages, 6 steps, sampled every 4th: the meter watches steps 1, 2, 4
    and 6. The device's events of a watched step show the gaps where it waited for the slowed
    host; the reported bubble must be the median over steps the meter left alone, timed by the
    same events (on this emulated GPU, which the host keeps fed there, no gap at all)."""
    cfg = compose_config(*QUICK, "strategy=modular_pipeline", "strategy.pipeline_degree=1",
                         "hardware.devices_per_node=1", "model.layers=2", "strategy.micro_batches=2",
                         "trainer.max_steps=6", "trainer.measure_every_n_steps=4",
                         "trainer.limit_val_batches=0", "trainer.val_check_interval=100")
    summary = train(cfg, tmp_path, validate(cfg))
    unmetered = [bubble for metered, bubble in emulated_gpu if not metered]
    metered = [bubble for metered, bubble in emulated_gpu if metered]
    assert unmetered, f"no step the meter left alone was timed by the device's events: {emulated_gpu}"
    assert len(metered) == 4 and min(metered) > 0  # the emulation shows the launch lag under the meter
    assert max(unmetered) < min(metered)
    reported = summary["bubble_fraction"]["measured"]
    assert reported == pytest.approx(statistics.median(unmetered), abs=1e-12)


def test_the_step_after_each_sampled_step_is_timed_with_the_meter_off():
    # sampled (metered): warm-up 1, 2, every 4th, the last (10); timed: those and the step after each
    assert [s for s in range(1, 11) if is_measured_step(s, s - 1, 4, 10)] == [1, 2, 4, 8, 10]
    assert [s for s in range(1, 11) if is_timed_step(s, s - 1, 4, 10)] == [1, 2, 3, 4, 5, 8, 9, 10]
    # after a resume at step 5: the process's first two (6, 7) are sampled; 5 is not this process's
    assert [s for s in range(6, 11) if is_timed_step(s, s - 6, 100, 10)] == [6, 7, 8, 10]
    # every step sampled: no step the meter leaves alone
    assert all(is_measured_step(s, s - 1, 1, 5) for s in range(1, 6))


def test_the_reported_bubble_is_the_median_of_the_unmetered_steps_after_the_first():
    assert reported_bubble([]) is None
    assert reported_bubble([(0.3, True)]) == 0.3
    # the first step is left out; the meter's steps are, when any step it left alone was timed
    assert reported_bubble([(0.1, False), (0.3, True), (0.2, False), (0.4, True), (0.25, False)]) == 0.225
    # every step metered (trainer.measure_every_n_steps=1): the median of those after the first
    assert reported_bubble([(0.9, True), (0.3, True), (0.5, True)]) == 0.4
