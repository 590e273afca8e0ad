"""Every run leaves evidence: metrics.csv per step, summary.json at the end, progress as it goes.

The numbers are reduced over ranks before rank 0 writes them (docs/evidence.md): the train loss is the
world mean of what each rank's strategy returns (every strategy returns a loss whose world mean is
the global-batch loss), communication bytes and peak memory are the maximum over ranks. The
callback's history is part of the checkpoint, so a resumed run's summary covers the whole run.
"""

import csv
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import lightning
import lightning.pytorch as pl
import torch
import torch.distributed as dist

from cost.step_time import model_flops_utilization
from layerwise.run import experts as expert_evidence
from layerwise.run.console import Eta
from parallel.comm import KINDS
from parallel.flight import synchronizing
from parallel.memory import ComputeMemoryMeter
from parallel.timing import StepTimer, allocator_peak_bytes, reset_allocator_peak

COLUMNS = (["step", "loss", "lr", "step_time_s", "tokens_per_s", "tokens_per_s_per_device", "mfu"]
           + [f"comm_bytes_{kind}" for kind in KINDS]
           + ["comm_calls", "memory_measured", "peak_compute_bytes", "allocator_peak_bytes", "val_loss"]
           + ["stragglers"])  # ranks flagged slow at that step, "2 3" (layerwise/run/hangs.py)
# The counter's kinds that are collectives (one call of every rank of a group); sends and host<->device
# copies are not: `comm_calls` counts what bucketing gradient reductions would make fewer.
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
# The compute-memory meter (a Python dispatch mode on every operator) slows a step by ~25% on a small
# model: it runs on these first steps of every start or resume, every trainer.measure_every_n_steps,
# and on the last step (so the executed Gantt chart is the last step's).
WARM_UP_MEASURED_STEPS = 2


def is_measured_step(step: int, steps_run_here: int, every: int, last: int) -> bool:
    """Whether 1-based `step` is sampled, `steps_run_here` steps after this process started
    training (start or resume); `every` ≤ 0 samples only the warm-up and the last step."""
    return (steps_run_here < WARM_UP_MEASURED_STEPS or step == last
            or (every > 0 and step % every == 0))


def is_timed_step(step: int, steps_run_here: int, every: int, last: int) -> bool:
    """Whether a pipeline times `step` (its gathered timeline, the measured bubble): a sampled step,
    or the step after one. The meter watches the sampled steps and slows the host's launches, so on
    a GPU the device waits for them between actions and their timeline counts that launch lag; the
    step after a sampled one is timed by the same device events with the meter off, and the
    measured bubble is taken from those (docs/evidence.md, "Sampled steps")."""
    return (is_measured_step(step, steps_run_here, every, last)
            or (steps_run_here > 0 and is_measured_step(step - 1, steps_run_here - 1, every, last)))


class StepExchange:
    """A step's numbers over all ranks in ONE collective, issued asynchronously: `wait()` gives
    (the sum of the first value, the element-wise maxima of the rest). Each rank's small float64
    vector is all-gathered on its compute device (NCCL reduces only device tensors) and reduced
    locally. A tensor first value (the loss) is copied on the device, the host's values by one
    non-blocking copy from pinned memory (a pageable copy would wait for the GPU): no host sync
    until `wait()`.
    Not counted: evidence, not training traffic; recorded in the flight record (`recorder`), since a
    rank may wait in it (docs/faults.md, "When it hangs"). `by_rank` keeps every rank's vector."""

    def __init__(self, summed, maxima: list, device: torch.device, recorder=None):
        self.result, self.by_rank, self.recorder = None, None, recorder
        staged = torch.tensor([0.0, *[float(value) for value in maxima]], dtype=torch.float64)  # host
        mine = torch.empty_like(staged, device=device)
        mine.copy_(staged.pin_memory() if device.type == "cuda" else staged, non_blocking=True)
        mine[0] = summed.detach().reshape(()) if isinstance(summed, torch.Tensor) else float(summed)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            self.pieces, self.work = [mine], None
            return
        self.pieces = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        # the list form: independent counters of training traffic skip it
        self.work = dist.all_gather(self.pieces, mine, async_op=True)
        if recorder is not None:
            ranks = tuple(range(dist.get_world_size()))
            self.work = recorder.track(recorder.issue("all_gather", "evidence", ranks, nbytes=mine.numel() * 8),
                                       self.work)

    def wait(self) -> tuple:
        if self.result is None:
            if self.work is not None:
                self.work.wait()
            stacked = torch.stack(self.pieces)
            width = stacked.shape[1]
            # one sync for the totals and every rank's row (the straggler check reads the rows)
            with synchronizing(self.recorder):  # on NCCL the host blocks here, not in wait()
                flat = torch.cat([stacked[:, :1].sum(dim=0), stacked[:, 1:].amax(dim=0), stacked.flatten()]).tolist()
            self.result = flat[0], flat[1:width]
            self.by_rank = [flat[width * (1 + rank):width * (2 + rank)] for rank in range(stacked.shape[0])]
        return self.result


def model_flops_per_step(cfg, vocab_size: int) -> float:
    """6·N + 12·L·h·s per token (models.transformer.model_flops_per_token) × tokens per step."""
    from models import block_of, blocks_of, model_flops_per_token
    # a mixture of experts: each block's active weights (dense blocks outside model.moe_layers)
    per_token = model_flops_per_token(cfg.model.layers, cfg.model.hidden, cfg.data.sequence_length,
                                      vocab_size, cfg.model.mlp_ratio, block_of(cfg.model), blocks_of(cfg.model))
    return per_token * cfg.data.global_batch_size * cfg.data.sequence_length


def reduce_over_ranks(values: list, op, device: torch.device) -> list:
    """All-reduce a short list of floats on the rank's compute device (NCCL reduces only device
    tensors). Not counted: evidence, not training traffic."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def precision_name(matrix_product_dtypes: dict, master_dtype: torch.dtype) -> str:
    """Lightning's name of what a run computed in: the dtype most matrix products ran in, and
    whether the optimizer's weights (the masters) are kept wider than that ("-mixed")."""
    if not matrix_product_dtypes:
        return "unmeasured"
    computed = max(matrix_product_dtypes, key=matrix_product_dtypes.get)
    short = {"float32": "32", "bfloat16": "bf16", "float16": "16"}.get(computed, computed)
    if computed == "float32":
        return "32-true"
    return f"{short}-{'mixed' if master_dtype == torch.float32 else 'true'}"


def git_sha() -> str:
    try:
        root = Path(__file__).resolve().parents[2]
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions() -> dict:
    import hydra
    return {"python": platform.python_version(), "torch": torch.__version__,
            "lightning": lightning.__version__, "hydra": hydra.__version__}


def write_json_atomically(path: Path, payload: dict) -> None:
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(json.dumps(payload, indent=2))
    os.replace(temporary, path)


class RunEvidence(pl.Callback):
    """Measures each step, writes metrics.csv and summary.json, prints progress on rank 0.

    1. step start: reset the communication counter; on a sampled step (`is_measured_step`) start
       the compute-memory meter and tell the strategy to collect its own evidence (timelines);
    2. as soon as the strategy's training_step returns the loss (before Lightning's backward), ONE
       asynchronous collective carries it (summed) with the step flags and the previous step's
       time, bytes, calls and peaks (maxima); the non-finite guard and the preemption check read it;
    3. step end: the previous step's row is complete (rank 0 writes it); this step's own numbers
       wait for the next exchange, or for a synchronous one before a checkpoint and at the end;
    4. validation: mean loss over batches and ranks, attached to the step's row;
    5. end (or failure): summary.json with the fixed schema of docs/evidence.md.
    """

    def __init__(self, run_directory: Path, cfg, world_size: int, layout: dict,
                 progress_lines: bool = True, measure_memory: bool = True, flags: dict = None):
        self.run_directory = Path(run_directory)
        self.cfg = cfg
        self.world_size = world_size
        self.layout = layout
        self.progress_lines = progress_lines
        self.measure_memory = measure_memory
        self.history = {"losses": [], "val_losses": {}, "initial_val_loss": None, "rows": [],
                        "matrix_product_dtypes": {}}
        self.tokens_per_step = cfg.data.global_batch_size * cfg.data.sequence_length
        # read once: an OmegaConf lookup costs ~25 µs, and the step hooks would make several a step
        self.max_steps = cfg.trainer.max_steps
        self.measure_every_n_steps = cfg.trainer.measure_every_n_steps
        self.log_every_n_steps = max(1, cfg.trainer.log_every_n_steps)
        # name -> callable: a rank's yes/no that travels in the step's exchange (maximum over ranks)
        self.flags = dict(flags or {})
        # name -> callable: a rank's number that travels in the step's exchange, kept per rank
        # (`per_rank_values`; the straggler check reads each rank's compute time there)
        self.per_rank = {}
        self.row_columns = {}  # column -> callable: this rank's value for the step's row (rank 0 writes it)
        # a mixture of experts: its columns (layerwise/run/experts.py), only then
        self.expert_loads = (expert_evidence.ExpertLoads(cfg, world_size, layout, run_directory)
                             if expert_evidence.has_experts(cfg) else None)
        self.columns = COLUMNS + (expert_evidence.COLUMNS if self.expert_loads is not None else [])
        self.recorder = None  # a FlightRecorder while the run's watchdog watches (layerwise/run/hangs.py)
        self._exchange = None  # this step's StepExchange
        self._device, self._is_global_zero = None, False  # set at fit start
        self._flops_per_step, self._peak_flops = 0.0, 0.0  # set at fit start (MFU: none before)
        self.local_loss = None  # this rank's loss of the current step
        self._partial = None  # (the last ended step's row without its reduced numbers, its local numbers)
        self._awaiting = None  # the same, once the current step's exchange carries its numbers
        self._pending_rows = []  # complete rows, written at the next step's start (after validation)
        self._meter = None
        self._steps_run_here = 0  # since this process started training: a resume measures again
        self._validation_losses = []
        self._started = None
        self._eta = Eta()  # the progress line's time left, from this process's steps only (console.py)

    # ----- checkpointed history
    def state_dict(self):
        # Lightning asks every rank while saving a checkpoint (a collective point): complete the
        # last step's row first, so a resumed run's metrics.csv and summary lack no step.
        self._complete_partial(exchange=True)
        return dict(self.history)

    def load_state_dict(self, state):
        self.history = {**self.history, **state}

    # ----- steps
    def on_train_start(self, trainer, module):
        self._started = time.perf_counter()
        self._steps_run_here = 0
        self._partial = self._awaiting = None
        self._record_setup_memory(trainer)
        if trainer.is_global_zero:
            self._rewrite_csv_up_to(trainer.global_step)
        if self.history["initial_val_loss"] is None and self.cfg.trainer.limit_val_batches > 0:
            self.history["initial_val_loss"] = evaluate(trainer, module)
            self._say(f"initial validation loss {self.history['initial_val_loss']:.4f}")
        self._eta.start()

    def _record_setup_memory(self, trainer):
        """What building and placing this process's part of the model took, the maximum over ranks
        (measured by the strategy in configure_model; a resumed run records its own setup)."""
        strategy = trainer.strategy
        allocator = strategy.setup_allocator_peak_bytes  # None off CUDA
        maxima = reduce_over_ranks([float(strategy.setup_peak_bytes or 0), float(allocator or 0)],
                                   dist.ReduceOp.MAX, strategy.root_device)
        self.history["setup_peak_bytes"] = maxima[0]
        self.history["setup_allocator_peak_bytes"] = None if allocator is None else maxima[1]

    def on_fit_start(self, trainer, module):
        # Lightning hands no hook the loss before its backward; every strategy's training_step
        # returns it through RunHooks.loss_ready, so the step's exchange is issued there (overlapped
        # with the backward, whose gradient reductions keep the ranks together anyway).
        self._device, self._is_global_zero = trainer.strategy.root_device, trainer.is_global_zero
        from layerwise.planning.inputs import device_of  # the peak of the precision in use, read in one place
        self._flops_per_step = model_flops_per_step(self.cfg, module.vocab_size)
        self._peak_flops = device_of(self.cfg, self.world_size).flops_per_second
        trainer.strategy.listen_to_step_loss(lambda output: self._issue_exchange(trainer, output))

    def teardown(self, trainer, module, stage):
        trainer.strategy.listen_to_step_loss(None)

    def on_train_batch_start(self, trainer, module, batch, batch_index):
        self._flush_rows(trainer)
        self._exchange = None
        communicator = trainer.strategy.communicator()
        if communicator is not None:
            communicator.reset()
        step = (trainer.global_step + 1, self._steps_run_here, self.measure_every_n_steps, self.max_steps)
        measuring = is_measured_step(*step)
        trainer.strategy.measure_this_step(is_timed_step(*step), metered=self.measure_memory and measuring)
        if self.measure_memory and measuring:
            self._meter = ComputeMemoryMeter()
            self._meter.resident(trainer.strategy.compute_resident_tensors())
            self._meter.__enter__()
        reset_allocator_peak(trainer.strategy.root_device)
        self._timer = StepTimer(trainer.strategy.root_device, self.recorder)  # CUDA events on a GPU
        self._timer.start()

    def _issue_exchange(self, trainer, output) -> None:
        """This step's one collective: [loss, *flags, *the previous step's local numbers]."""
        loss = output["loss"] if isinstance(output, dict) else output
        self.local_loss = None if loss is None else loss.detach()
        # the previous step's row now waits for this exchange (its local numbers travel in it)
        self._awaiting, self._partial = self._partial, None
        previous = self._awaiting[1] if self._awaiting is not None else [0.0] * (4 + len(KINDS))
        flags = [float(bool(flag())) for flag in self.flags.values()]
        extra = [float(number()) for number in self.per_rank.values()]  # after everything whose maxima are read
        self._exchange = StepExchange(0.0 if loss is None else self.local_loss, flags + previous + extra,
                                      trainer.strategy.root_device, self.recorder)

    def world_loss_sum(self, trainer) -> float:
        """The sum over ranks of this step's loss (waits for the exchange; completes the last row)."""
        loss_sum, maxima = self._exchange.wait()
        if self._awaiting is not None:
            (row, _), self._awaiting = self._awaiting, None
            self._complete(row, maxima[len(self.flags):])
        return loss_sum

    def per_rank_values(self, name: str) -> list:
        """Every rank's `per_rank[name]` number as this step's exchange carried it (waits for it);
        None before the step's exchange is issued."""
        if self._exchange is None:
            return None
        self.world_loss_sum(None)
        by_rank = self._exchange.by_rank  # host lists: read with the totals' one sync
        column = len(by_rank[0]) - len(self.per_rank) + list(self.per_rank).index(name)
        return [row[column] for row in by_rank]

    def exchanged(self) -> bool:
        """Whether a step's exchange has been issued since the last step started."""
        return self._exchange is not None

    def any_rank(self, trainer, flag: str) -> bool:
        """Whether `flag` was raised on any rank when this step's loss was exchanged."""
        self.world_loss_sum(trainer)
        return bool(self._exchange.wait()[1][list(self.flags).index(flag)])

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
        step_time = self._timer.stop()
        allocator = allocator_peak_bytes(trainer.strategy.root_device)  # every step (free); None off CUDA
        if self._exchange is None:  # the strategy did not return its loss through loss_ready
            self._issue_exchange(trainer, outputs)
        loss = self.world_loss_sum(trainer) / self.world_size
        peak = self._stop_meter()
        communicator = trainer.strategy.communicator()
        comm = communicator.snapshot() if communicator else {kind: 0.0 for kind in KINDS}
        calls = sum(communicator.calls_by_kind.get(k, 0) for k in COLLECTIVE_KINDS) if communicator else 0
        row = {"step": trainer.global_step, "loss": loss, "lr": trainer.optimizers[0].param_groups[0]["lr"],
               "memory_measured": int(peak is not None), "val_loss": None,
               "allocator_measured": allocator is not None,
               **{column: value() for column, value in self.row_columns.items()}}
        if self.expert_loads is not None:  # every rank: one all-reduce of the step's expert loads
            values, loads = self.expert_loads.gather(module.model, trainer.strategy.root_device)
            row.update(values)
            if trainer.is_global_zero:
                self.expert_loads.append(trainer.global_step, loads)
        self._partial = row, [step_time, peak or 0.0, allocator or 0.0, calls] + [comm[k] for k in KINDS]
        self._steps_run_here += 1
        self._eta.step()
        self.history["losses"].append(loss)
        if trainer.progress_bar_callback is not None:  # only the bar reads it; a module.log costs ~0.8 ms
            module.log("loss", loss, prog_bar=True, logger=False, rank_zero_only=True)

    def _complete_partial(self, exchange: bool = False) -> None:
        """Complete the rows no exchange has completed: by a synchronous exchange of their own
        (`exchange`: every rank must call), or else with this rank's numbers."""
        for waiting in (self._awaiting, self._partial):
            if waiting is not None:
                row, local = waiting
                self._complete(row, StepExchange(0.0, local, self._device).wait()[1] if exchange else local)
        self._awaiting = self._partial = None

    def _complete(self, row: dict, maxima: list) -> None:
        """Give an ended step's row its numbers over ranks; it is written at the next step's start."""
        allocator_measured = row.pop("allocator_measured")
        row.update({"step_time_s": maxima[0], "tokens_per_s": self.tokens_per_step / maxima[0],
                    "tokens_per_s_per_device": self.tokens_per_step / maxima[0] / self.world_size,
                    "mfu": self._mfu(maxima[0]),
                    "comm_calls": int(maxima[3]),
                    "peak_compute_bytes": maxima[1] if row["memory_measured"] else None,
                    "allocator_peak_bytes": maxima[2] if allocator_measured else None,
                    **{f"comm_bytes_{k}": v for k, v in zip(KINDS, maxima[4:])}})
        self.history["rows"].append({k: v for k, v in row.items() if k != "val_loss"})
        self._pending_rows.append(row)
        self._progress(row)

    def _mfu(self, step_time_s):
        return model_flops_utilization(self._flops_per_step, step_time_s, self._peak_flops, self.world_size)

    def _stop_meter(self):
        """This step's compute-side peak (None on an unsampled step); adds its matrix-product dtypes."""
        if self._meter is None:
            return None
        self._meter.__exit__(None, None, None)
        counts = self.history["matrix_product_dtypes"]
        for dtype, count in self._meter.matrix_product_dtypes.items():
            counts[dtype] = counts.get(dtype, 0) + count
        peak, self._meter = float(self._meter.peak_bytes), None
        return peak

    # ----- validation
    def on_validation_epoch_start(self, trainer, module):
        self._validation_losses = []

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_index, dataloader_idx=0):
        self._validation_losses.append(float(outputs))

    def on_validation_epoch_end(self, trainer, module):
        if trainer.sanity_checking or not self._validation_losses:
            return
        local = sum(self._validation_losses) / len(self._validation_losses)
        (total,) = reduce_over_ranks([local], dist.ReduceOp.SUM, trainer.strategy.root_device)
        self._record_validation(trainer, total / self.world_size)

    def _record_validation(self, trainer, value: float):
        self.history["val_losses"][str(trainer.global_step)] = value
        for row in self._pending_rows + [self._partial and self._partial[0]]:
            if row and row["step"] == trainer.global_step:
                row["val_loss"] = value
        self._say(f"step {trainer.global_step}: validation loss {value:.4f}")

    # ----- end of run
    def on_train_end(self, trainer, module):
        last = str(trainer.global_step)
        if self.cfg.trainer.limit_val_batches > 0 and last not in self.history["val_losses"]:
            self._record_validation(trainer, evaluate(trainer, module))
        self._complete_partial(exchange=True)
        self._flush_rows(trainer)
        charts = self.cfg.trainer.charts
        images = trainer.strategy.write_evidence(self.run_directory, charts) if trainer.is_global_zero else []
        summary = self.write_summary(trainer, "completed")
        if trainer.is_global_zero:  # the charts and the summary, to W&B / TensorBoard (layerwise/tools/report.py)
            from layerwise.run.charts import log_run_evidence, write_plan_charts
            images += write_plan_charts(self.cfg, self.world_size, self.run_directory, charts)
            if self.expert_loads is not None and charts:  # expert_load.png (layerwise/run/experts.py)
                images += expert_evidence.write_expert_load_chart(self.run_directory)
            log_run_evidence(trainer.loggers, images, summary)

    def on_exception(self, trainer, module, exception):
        status = "interrupted" if isinstance(exception, KeyboardInterrupt) else "failed"
        self._complete_partial()  # no collective: the other ranks may be elsewhere; this rank's numbers
        self._flush_rows(trainer)
        # an agreed stop (preemption.Interrupted) adds the step it saved and the signal
        self.write_summary(trainer, status, error=f"{type(exception).__name__}: {exception}",
                           **getattr(exception, "summary", {}))

    # ----- files
    def _flush_rows(self, trainer):
        rows, self._pending_rows = self._pending_rows, []
        if not rows or not trainer.is_global_zero:
            return
        path = self.run_directory / "metrics.csv"
        new = not path.exists()
        with path.open("a", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=self.columns)
            if new:
                writer.writeheader()
            writer.writerows(rows)
        for row in filter(self._logs_row, rows):
            loggable = {k: v for k, v in row.items() if v is not None and k != "step"}
            for logger in trainer.loggers:
                logger.log_metrics(loggable, step=row["step"])

    def _logs_row(self, row) -> bool:
        """Loggers get every trainer.log_every_n_steps-th row, evaluation rows and the last: a W&B
        log call costs ~1 ms of a step on this machine; metrics.csv keeps every row."""
        return (row["step"] % self.log_every_n_steps == 0 or row["val_loss"] is not None
                or row["step"] == self.max_steps)

    def _rewrite_csv_up_to(self, step: int):
        """On start or resume, drop rows written after the checkpoint's step (they will be redone), and
        keep one row per step, the last written (a file from before the run directory was locked may
        hold a step twice: issue 55). Rewritten to a temporary file and renamed: never half a file."""
        path = self.run_directory / "metrics.csv"
        if not path.exists():
            return
        with path.open() as handle:
            rows = {int(r["step"]): r for r in csv.DictReader(handle) if r.get("step") and int(r["step"]) <= step}
        temporary = path.with_name(path.name + ".tmp")
        with temporary.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=self.columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows[s] for s in sorted(rows))
        os.replace(temporary, path)

    def write_summary(self, trainer, status: str, error: str = None, **extra):
        """Write summary.json on global rank 0 and return what it holds (None on other ranks);
        `extra`: fields an ending adds (an interruption's saved step and signal)."""
        if not trainer.is_global_zero:
            return None
        rows = self.history["rows"]
        # Speeds come from the steps the compute-memory meter left alone where there are any: its
        # dispatch mode on every operator slowed gpt_tiny's L2L blocks 1.5× (2.05 → 3.05 ms forward).
        unmetered = [r for r in rows if not r.get("memory_measured")] or rows

        def median(key, among=rows):  # rows of a checkpoint written before a column existed lack it
            values = [r[key] for r in among if r.get(key) is not None]
            return statistics.median(values) if values else None
        val = self.history["val_losses"]
        summary = {
            "status": status, "error": error,
            "strategy": self.cfg.strategy.name, "model": self.cfg.model.name,
            "hardware": self.cfg.hardware.name, "data": self.cfg.data.name,
            "world_size": self.world_size, "layout": self.layout,
            "steps": trainer.global_step, "tokens_per_step": self.tokens_per_step,
            "losses": self.history["losses"],
            "initial_val_loss": self.history["initial_val_loss"],
            "final_val_loss": val[max(val, key=int)] if val else None,
            "val_losses": val,
            "final_train_loss": self.history["losses"][-1] if self.history["losses"] else None,
            "skipped_steps": self.history.get("skipped_steps", []),  # non-finite loss, no update (faults.py)
            "stragglers": self.history.get("stragglers", []),  # slow ranks: rank, node, steps (hangs.py)
            "step_time_s_median": median("step_time_s", unmetered),
            "tokens_per_s_median": median("tokens_per_s", unmetered),
            "tokens_per_s_per_device": median("tokens_per_s_per_device", unmetered),
            "mfu": self._mfu(median("step_time_s", unmetered)),
            "comm_bytes_per_step": {k: median(f"comm_bytes_{k}") for k in KINDS} if rows else {},
            "comm_calls_per_step": median("comm_calls"),
            "peak_compute_bytes": max((r["peak_compute_bytes"] for r in rows
                                       if r.get("peak_compute_bytes") is not None), default=None),
            "allocator_peak_bytes": max((r["allocator_peak_bytes"] for r in rows
                                         if r.get("allocator_peak_bytes") is not None), default=None),
            "setup_peak_bytes": self.history.get("setup_peak_bytes"),
            "setup_allocator_peak_bytes": self.history.get("setup_allocator_peak_bytes"),
            "wall_time_s": time.perf_counter() - self._started if self._started else None,
            "versions": versions(), "git_sha": git_sha(),
            "precision": precision_name(self.history["matrix_product_dtypes"], master_dtype(trainer)),
        }
        bubble = trainer.strategy.bubble_fraction()
        if bubble is not None:
            summary["bubble_fraction"] = bubble
        if trainer.strategy.fp8_recipe is not None:  # fp8-mixed: Lightning ran bf16-mixed, these linears FP8
            summary["fp8"] = {"recipe": trainer.strategy.fp8_recipe, "emulated": trainer.strategy.fp8_emulate,
                              "linears": trainer.strategy.fp8_linears}  # this rank's (strategies/float8.py)
        for recorded in ("compile", "profile"):  # trainer.compile's counts, trainer.profile_steps' files
            if self.history.get(recorded):  # (layerwise/run/compiled.py, layerwise/run/profile.py)
                summary[recorded] = self.history[recorded]
        if self.expert_loads is not None and rows:  # a mixture of experts (layerwise/run/experts.py)
            summary["experts"] = {"expert_load_ratio_median": median("expert_load_ratio"),
                                  "expert_load_ratio_max": max((r["expert_load_ratio"] for r in rows
                                                                if r.get("expert_load_ratio") is not None), default=None),
                                  "aux_loss_final": rows[-1].get("aux_loss"),
                                  "dropped_tokens": sum(r.get("dropped_tokens") or 0 for r in rows)}
        summary.update(extra)
        write_json_atomically(self.run_directory / "summary.json", summary)
        return summary

    # ----- progress
    def _say(self, message: str):
        if self._is_global_zero and self.progress_lines:
            print(f"[layerwise] {message}", flush=True)

    def _progress(self, row):
        every = max(1, self.max_steps // 20)
        if row["step"] % every and row["step"] != self.max_steps:
            return
        self._say(f"step {row['step']}/{self.max_steps} loss {row['loss']:.4f} "
                  f"lr {row['lr']:.2e} {row['step_time_s']:.3f} s/step "
                  f"{row['tokens_per_s']:.0f} tokens/s {self._eta.describe(self.max_steps - row['step'])}")


class PointToPointOrderCheck(pl.Callback):
    """trainer.check_point_to_point_order: fail the run when two ranks issue their point-to-point
    operations in orders NCCL would mismatch (parallel/comm.py, strict mode); gloo would hide it.

    Recording starts before the first step (the initial validation included); every rank compares
    after each training step, each validation and at the end (the final validation included).
    """

    def on_fit_start(self, trainer, module):
        communicator = trainer.strategy.communicator()
        if communicator is not None:
            communicator.record_point_to_point()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
        self._check(trainer)

    def on_validation_epoch_end(self, trainer, module):
        self._check(trainer)

    def on_train_end(self, trainer, module):
        self._check(trainer)

    @staticmethod
    def _check(trainer) -> None:
        communicator = trainer.strategy.communicator()
        if communicator is not None:
            communicator.check_point_to_point_order()


def master_dtype(trainer) -> torch.dtype:
    """The dtype of the weights the optimizer updates."""
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                return parameter.dtype
    return torch.float32


@torch.no_grad()
def evaluate(trainer, module) -> float:
    """Validation loss outside Lightning's loop (before step 1 and at the very end)."""
    was_training = module.training
    module.eval()
    losses = []
    for index, batch in enumerate(trainer.datamodule.val_dataloader()):
        batch = trainer.strategy.batch_to_device(batch)
        losses.append(float(trainer.strategy.validation_step(batch, index)))
    module.train(was_training)
    (total,) = reduce_over_ranks([sum(losses) / len(losses)], dist.ReduceOp.SUM, trainer.strategy.root_device)
    return total / (dist.get_world_size() if dist.is_initialized() else 1)


def outcome(summary: dict) -> str:
    """A finished run in one line: status, validation loss before and after (or the last training
    loss when validation was off), throughput."""
    if summary.get("initial_val_loss") is not None and summary.get("final_val_loss") is not None:
        losses = f"validation loss {summary['initial_val_loss']:.4f} -> {summary['final_val_loss']:.4f} nats/token"
    else:
        losses = f"training loss {summary.get('final_train_loss')} (no validation ran)"
    return f"{summary['status']}: {losses}, {summary['tokens_per_s_median'] or 0:.0f} tokens/s"
