"""Start the ranks of one run and train in each: local processes, or ranks Slurm/torchrun started.

On a laptop the launching process starts one process per rank, sets the rendezvous variables in
each child, and waits. If any rank fails, the others are ended at once and the failing rank's
traceback is raised in the parent: a run never hangs on a dead peer and never leaves a stray process.

Start method: CPU ranks are forked (3-5x faster than spawn or Lightning's popen launcher: nothing
is re-imported). GPU ranks are spawned: a forked child cannot use CUDA if the parent initialised
it, and spawn makes that impossible whatever the parent imported. The parent itself never
initialises CUDA either (docs/architecture.md, departure 2): it counts GPUs with NVML only (`local_gpu_count`).

Several nodes on one machine (`hardware.nodes` > 1 without Slurm or torchrun) are emulated: rank r
gets LOCAL_RANK = r mod devices_per_node and NODE_RANK = r div devices_per_node, as a cluster
would give it.
"""

import os
import queue
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

import torch
import torch.multiprocessing as multiprocessing

from layerwise.config.machine import rank_threads
from layerwise.run.hangs import HUNG_EXIT_CODE, fresh, process_state, read_json

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


def _rank_entry(function, rank, world_size, ranks_per_node, port, results, arguments, threads=1):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                      RANK=str(rank), LOCAL_RANK=str(rank % ranks_per_node),
                      NODE_RANK=str(rank // ranks_per_node))
    torch.set_num_threads(threads)  # rank_threads: CPU ranks share the cores, GPU ranks get their share
    code = 0
    try:
        results.put((rank, "ok", function(rank, *arguments)))
    except BaseException as error:  # report everything, including KeyboardInterrupt, to the parent
        # An interruption the ranks agreed on (faults.Terminated, slurm.Preempted) reaches here
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
              method: str = "fork", ranks_per_node: Optional[int] = None, hang_directory=None) -> list:
    """Run `function(rank, *arguments)` on `world_size` local ranks; return results by rank.

    method: the start method (`start_method(accelerator)` chooses); with spawn, `function` and
    `arguments` must pickle. ranks_per_node: emulated node size (default: one node).
    timeout: a deadline on the whole call, for bounded work only (calibration, tests). Training
    passes none: a run lasts as long as it trains. A rank that dies is reported at once; a rank
    that hangs alive is caught by the collective timeout (docs/faults.md), never by a wall clock.
    hang_directory: where the ranks' watchdogs write their records and diagnosis (layerwise/run/
    hangs.py); a rank exiting with HUNG_EXIT_CODE raises HangError with that diagnosis. Every rank
    still running (a stopped one too) is killed before this returns or raises.
    """
    started = time.time()  # older hang files are a previous run's
    context = multiprocessing.get_context(method)
    results = context.Queue()
    port = free_port()
    per_node = ranks_per_node or world_size
    # spawn is GPU ranks' start method (start_method): each gets its share of its node's cores
    threads = rank_threads("gpu" if method == "spawn" else "cpu", per_node)
    processes = [context.Process(target=_rank_entry, daemon=False,
                                 args=(function, rank, world_size, per_node, port, results, arguments, threads))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    try:
        return _collect(processes, results, world_size, timeout, (hang_directory, started))
    except RankError as error:
        _end(processes)
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


def _collect(processes, results, world_size: int, timeout: Optional[float], hangs=(None, 0.0)) -> list:
    outputs, deadline = {}, None if timeout is None else time.monotonic() + timeout
    while len(outputs) < world_size:
        if deadline is not None and time.monotonic() > deadline:
            raise RankError(min(set(range(world_size)) - set(outputs)), f"no result in {timeout:.0f} s")
        try:
            rank, status, value = results.get(timeout=0.2)
        except queue.Empty:
            if _dead_rank(processes, outputs) is not None:
                _raise_hang(processes, *hangs)
                _raise_reported_error(results, processes, outputs)
            continue
        if status == "interrupted":
            _let_the_others_report(processes, results, world_size, outputs, rank)
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
