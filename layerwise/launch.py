"""Start the ranks of one run and train in each: forked local processes, or ranks Slurm started.

On a laptop the launching process forks one process per rank (fork is 3-5x faster than Lightning's
own popen/spawn launchers: nothing is re-imported), sets the rendezvous variables in each child,
and waits. If any rank fails, the others are ended at once and the failing rank's traceback is
raised in the parent: a run never hangs on a dead peer and never leaves a stray process.
"""

import os
import queue
import socket
import sys
import traceback

import torch
import torch.multiprocessing as multiprocessing

RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")


class RankError(RuntimeError):
    """A rank raised or died; the message carries its rank and traceback."""

    def __init__(self, rank: int, detail: str):
        self.rank = rank
        self.detail = detail
        super().__init__(f"rank {rank} failed:\n{detail}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launched_externally() -> bool:
    """True under srun/torchrun: the ranks already exist, this process is one of them."""
    return "LOCAL_RANK" in os.environ or "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ


def _rank_entry(function, rank, world_size, port, results, arguments):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                      RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)  # ranks share the cores; more threads per rank only contend
    code = 0
    try:
        results.put((rank, "ok", function(rank, *arguments)))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        results.put((rank, "error", traceback.format_exc()))
        code = 1
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        results.close()
        results.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip the parent's atexit handlers (pytest's, Hydra's) in the child


def run_ranks(function, world_size: int, *arguments, timeout: float = 900.0) -> list:
    """Run `function(rank, *arguments)` on `world_size` forked ranks; return results by rank."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank_entry, daemon=False,
                                 args=(function, rank, world_size, port, results, arguments))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    try:
        return _collect(processes, results, world_size, timeout)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)


def _collect(processes, results, world_size: int, timeout: float) -> list:
    import time
    outputs, deadline = {}, time.monotonic() + timeout
    while len(outputs) < world_size:
        if time.monotonic() > deadline:
            raise RankError(min(set(range(world_size)) - set(outputs)), f"no result in {timeout:.0f} s")
        try:
            rank, status, value = results.get(timeout=0.2)
        except queue.Empty:
            if _dead_rank(processes, outputs) is not None:
                _raise_reported_error(results, processes, outputs)
            continue
        if status == "error":
            raise RankError(rank, value)
        outputs[rank] = value
    return [outputs[rank] for rank in range(world_size)]


def _dead_rank(processes, outputs):
    for rank, process in enumerate(processes):
        if rank not in outputs and process.exitcode not in (None, 0):
            return rank
    return None


def _raise_reported_error(results, processes, outputs):
    """A rank died: prefer the traceback it managed to report over its bare exit code."""
    try:
        rank, status, value = results.get(timeout=2.0)
        if status == "error":
            raise RankError(rank, value)
        outputs[rank] = value
        return
    except queue.Empty:
        pass
    rank = _dead_rank(processes, outputs)
    code = processes[rank].exitcode
    reason = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
    raise RankError(rank, f"process {reason} without reporting an error")
