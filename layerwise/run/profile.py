"""`trainer.profile_steps=[…]`: a profile of chosen steps, per rank, in `<run>/profile/`.

For each listed (1-based) optimizer step, every rank writes:

1. `rank<k>_step<n>.json`: torch.profiler's Chrome/Perfetto trace of the whole step (forward,
   backward, the strategy's sends and collectives, the optimizer), with shapes and memory events
   (open it in https://ui.perfetto.dev or chrome://tracing);
2. the step's memory: on CUDA, `rank<k>_step<n>_memory.pickle`, the caching allocator's snapshot
   with its allocation history (torch.cuda.memory._dump_snapshot; open it in
   https://pytorch.org/memory_viz), as torchtitan's `profiler.enable_memory_snapshot` writes it; on
   other devices `rank<k>_step<n>_memory.json`, the compute-memory meter's record of the step
   (parallel/memory.py: peak bytes of live storages, matrix products by dtype). The CUDA history
   functions raise AttributeError on a CPU build (TORCH.md "Profiler"), so they are called only on
   CUDA;
3. on CUDA the allocator records its history from the start of training, so that an out-of-memory
   error anywhere writes `rank<k>_oom_memory.pickle` before the run fails (`on_exception`). (This
   path cannot run on this CPU machine; it is the same two calls torchtitan makes.)

Rank 0 lists every rank's files in summary.json's `profile` and, under W&B, saves them to the run.
Under trainer.compile=true the meter cannot watch compiled code (its dispatch mode is refused by
dynamo), so a compiled run's CPU memory record holds the profiler's memory events' totals only.
"""

import json
from pathlib import Path

import lightning.pytorch as pl
import torch

from parallel.memory import ComputeMemoryMeter

HISTORY_ENTRIES = 100_000  # allocator events kept (torchtitan's default max_entries)


def on_cuda(trainer) -> bool:
    return trainer.strategy.root_device.type == "cuda"


def trace_name(rank: int, step: int) -> str:
    return f"rank{rank}_step{step}.json"


def memory_name(rank: int, step: int, cuda: bool) -> str:
    return f"rank{rank}_step{step}_memory.{'pickle' if cuda else 'json'}"


class StepProfiler(pl.Callback):
    """Profiles the listed steps on every rank; see the module's docstring."""

    def __init__(self, run_directory: Path, steps, evidence, compiled: bool = False):
        self.directory = Path(run_directory) / "profile"
        self.steps = sorted({int(step) for step in steps})
        self.evidence = evidence
        self.compiled = compiled
        self.profiler = None
        self.meter = None
        self.written = []  # this rank's files, relative to the run directory

    def on_train_start(self, trainer, module):
        self.directory.mkdir(parents=True, exist_ok=True)
        if on_cuda(trainer):  # from the start: an OOM at any step has the history that led to it
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)

    def on_train_batch_start(self, trainer, module, batch, batch_index):
        if trainer.global_step + 1 not in self.steps:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if on_cuda(trainer):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
        self.profiler.__enter__()
        if not on_cuda(trainer) and not self.compiled:
            self.meter = ComputeMemoryMeter()
            self.meter.resident(trainer.strategy.compute_resident_tensors())
            self.meter.__enter__()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
        if self.profiler is None:
            return
        step, rank = trainer.global_step, trainer.global_rank
        if on_cuda(trainer):
            torch.cuda.synchronize()
        if self.meter is not None:
            self.meter.__exit__(None, None, None)
        self.profiler.__exit__(None, None, None)
        trace = self.directory / trace_name(rank, step)
        self.profiler.export_chrome_trace(str(trace))
        memory = self.directory / memory_name(rank, step, on_cuda(trainer))
        if on_cuda(trainer):
            torch.cuda.memory._dump_snapshot(str(memory))
        else:
            memory.write_text(json.dumps(self.meter_record(), indent=1))
        self.written += [trace.name, memory.name]
        self.profiler = self.meter = None

    def meter_record(self) -> dict:
        """The CPU step's memory: the meter's peak and product dtypes, and the profiler's own totals."""
        allocated = sum(event.self_cpu_memory_usage for event in self.profiler.key_averages()
                        if event.self_cpu_memory_usage > 0)
        record = {"profiler_cpu_bytes_allocated": allocated}
        if self.meter is None:
            record["meter"] = "off: a compiled step runs outside the meter's dispatch mode (dynamo refuses it)"
        else:
            record.update(peak_compute_bytes=self.meter.peak_bytes,
                          matrix_product_dtypes={str(k).removeprefix("torch."): v
                                                 for k, v in self.meter.matrix_product_dtypes.items()})
        return record

    def on_train_end(self, trainer, module):
        """Rank 0 links every rank's files (the names are the same on every rank) and saves them to W&B."""
        cuda = on_cuda(trainer)
        if cuda:
            torch.cuda.memory._record_memory_history(enabled=None)
        done = [step for step in self.steps if step <= trainer.global_step]
        ranks = range(trainer.world_size)
        self.evidence.history["profile"] = {
            "traces": [f"profile/{trace_name(rank, step)}" for step in done for rank in ranks],
            "memory": [f"profile/{memory_name(rank, step, cuda)}" for step in done for rank in ranks]}
        if trainer.is_global_zero:
            self.log_to_wandb(trainer)

    def log_to_wandb(self, trainer) -> None:
        """Under logger=wandb, every file of profile/ is saved with the run (rank 0 sees them on one
        node; on several nodes, each node's own)."""
        for logger in trainer.loggers:
            if type(logger).__name__ == "WandbLogger":
                for path in sorted(self.directory.glob("*")):
                    logger.experiment.save(str(path), base_path=str(self.directory.parent), policy="now")

    def on_exception(self, trainer, module, exception):
        """A CUDA out-of-memory: write the allocator's snapshot (its history since training began)
        before the run fails, as torchtitan's MemoryProfiler does."""
        if isinstance(exception, torch.OutOfMemoryError) and on_cuda(trainer):
            torch.cuda.memory._dump_snapshot(str(self.directory / f"rank{trainer.global_rank}_oom_memory.pickle"))
