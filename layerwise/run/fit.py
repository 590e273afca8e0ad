"""One training run: build data, task, strategy and Trainer in each rank, fit, leave evidence.

`train(cfg, run_directory)` is what train.py calls after validation. It starts local ranks (or runs
in place when Slurm/torchrun started the ranks), resumes from the run directory's `last`
checkpoint when there is one, and returns rank 0's summary (None in the other ranks Slurm or
torchrun started: only global rank 0 writes, and reads, the run directory's files).
"""

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from omegaconf import OmegaConf

from layerwise.config.layout import layout_of
from layerwise.config.machine import rank_threads
from layerwise.run import data as data_lib
from layerwise.run.console import console_to_log
from layerwise.run.evidence import PointToPointOrderCheck, RunEvidence, write_json_atomically
from layerwise.run.faults import NonFiniteGuard
from layerwise.run.hangs import HangWatch, fresh, hang_directory, nccl_flight_recorder_environment
from layerwise.run.timeouts import run_timeout_chain
from layerwise.run.launch import (HangError, RankError, RunInterrupted, StopSignals, close_process_group,
                                  global_rank, launched_externally, run_ranks, start_method, writes_run_files)
from layerwise.run.lock import hold_run_directory, taken_over_line
from layerwise.run.preemption import (STOP, Interrupted, agreed_stop_callback, slurm_callbacks, slurm_plugins,
                                      slurm_step_flags)
from layerwise.run.task import LanguageModelData, LanguageModelTask, objective_of
from parallel.layout import RANK_ORDER
from strategies import strategy_entry
from strategies.compile import eager_note
from strategies.float8 import PRECISION as FP8_PRECISION, lightning_precision
from strategies.checkpoint.per_rank import (checkpoint_exists, load_first_readable, read_checkpoint_file, swap_in,
                                            write_checkpoint_file)
from strategies.checkpoint.portable import resolve_portable


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save to a temporary name, then rename (the replaced file kept as `previous.ckpt`): a
    preempted or failed save never leaves half a file; a damaged `last` falls back to `previous`."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + ".tmp")
        write_checkpoint_file(checkpoint, temporary)
        swap_in(temporary, path)

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        # every rank reads the same file here (single, ddp), so all fall back alike without a vote
        return load_first_readable(Path(path), read_checkpoint_file)


class LastCheckpoint(pl.Callback):
    """Rewrite `checkpoints/last.ckpt` every n steps and at the end, on all ranks together."""

    def __init__(self, path: Path, every_n_steps: int):
        self.path = Path(path)
        self.every_n_steps = every_n_steps
        self.saved_step = None  # the agreed stop saves only if this step's save has not happened

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
        if trainer.global_step % self.every_n_steps == 0:
            self._save(trainer)

    def on_train_end(self, trainer, module):
        if trainer.global_step % self.every_n_steps:
            self._save(trainer)

    def _save(self, trainer):
        trainer.save_checkpoint(self.path, weights_only=False)
        self.saved_step = trainer.global_step


def checkpoint_path(run_directory: Path) -> Path:
    return Path(run_directory) / "checkpoints" / "last.ckpt"


def build_loggers(cfg, run_directory: Path):
    name = cfg.logger.name
    if name == "wandb":
        from lightning.pytorch.loggers import WandbLogger
        return [WandbLogger(save_dir=str(run_directory), project=cfg.logger.project,
                            entity=cfg.logger.entity, group=cfg.logger.group, name=cfg.run_name,
                            job_type=cfg.strategy.name, offline=cfg.logger.mode == "offline",
                            mode=cfg.logger.mode,
                            id=wandb_run_id(run_directory) if writes_run_files() else None,
                            resume="allow", config=OmegaConf.to_container(cfg, resolve=True))]
    if name == "csv":
        from lightning.pytorch.loggers import CSVLogger
        return [CSVLogger(str(run_directory), name="csv_logs")]
    if name == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger
        return [TensorBoardLogger(str(run_directory), name="tensorboard")]
    return []


def wandb_run_id(run_directory: Path) -> str:
    """One W&B run per run directory: a requeued or resumed job continues the same run. Global
    rank 0 alone logs to W&B, so it alone creates the id (the link keeps that atomic)."""
    path = Path(run_directory) / "wandb_run_id"
    if not path.exists():
        import uuid
        candidate = path.with_name(f"{path.name}.{uuid.uuid4().hex}")
        candidate.write_text(uuid.uuid4().hex[:12])
        try:
            os.link(candidate, path)  # atomic; fails if another rank won
        except FileExistsError:
            pass
        finally:
            candidate.unlink()
    return path.read_text().strip()


def show_bar(cfg) -> bool:
    progress = cfg.trainer.progress
    return progress == "bar" or (progress == "auto" and sys.stdout.isatty())


def build_trainer(cfg, run_directory: Path, world_size: int, strategy, evidence) -> pl.Trainer:
    # the watchdog first: after a hang its on_exception parks this rank until the watchdog ends it
    last = LastCheckpoint(checkpoint_path(run_directory), cfg.trainer.checkpoint_every_n_steps)
    callbacks = [HangWatch(cfg, run_directory, world_size, evidence, cfg.hardware.devices_per_node),
                 *run_records(cfg, run_directory, evidence),  # before the evidence, which writes what they record
                 evidence,  # the guard before the checkpoint: a non-finite step is never saved
                 NonFiniteGuard(cfg.trainer.skip_nonfinite_steps, evidence, checkpoint_path(run_directory)),
                 last,  # then the agreed stop: SIGTERM/SIGINT/SIGHUP save at the step boundary, its flag
                 agreed_stop_callback(checkpoint_path(run_directory), evidence,  # in the evidence's exchange
                                      lambda: last.saved_step)]
    callbacks += slurm_callbacks(checkpoint_path(run_directory), evidence)  # preemption: save, requeue
    if cfg.trainer.check_point_to_point_order:  # after RunEvidence: its final validation is checked too
        callbacks.append(PointToPointOrderCheck())
    if show_bar(cfg):
        from lightning.pytorch.callbacks import RichProgressBar
        callbacks.append(RichProgressBar())
    single = world_size == 1
    precision, precision_plugins = precision_arguments(cfg.hardware)
    # every process group's own timeout outlasts the watchdog's longest allowance: ours speaks first
    strategy.set_collective_timeout(run_timeout_chain(cfg).process_group_s)
    return pl.Trainer(
        accelerator="gpu" if cfg.hardware.accelerator == "gpu" else "cpu",
        devices=1 if single else cfg.hardware.devices_per_node,
        num_nodes=1 if single else cfg.hardware.nodes, strategy=strategy,
        precision=precision, max_steps=cfg.trainer.max_steps,
        val_check_interval=cfg.trainer.val_check_interval, check_val_every_n_epoch=None,
        limit_val_batches=cfg.trainer.limit_val_batches, num_sanity_val_steps=0,
        logger=build_loggers(cfg, run_directory) or False, callbacks=callbacks,
        enable_checkpointing=False, enable_progress_bar=show_bar(cfg),
        enable_model_summary=False, use_distributed_sampler=False,
        gradient_clip_val=cfg.trainer.gradient_clip_val or None,
        log_every_n_steps=cfg.trainer.log_every_n_steps, default_root_dir=str(run_directory),
        plugins=[AtomicCheckpointIO()] + precision_plugins + slurm_plugins(strategy), accumulate_grad_batches=1)


def run_records(cfg, run_directory: Path, evidence) -> list:
    """The callbacks of trainer.compile (graphs counted) and trainer.profile_steps (traces written)."""
    records = []
    if cfg.trainer.compile:
        from layerwise.run.compiled import CompileRecord
        records.append(CompileRecord(evidence, eager_note(cfg, strategy_entry(cfg.strategy.name))))
    if cfg.trainer.profile_steps:
        from layerwise.run.profile import StepProfiler
        records.append(StepProfiler(run_directory, cfg.trainer.profile_steps, evidence, compiled=cfg.trainer.compile))
    return records


def precision_arguments(hardware) -> tuple:
    """(Trainer's precision, extra plugins). Lightning silently turns 16-mixed on a CPU into
    bf16-mixed; validation refuses 16-mixed on CPU for users, but the tests run it on purpose, to
    emulate a GPU's fp16 (CPU autocast in fp16, GradScaler("cpu")): pass its plugin explicitly."""
    if hardware.accelerator == "cpu" and hardware.precision == "16-mixed":
        from lightning.pytorch.plugins import MixedPrecision
        return None, [MixedPrecision("16-mixed", "cpu")]
    return lightning_precision(hardware.precision), []  # fp8-mixed runs as bf16-mixed plus its linears


def load_corpus(cfg, say=lambda message: None):
    return data_lib.configured_corpus(cfg, say)


def tokenize_once(cfg) -> None:
    """data=text: tokenize into the cache here, before any rank starts, so ranks only read it
    (layerwise/run/text.py); under torchrun/srun global rank 0 does it and the others learn its
    cache key from it without reading the corpus. This wait comes before any process group or
    watchdog exists, so it has its own deadline: trainer.collective_timeout_s without progress
    from rank 0 (text.wait_seconds); rank 0's failure is reported at once."""
    if cfg.data.corpus != "text":
        return
    if not launched_externally() or global_rank() == 0:
        load_corpus(cfg, say=lambda message: print(f"[layerwise] {message}", flush=True))
        return
    from layerwise.run.timeouts import collective_timeout_s
    from layerwise.run.text import learned_key, wait_seconds
    learned_key(cfg.data.path, cfg.data.tokenizer, cfg.data.validation_fraction, cfg.data.get("cache_dir"),
                timeout_s=wait_seconds(collective_timeout_s(cfg)), encoding=cfg.data.encoding)


def fit_rank(rank: int, cfg, run_directory: Path, world_size: int) -> dict:
    """Everything one rank does: build, fit (resuming if possible), return the summary path.
    Lightning's own lines and the dependencies' warnings go to train.log (layerwise/run/console.py)."""
    with console_to_log(run_directory, global_rank() if launched_externally() else rank):
        return _fit_rank(rank, cfg, run_directory, world_size)


def _fit_rank(rank: int, cfg, run_directory: Path, world_size: int) -> dict:
    pl.seed_everything(cfg.seed, workers=False, verbose=False)
    corpus = load_corpus(cfg)
    objective = objective_of(cfg.model)
    task = LanguageModelTask(cfg, data_lib.model_vocab_size(corpus, objective))
    entry = strategy_entry(cfg.strategy.name)
    degrees = layout_of(cfg, world_size).as_dict()
    layout = {**degrees, "order": [axis for axis in RANK_ORDER if axis in degrees]}  # tensor innermost
    evidence = RunEvidence(run_directory, cfg, world_size, layout,
                           progress_lines=not show_bar(cfg) and cfg.trainer.progress != "none",
                           flags=slurm_step_flags(),
                           # the meter is a TorchDispatchMode, which compiled code refuses (dynamo: "non-infra
                           # torch dispatch mode present"): a compiled run measures the allocator's peak only
                           measure_memory=not cfg.trainer.compile)
    strategy = entry.build(cfg, world_size)
    # where the strategy declares its blocks eager, they stay eager and the run says why (eager_note)
    if cfg.hardware.precision == FP8_PRECISION:  # the blocks' linears in FP8 (validation refused it where it cannot run)
        strategy.enable_fp8(cfg.hardware.fp8_recipe, cfg.hardware.fp8_emulate)
    strategy.enable_compile(cfg.trainer.compile and eager_note(cfg, entry) is None)
    trainer = build_trainer(cfg, run_directory, world_size, strategy, evidence)
    for logger in trainer.loggers:  # the resolved config is logged at creation; add the layout
        logger.log_hyperparams({"layout": layout, "world_size": world_size})
    resume_from = checkpoint_path(run_directory)
    resume = cfg.resume and checkpoint_exists(resume_from)
    if not resume and cfg.get("resume_from"):  # the run's own checkpoint first: a rerun continues it
        resume_from, resume = resolve_portable(cfg.resume_from), True
        trainer.strategy.portable_resume = True  # restore after setup, into this layout's pieces
    if resume and trainer.is_global_zero:
        print(f"[layerwise] resuming from {resume_from}", flush=True)
    try:
        trainer.fit(task, datamodule=LanguageModelData(cfg, corpus),
                    ckpt_path=str(resume_from) if resume else None)
    finally:
        finish_wandb(cfg)
    return {"rank": rank, "steps": trainer.global_step}


def finish_wandb(cfg) -> None:
    """Close this process's W&B run: the next sweep point may fork from this process, and a
    child that inherits an open run would log into it instead of starting its own."""
    if cfg.logger.name == "wandb" and "wandb" in sys.modules and sys.modules["wandb"].run is not None:
        sys.modules["wandb"].finish()


def train(cfg, run_directory: Path, world_size: int):
    """Fit on all ranks; on any rank's failure, record it in summary.json and re-raise.

    The run directory is held for the whole run (layerwise/run/lock.py): a second run on it raises
    RunDirectoryLocked before it starts anything. A stop signal ends the run at a step boundary with
    the checkpoint saved there: RunInterrupted, its summary recorded (`record_interruption`).
    Returns rank 0's summary; None in a rank Slurm or torchrun started other than global rank 0
    (that rank's node may not even see the file rank 0 writes)."""
    run_directory = Path(run_directory)
    run_directory.mkdir(parents=True, exist_ok=True)
    with holding(run_directory):
        return _train(cfg, run_directory, world_size)


@contextlib.contextmanager
def holding(run_directory: Path):
    """Global rank 0 holds the run directory's lock for the run's life (the ranks it forks share it);
    a lock its dead holder left is taken over, in one line."""
    if not writes_run_files():
        yield
        return
    with hold_run_directory(run_directory) as stale:
        if stale is not None:
            print(f"[layerwise] {taken_over_line(stale)}", flush=True)
        yield


def _train(cfg, run_directory: Path, world_size: int):
    os.environ.update(nccl_flight_recorder_environment(cfg, run_directory))  # GPU profiles: NCCL's own record
    started = time.time()  # a summary older than this is a previous run's
    note = eager_note(cfg, strategy_entry(cfg.strategy.name))
    if note and writes_run_files():  # said once, before any rank starts (summary.json keeps it too)
        print(f"[layerwise] {note}", flush=True)
    try:
        tokenize_before_launch(cfg)
        if world_size == 1 or launched_externally():
            fit_in_this_process(cfg, run_directory, world_size)
        else:
            run_ranks(fit_rank, world_size, cfg, run_directory, world_size,
                      method=start_method(cfg.hardware.accelerator),
                      ranks_per_node=cfg.hardware.devices_per_node, hang_directory=hang_directory(run_directory),
                      stop_at_step=True)  # a stop signal: every rank saves at the next step boundary
    except RunInterrupted as stop:
        if writes_run_files():
            record_interruption(run_directory, cfg, world_size, stop, started)
        raise
    except RankError as error:
        record_failure(run_directory, cfg, world_size, error)
        raise
    if not writes_run_files():
        return None
    import json
    return json.loads((run_directory / "summary.json").read_text())


def tokenize_before_launch(cfg) -> None:
    """`tokenize_once`, stopped at once by a stop signal: no rank and no step exists yet, so there is
    nothing to save. The KeyboardInterrupt unwinds the tokenizer (which leaves no partial cache,
    layerwise/run/text.py) and becomes RunInterrupted: one line, exit 128 + the signal (SIGTERM and
    SIGHUP too, which would otherwise end the process without a word)."""
    def interrupt(signum):
        raise KeyboardInterrupt(signal.Signals(signum).name)
    own = not launched_externally()
    signals = StopSignals(interrupt, interrupt, forced_at_once=True) if own and cfg.data.corpus == "text" else None
    try:
        with signals or contextlib.nullcontext():
            tokenize_once(cfg)
    except KeyboardInterrupt:
        if signals is None:
            raise
        raise RunInterrupted(signals.received or signal.SIGINT, forced=True) from None


def fit_in_this_process(cfg, run_directory: Path, world_size: int) -> None:
    """One rank here: a one-process run (this process is its own launcher: its first stop signal sets
    the agreed-stop flag, a second one interrupts at once), or a rank torchrun or srun started (their
    launcher owns the signals; a SIGTERM still stops at the step boundary). Lightning turns a
    KeyboardInterrupt into sys.exit(1) once its on_exception hooks ran: that becomes RunInterrupted."""
    own = not launched_externally()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun sets OMP_NUM_THREADS=1 for several ranks a node;
        # a GPU rank takes its share of the node's cores as our own launchers give it (rank_threads)
        import torch
        torch.set_num_threads(rank_threads(cfg.hardware.accelerator, int(os.environ.get("LOCAL_WORLD_SIZE", 1))))

    def interrupt_now(signum):
        raise KeyboardInterrupt(f"second {signal.Signals(signum).name}")
    signals = StopSignals(lambda signum: setattr(STOP, "signal", signum), interrupt_now) if own else None
    try:
        with signals or contextlib.nullcontext():
            fit_rank(global_rank(), cfg, run_directory, world_size)
    except (SystemExit, KeyboardInterrupt) as ending:
        interruption = ending if isinstance(ending, KeyboardInterrupt) else ending.__context__
        if not own or not isinstance(interruption, KeyboardInterrupt):
            raise
        agreed = isinstance(interruption, Interrupted)
        raise RunInterrupted(signals.received or STOP.number(), forced=not agreed) from None
    finally:
        close_process_group()
        STOP.signal = 0  # the next run in this process (a sweep's next point) starts unasked


def record_interruption(run_directory: Path, cfg, world_size: int, stop: RunInterrupted, started: float) -> None:
    """Complete rank 0's "interrupted" summary with the launcher's signal (or write a minimal one when
    the ranks were killed before writing theirs), and give `stop` the saved step and the checkpoint
    for its one line."""
    import json
    path = run_directory / "summary.json"
    summary = json.loads(path.read_text()) if fresh(path, started) else {}
    if summary.get("status") != "interrupted":
        summary = {"status": "interrupted", "error": str(stop), "strategy": cfg.strategy.name,
                   "model": cfg.model.name, "hardware": cfg.hardware.name, "data": cfg.data.name,
                   "world_size": world_size}
    summary.update(signal=stop.signal.name, forced=stop.forced,
                   saved_step=None if stop.forced else summary.get("saved_step"))
    write_json_atomically(path, summary)
    stop.saved_step = summary["saved_step"]
    stop.checkpoint = checkpoint_path(run_directory) if checkpoint_exists(checkpoint_path(run_directory)) else None


def record_failure(run_directory: Path, cfg, world_size: int, error: RankError) -> None:
    """Keep rank 0's own summary if it wrote one for this ending (failed, or interrupted by a signal
    every rank agreed on; hung: the diagnosing rank's); otherwise write a minimal one."""
    path = run_directory / "summary.json"
    import json
    hung = isinstance(error, HangError)  # the diagnosing rank wrote "hung" (layerwise/run/hangs.py)
    summary = json.loads(path.read_text()) if path.exists() else {}
    status = summary.get("status")
    if status == "failed" and not hung and error.rank != 0:  # rank 0's own "failed" is a peer's loss
        # (gloo's "Connection closed by peer" after rank 1 was killed): the launcher knows the rank
        summary.update(error=str(error).splitlines()[-1], failed_rank=error.rank)
        write_json_atomically(path, summary)
        return
    if status in (("hung",) if hung else ("failed", "interrupted")):
        return
    write_json_atomically(path, {"status": "hung" if hung else "failed", "error": str(error).splitlines()[-1],
                                 "failed_rank": error.rank, "strategy": cfg.strategy.name,
                                 "model": cfg.model.name, "hardware": cfg.hardware.name,
                                 "data": cfg.data.name, "world_size": world_size})
