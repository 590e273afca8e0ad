"""Stopping at a step boundary, inside the ranks: a stop signal (SIGTERM, SIGINT, SIGHUP) and Slurm's
preemption. Each handler only sets a flag; the step-boundary agreement, the save and the exit (and,
for a preemption, the requeue) follow (layerwise/cluster/slurm.py submits the jobs; this is what runs
in them; layerwise/run/launch.py owns the local ranks and passes its own signals on to them).

The agreed stop (`STOP`, `StopAtStepBoundary`): the first SIGTERM, SIGINT or SIGHUP the launching
process receives sets a flag in shared memory every local rank reads (launch.run_ranks); a SIGTERM
sent to a rank itself sets that rank's own flag. At the next step boundary every rank agrees on it
(the step's evidence exchange carries it), all save the checkpoint, and the run unwinds with
`Interrupted` (metrics flushed, summary "interrupted" with the saved step); the launcher then
prints one line naming the step and the command that resumes, and exits 128 + the signal.

Slurm sends SIGUSR2 `signal_delay_s` before the time limit (or on `scancel --signal=USR2`). The
handler only sets a flag; at the next step boundary all ranks agree on it (the step's evidence
exchange carries it), all save the checkpoint, the run unwinds (metrics flushed, summary
"interrupted", W&B closed), rank 0 runs `scontrol requeue` and the ranks exit without a result.
"""

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional


PREEMPTION_SIGNAL = signal.SIGUSR2  # submitit asks Slurm for --signal=USR2@signal_delay_s


class _Preemption:
    requested = False  # set by the signal handler, nothing else happens there
    saved = False  # set after every rank saved the checkpoint at a step boundary


PREEMPTION = _Preemption()


def _on_preemption_signal(signum, frame) -> None:
    PREEMPTION.requested = True
    os.write(2, f"[layerwise] received {signal.Signals(signum).name}: checkpoint and requeue at "
                f"the next step boundary\n".encode())


def install_preemption_handler() -> None:
    signal.signal(PREEMPTION_SIGNAL, _on_preemption_signal)


# ============================================================ the agreed stop on a signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # Ctrl-C, kill/timeout/schedulers, hang-up


class _Stop:
    """This process's request to stop at the next step boundary: `signal`, the number of the stop
    signal this process received itself, or `shared`, the launcher's flag in shared memory (its
    first stop signal's number, 0 before any) in a local rank. Handlers only set these."""

    signal = 0
    shared = None

    def number(self) -> int:
        return self.signal or (self.shared.value if self.shared is not None else 0)

    def requested(self) -> bool:
        return self.number() != 0

    def name(self):
        return signal.Signals(self.number()).name if self.requested() else None


STOP = _Stop()


def on_stop_signal(signum, frame) -> None:
    """A rank's SIGTERM (or the in-process run's stop signal): only the flag; nothing is written here
    (the one line comes from the launcher at the end)."""
    STOP.signal = STOP.signal or signum


class Interrupted(KeyboardInterrupt):
    """Every rank stopped together at a step boundary after a stop signal, the checkpoint saved there.
    A KeyboardInterrupt, as Lightning names an interruption: its on_exception hooks run (the evidence
    writes summary "interrupted"); `summary` holds the fields the summary adds."""

    def __init__(self, message: str, step: int, saved_step):
        super().__init__(message)
        # ranks ignore SIGINT and SIGHUP (launch._rank_entry): a stop this rank did not see is a peer's SIGTERM
        self.summary = {"saved_step": saved_step, "signal": STOP.name() or "SIGTERM"}
        self.step = step


def agreed_stop_callback(checkpoint_path: Path, evidence, last_saved=lambda: None):
    import lightning.pytorch as pl

    class StopAtStepBoundary(pl.Callback):
        """Any rank's stop flag rides in each step's evidence exchange; at the end of the step whose
        exchange carries it, every rank saves the checkpoint (unless this step's was just saved:
        `last_saved()` is the step of the run's last save) and raises `Interrupted`.

        Replaces Lightning's own SIGTERM handling, which broadcasts rank 0's flag before every step (a
        blocking collective: 1.2-1.3 ms a step, issue 15), issues another broadcast from inside its
        signal handler, and stops only the signalled rank; its handler is installed after on_fit_start,
        so ours goes in at on_train_start (Lightning restores the handler it found at teardown)."""

        def on_train_start(self, trainer, module):
            evidence.flags["stop"] = STOP.requested
            if trainer.world_size > 1:  # the flag travels in our exchange instead of Lightning's broadcast
                trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None
            if threading.current_thread() is threading.main_thread():  # handlers: main thread only
                previous = trainer._signal_connector._original_handlers.get(signal.SIGTERM)

                def flag_only(signum, frame):  # then the handler Lightning found (a launcher's, say)
                    on_stop_signal(signum, frame)
                    if callable(previous) and previous is not on_stop_signal:
                        previous(signum, frame)
                signal.signal(signal.SIGTERM, flag_only)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
            if not evidence.any_rank(trainer, "stop"):
                return
            step = trainer.global_step
            if step >= trainer.max_steps:
                return  # the last step: finishing is better than stopping
            if last_saved() != step:
                trainer.save_checkpoint(checkpoint_path, weights_only=False)  # all ranks, atomic
            raise Interrupted(f"stopped by {STOP.name() or 'SIGTERM to another rank'} after step {step}, "
                              f"saved to {checkpoint_path}", step, step)

        def teardown(self, trainer, module, stage):
            trainer.fit_loop.epoch_loop.__dict__.pop("_broadcast_sigterm_tensor", None)

    return StopAtStepBoundary()


def under_slurm_step() -> bool:
    """This process is one task of a Slurm job step with the ranks started by srun."""
    return "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ and "SLURM_JOB_ID" in os.environ


def slurm_job_id() -> str:
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array:
        return f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ["SLURM_JOB_ID"]


class Preempted(KeyboardInterrupt):
    """Ends fit after the checkpoint: Lightning treats it as an interruption (summary: interrupted)."""


def requeue_on_preemption_callback(checkpoint_path: Path, evidence):
    import lightning.pytorch as pl

    class RequeueOnPreemption(pl.Callback):
        """At each step boundary all ranks agree on the flag (it travels in the step's evidence
        exchange, `slurm_step_flags`); if set on any rank: save, requeue, stop."""

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
            if not evidence.any_rank(trainer, "preemption"):
                return
            if trainer.global_step >= trainer.max_steps:
                return  # the last step: finishing is better than requeueing
            trainer.save_checkpoint(checkpoint_path, weights_only=False)  # all ranks, atomic
            PREEMPTION.saved = True
            if trainer.is_global_zero:
                print(f"[layerwise] preempted: checkpoint at step {trainer.global_step} saved to "
                      f"{checkpoint_path}", flush=True)
            # Unwind first (metrics row, summary "interrupted", W&B closed); requeue at the very end
            # (exit_after_requeue): requeueing sends SIGTERM to the whole job, W&B's service too.
            raise Preempted(f"preempted at step {trainer.global_step}")

    return RequeueOnPreemption()


def requeues_so_far() -> int:
    """How often Slurm has requeued this job (SLURM_RESTART_COUNT; absent before the first)."""
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def exit_after_requeue(rank: int, max_requeues: Optional[int] = None) -> None:
    """Rank 0 requeues the job; every rank leaves without a result file (submitit must see the
    job continue, not finish). A failed requeue fails the job: its checkpoint is still there.
    After `max_requeues` requeues (hydra.launcher.max_requeues) every rank fails instead: a job that
    cannot finish in its time limit would otherwise be requeued forever."""
    done = requeues_so_far()
    if max_requeues is not None and done >= max_requeues:
        if rank == 0:  # failing_rank() reads this line from the job log
            print(f"[layerwise] rank 0 failed: preempted after {done} requeue(s), the limit "
                  f"hydra.launcher.max_requeues={max_requeues}: not requeued. The checkpoint is kept. "
                  f"Fix: raise hydra.launcher.timeout_min or hydra.launcher.max_requeues, then rerun "
                  f"the same command: it resumes from the checkpoint.", file=sys.stderr, flush=True)
        raise SystemExit(1)
    if rank == 0:
        job = slurm_job_id()
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=60)
        print(f"[layerwise] job {job} requeued: it resumes from its checkpoint", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(0)


def slurm_plugins(strategy) -> list:
    """Lightning's Slurm environment without its signal handling. The process groups' timeout is the
    run's (layerwise/run/timeouts.py `TimeoutChain`, set in fit.py), not the launcher's: a shorter one
    would abort the ranks before the watchdog names the stuck one."""
    if not under_slurm_step():
        return []
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    return [SLURMEnvironment(auto_requeue=False)]


def slurm_step_flags() -> dict:
    """What each step's evidence exchange carries for Slurm: whether this rank was told to stop."""
    return {"preemption": lambda: PREEMPTION.requested} if under_slurm_step() else {}


def slurm_callbacks(checkpoint_path: Path, evidence) -> list:
    return [requeue_on_preemption_callback(checkpoint_path, evidence)] if under_slurm_step() else []
