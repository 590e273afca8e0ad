"""Start the ranks of one run and train in each: local processes, or ranks Slurm/torchrun started.

On a laptop the launching process starts one process per rank, sets the rendezvous variables in
each child, and waits. If any rank fails, the others are ended at once and the failing rank's
traceback is raised in the parent: a run never hangs on a dead peer and never leaves a stray process.

Start method: CPU ranks are forked (3-5x faster than spawn or Lightning's popen launcher: nothing
is re-imported). GPU ranks are spawned: a forked child cannot use CUDA if the parent initialised
it, and spawn makes that impossible whatever the parent imported. The parent itself never
initialises CUDA either (docs/architecture.md, departure 2): it counts GPUs with NVML only (`local_gpu_count`).

The launcher owns its ranks (docs/faults.md, "Stopping a run"). Its first SIGTERM, SIGINT or SIGHUP
sets a flag in shared memory that every rank reads at its next step boundary: they agree, save and
stop (layerwise/run/preemption.py), and `run_ranks` raises `RunInterrupted`; a second signal kills
them at once. The ranks ignore SIGINT and SIGHUP themselves (a terminal sends Ctrl-C and its hang-up
to the whole foreground group: each rank would raise KeyboardInterrupt on its own) and die with the
launcher however it dies (PR_SET_PDEATHSIG), so no rank outlives it to write into a run directory a
rerun is using.

Several nodes on one machine (`hardware.nodes` > 1 without Slurm or torchrun) are emulated: rank r
gets LOCAL_RANK = r mod devices_per_node and NODE_RANK = r div devices_per_node, as a cluster
would give it.
"""

import contextlib
import ctypes
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Optional

import torch
import torch.multiprocessing as multiprocessing

from layerwise.config.machine import rank_threads
from layerwise.run.hangs import HUNG_EXIT_CODE, fresh, process_state, read_json
from layerwise.run.preemption import STOP, STOP_SIGNALS, on_stop_signal

RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")


class RankError(RuntimeError):
    """A rank raised or died; the message carries its rank and traceback."""

    exit_codes = None  # every rank's exit code, when the local launcher ended them

    def __init__(self, rank: int, detail: str):
        self.rank = rank
        self.detail = detail
        super().__init__(f"rank {rank} failed:\n{detail}")


class HangError(RankError):
    """The ranks' watchdogs found a hang; `detail` is the diagnosis paragraph naming the stuck rank."""

    def __init__(self, rank: int, detail: str):
        RuntimeError.__init__(self, f"hung: {detail}")
        self.rank, self.detail = rank, detail


class RunInterrupted(Exception):
    """The run stopped on a signal: every rank saved at the step boundary (`forced` False), or a second
    signal killed the ranks at once (`forced`: the last periodic checkpoint is what remains).
    Not a RankError: nothing failed. `exit_code` is the shell's for the signal, 128 + its number."""

    def __init__(self, signum: int, forced: bool = False):
        self.signal = signal.Signals(signum or signal.SIGTERM)  # unknown: a rank's own SIGTERM
        self.forced = forced
        self.exit_code = 128 + self.signal.value
        self.saved_step, self.checkpoint = None, None  # filled from the run's summary (fit.record_interruption)
        super().__init__(f"{'stopped at once' if forced else 'stopped'} by {self.signal.name}")

    def line(self, command: str) -> str:
        """The one line a user reads: what was saved, and the command that resumes."""
        if not self.forced and self.saved_step is not None:
            return (f"interrupted by {self.signal.name}: every rank stopped after step {self.saved_step} and "
                    f"saved it to {self.checkpoint}; the same command resumes from there: {command}")
        kept = (f"rerunning resumes from the last checkpoint, {self.checkpoint}" if self.checkpoint
                else "no checkpoint was written: rerunning starts over")
        how = "stopped at once, without a save" if self.forced else "stopped before a step was saved"
        return f"interrupted by {self.signal.name}: {how}; {kept}: {command}"


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (PR_SET_PDEATHSIG), and leave at
    once if the parent already died before that was set (it would never fire: the parent is then
    PID 1 or a subreaper). SIGKILL: a rank without its launcher must not write into a run directory
    a rerun may already be using; the checkpoint is swapped in atomically, so at most the steps since
    the last save are lost. The signal follows the parent *thread* that forked: run_ranks must be
    called from a thread that lives as long as the ranks (the main thread, in train.py)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not Linux's prctl: the launcher's own handlers still end the ranks
    if os.getppid() != parent_pid:
        os._exit(1)


class StopSignals:
    """The launching process's handlers of SIGINT, SIGTERM and SIGHUP, installed for a block.

    The first signal calls `first(signum)` (pass it on: set the ranks' shared flag, or this process's
    own flag when it is the only rank); a second calls `again(signum)` (end the ranks at once). They
    act only in the process that installed them: a rank forked before it resets its handlers runs
    nothing here. Outside the main thread nothing is installed (Python allows handlers only there)."""

    def __init__(self, first, again, forced_at_once: bool = False):
        self.first, self.again, self.forced_at_once = first, again, forced_at_once
        self.received, self.forced, self._previous, self._owner = 0, False, {}, os.getpid()

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self._owner:
            return
        if not self.received:
            self.received, self.forced = signum, self.forced_at_once
            self.first(signum)
        else:
            self.forced = True
            self.again(signum)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = {number: signal.signal(number, self._handle) for number in STOP_SIGNALS}
        return self

    def __exit__(self, *exception):
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        return False


@contextlib.contextmanager
def blocked(signals):
    """Block `signals` in this thread within; those that arrive meanwhile are delivered after.

    Around starting the ranks: a child inherits the mask through fork and exec, so a spawned rank's
    interpreter (seconds of imports before `_rank_entry` runs) cannot take the terminal's Ctrl-C as a
    KeyboardInterrupt: it is held pending until the rank ignores it, and then discarded."""
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launched_externally() -> bool:
    """True under srun/torchrun: the ranks already exist, this process is one of them."""
    return "LOCAL_RANK" in os.environ or "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ


def global_rank() -> int:
    """This process's rank in the world: torchrun's RANK, srun's SLURM_PROCID, else 0 (the only
    process, or the parent that launches the ranks)."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


def writes_run_files() -> bool:
    """Only global rank 0 writes the run directory's files (docs/evidence.md)."""
    return global_rank() == 0


def external_world_size():
    """How many processes torchrun or srun started, or None when nothing started them."""
    if not launched_externally():
        return None
    return int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1)))


def external_world_errors(world_size: int, sweep: bool = False) -> list:
    """What is wrong with the processes torchrun or srun started for this configuration: another
    number than it needs, or a sweep under torchrun (each rank would name its own sweep directory
    from its own clock, and the ranks would not agree on the points' directories)."""
    errors, started = [], external_world_size()
    if started is not None and started != world_size:
        errors.append(f"the launcher started {started} processes (WORLD_SIZE / SLURM_NTASKS) but "
                      f"this configuration runs {world_size} (hardware.nodes × "
                      f"hardware.devices_per_node, or 1 for a one-process strategy). Fix: torchrun "
                      f"--nnodes=N --nproc-per-node=D with N × D = {world_size}, or set "
                      f"hardware.nodes and hardware.devices_per_node to match.")
    if sweep and "TORCHELASTIC_RUN_ID" in os.environ:
        errors.append("python train.py -m (a sweep) under torchrun: every rank would sweep on its "
                      "own. Fix: one torchrun command per point, without -m (or hydra/launcher=slurm "
                      "on a Slurm cluster).")
    return errors


def start_method(accelerator: str) -> str:
    """`spawn` for GPU ranks (a forked child cannot use CUDA once a parent touched it), `fork`
    for CPU ranks (nothing re-imported: 3-5x faster)."""
    return "spawn" if accelerator == "gpu" else "fork"


def local_gpu_count() -> int:
    """CUDA devices on this node, counted without initialising CUDA in this process.

    NVML reads the driver's device list; torch.cuda.is_available() and device_count()'s fallback
    call cudaGetDeviceCount, which initialises the CUDA driver in the caller, and children forked
    after that cannot use CUDA. When NVML cannot answer, a short-lived subprocess counts instead.
    """
    if not torch.backends.cuda.is_built():
        return 0
    nvml_count = getattr(torch.cuda, "_device_count_nvml", None)  # private: the only in-process
    count = nvml_count() if nvml_count else -1                    # count that never initialises
    if count >= 0:
        return count
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True, timeout=120)
    return int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0


def close_process_group() -> None:
    """Destroy this process's group before it exits, as every rank must (a forked one here, one
    torchrun or Slurm started in layerwise.run.fit.train): left to the interpreter's exit, gloo's threads
    were sometimes destroyed still joinable — "terminate called without an active exception", a
    SIGABRT after a completed run that torchrun reports as a failed job (1 of ~8 two-node runs)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _rank_entry(function, rank, world_size, ranks_per_node, port, results, arguments, threads=1,
                parent_pid=None, stop_flag=None):
    if parent_pid is not None:
        die_with_parent(parent_pid)
    # The terminal's Ctrl-C and hang-up reach the whole foreground group; a rank acts only on the
    # launcher's agreed stop (stop_flag) and on a SIGTERM sent to it (preemption.on_stop_signal).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, on_stop_signal)
    STOP.signal, STOP.shared = 0, stop_flag  # a forked rank inherits the launcher's copy
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # what arrived while starting: handled now
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                      RANK=str(rank), LOCAL_RANK=str(rank % ranks_per_node),
                      NODE_RANK=str(rank // ranks_per_node))
    torch.set_num_threads(threads)  # rank_threads: CPU ranks share the cores, GPU ranks get their share
    code = 0
    try:
        results.put((rank, "ok", function(rank, *arguments)))
    except BaseException as error:  # report everything, including KeyboardInterrupt, to the parent
        # An interruption the ranks agreed on (preemption.Interrupted, .Preempted) reaches here
        # as Lightning's sys.exit(1) raised while handling it.
        interrupted = any(isinstance(e, KeyboardInterrupt) for e in (error, error.__context__))
        results.put((rank, "interrupted" if interrupted else "error", traceback.format_exc()))
        code = 1
    finally:
        close_process_group()
        results.close()
        results.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip the parent's atexit handlers (pytest's, Hydra's) in the child


def run_ranks(function, world_size: int, *arguments, timeout: Optional[float] = None,
              method: str = "fork", ranks_per_node: Optional[int] = None, hang_directory=None,
              stop_at_step: bool = False) -> list:
    """Run `function(rank, *arguments)` on `world_size` local ranks; return results by rank.

    method: the start method (`start_method(accelerator)` chooses); with spawn, `function` and
    `arguments` must pickle. ranks_per_node: emulated node size (default: one node).
    timeout: a deadline on the whole call, for bounded work only (calibration, tests). Training
    passes none: a run lasts as long as it trains. A rank that dies is reported at once; a rank
    that hangs alive is caught by the collective timeout (docs/faults.md), never by a wall clock.
    hang_directory: where the ranks' watchdogs write their records and diagnosis (layerwise/run/
    hangs.py); a rank exiting with HUNG_EXIT_CODE raises HangError with that diagnosis. Every rank
    still running (a stopped one too) is killed before this returns or raises.
    stop_at_step: training ranks that read the agreed-stop flag (preemption.StopAtStepBoundary): a
    first SIGINT/SIGTERM/SIGHUP sets it and a second kills them; otherwise (calibration) the first
    kills them at once. Either way RunInterrupted is raised.
    """
    started = time.time()  # older hang files are a previous run's
    context = multiprocessing.get_context(method)
    results = context.Queue()
    port = free_port()
    per_node = ranks_per_node or world_size
    # spawn is GPU ranks' start method (start_method): each gets its share of its node's cores
    threads = rank_threads("gpu" if method == "spawn" else "cpu", per_node)
    stop_flag = context.RawValue("i", 0)  # the first stop signal's number, read by every rank
    processes = [context.Process(target=_rank_entry, daemon=False,
                                 args=(function, rank, world_size, per_node, port, results, arguments, threads,
                                       os.getpid(), stop_flag))
                 for rank in range(world_size)]

    def stop_now(signum):  # a second signal: the user will not wait for the step boundary
        for process in processes:
            if process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)

    # installed before the first fork: a signal between two starts must not orphan the started ranks
    agreed = (lambda signum: setattr(stop_flag, "value", signum)) if stop_at_step else stop_now
    with StopSignals(agreed, stop_now, forced_at_once=not stop_at_step) as signals:
        with blocked(STOP_SIGNALS):  # each rank starts with them blocked: _rank_entry unblocks them
            for process in processes:
                process.start()
        try:
            return _collect(processes, results, world_size, timeout, (hang_directory, started),
                            stopped=lambda: signals.forced)
        except RunInterrupted:
            raise RunInterrupted(signals.received) from None  # 0: a rank's own SIGTERM
        except RankError as error:
            _end(processes)
            if signals.forced:
                raise RunInterrupted(signals.received, forced=True) from None
            error.exit_codes = [process.exitcode for process in processes]  # every rank's, once all ended
            raise
        finally:
            _end(processes)


def _end(processes) -> None:
    """Kill every rank still running (a stopped one too: SIGKILL needs no cooperation) and reap it."""
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join(timeout=10)


def _collect(processes, results, world_size: int, timeout: Optional[float], hangs=(None, 0.0),
             stopped=lambda: False) -> list:
    """Every rank's result by rank; raises for the first that fails (`stopped()`: the launcher killed
    them on a second stop signal, which no diagnosis should report as a failure)."""
    outputs, deadline = {}, None if timeout is None else time.monotonic() + timeout
    while len(outputs) < world_size:
        if deadline is not None and time.monotonic() > deadline:
            raise RankError(min(set(range(world_size)) - set(outputs)), f"no result in {timeout:.0f} s")
        try:
            rank, status, value = results.get(timeout=0.2)
        except queue.Empty:
            if _dead_rank(processes, outputs) is not None:
                if stopped():
                    raise RankError(_dead_rank(processes, outputs), "killed on a second stop signal")
                _raise_hang(processes, *hangs)
                _raise_reported_error(results, processes, outputs)
            continue
        if status == "interrupted":  # every rank agreed on a stop and saved (preemption.Interrupted)
            _let_the_others_report(processes, results, world_size, outputs, rank)
            raise RunInterrupted(0)  # run_ranks names the signal it passed on
        if status != "ok":
            _raise_hang(processes, *hangs)
            _raise_killed(processes, rank, value)
            raise RankError(rank, value)
        outputs[rank] = value
    return [outputs[rank] for rank in range(world_size)]


def _raise_killed(processes, reporting: int, detail: str, settle_s: float = 1.0) -> None:
    """A rank that reported an error because a peer vanished ("Connection reset by peer") is not the
    cause: name the rank a signal killed, if any (its exit code is seen within `settle_s`)."""
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        killed = [rank for rank, process in enumerate(processes) if (process.exitcode or 0) < 0]
        if killed:
            code = processes[killed[0]].exitcode
            paragraph = (f"failure diagnosis: rank {killed[0]} is gone (killed by signal {-code}, "
                         f"{signal.Signals(-code).name}); rank {reporting} then failed: "
                         f"{detail.strip().splitlines()[-1][:200]}")
            print(f"[layerwise] {paragraph}", file=sys.stderr, flush=True)
            raise RankError(killed[0], paragraph)
        time.sleep(0.1)


def _raise_hang(processes, directory, since: float, wait_s: float = 30.0) -> None:
    """HangError with the diagnosis when a rank's watchdog ended it (it exits with HUNG_EXIT_CODE);
    the diagnosing rank writes hang/diagnosis.json before any rank exits (wait_s: margin)."""
    if directory is None:
        return
    path, deadline = Path(directory) / "diagnosis.json", time.monotonic() + wait_s
    # the diagnosing rank kills the stuck one after writing the diagnosis, maybe before it exits itself
    if not fresh(path, since) and not any(process.exitcode == HUNG_EXIT_CODE for process in processes):
        return
    while not fresh(path, since) and time.monotonic() < deadline:
        time.sleep(0.1)
    verdict = read_json(path) if fresh(path, since) else None
    settle = time.monotonic() + 5.0  # the other watchdogs exit within a poll of the diagnosis
    while time.monotonic() < settle and any(process.exitcode is None and process_state(process.pid) == "alive"
                                            for process in processes):
        time.sleep(0.1)
    if verdict is None:
        hung = [rank for rank, process in enumerate(processes) if process.exitcode == HUNG_EXIT_CODE]
        raise HangError(hung[0], f"ranks {hung} timed out in a collective, but no diagnosis was written "
                                 f"to {path} (records in {directory})")
    raise HangError(verdict["stuck_rank"], verdict["paragraph"])


# An interruption every rank agreed on (SIGTERM, Slurm preemption) ends each rank in its own time:
# give the others a moment to finish their on_exception (rank 0 writes the run's files) before the
# launcher kills what is left.
GRACE_SECONDS = 30.0


def _let_the_others_report(processes, results, world_size: int, outputs: dict, first: int) -> None:
    reported, deadline = {first}, time.monotonic() + GRACE_SECONDS
    while len(reported | set(outputs)) < world_size and time.monotonic() < deadline:
        try:
            reported.add(results.get(timeout=0.2)[0])
        except queue.Empty:
            if all(process.exitcode is not None for process in processes):
                return


def _dead_rank(processes, outputs):
    for rank, process in enumerate(processes):
        if rank not in outputs and process.exitcode not in (None, 0):
            return rank
    return None


def _raise_reported_error(results, processes, outputs):
    """A rank died: prefer the traceback it managed to report over its bare exit code."""
    try:
        rank, status, value = results.get(timeout=2.0)
        if status != "ok":
            _raise_killed(processes, rank, value)
            raise RankError(rank, value)
        outputs[rank] = value
        return
    except queue.Empty:
        pass
    rank = _dead_rank(processes, outputs)
    code = processes[rank].exitcode
    if code < 0:
        _raise_killed(processes, rank, f"process killed by signal {-code}", settle_s=0.0)
    reason = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
    raise RankError(rank, f"process {reason} without reporting an error")
