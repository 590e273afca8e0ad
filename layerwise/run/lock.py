"""One run per run directory: `run.lock`, held with fcntl.flock for the run's life.

Two runs writing one directory corrupt it (issue 55: the orphaned ranks of a SIGTERMed run and its
rerun swapped each other's `last.ckpt` away and wrote metrics.csv rows twice), so a run holds an
exclusive, non-blocking flock on `<run directory>/run.lock` from before its ranks start until they
have all ended. The kernel decides who holds it and releases it when the holder dies, whatever killed
it (SIGKILL, OOM): a lock is stale exactly when no live process holds the flock, so a dead holder's
lock is taken over without guessing from pids (which are reused) or hosts. Forked ranks share the
parent's open file, so the lock stays held while any rank of the run lives.

The file's content is only a record for messages: the holder's pid, host, start time and command,
written after the flock is taken and emptied on a clean release. A record found non-empty when the
flock is free names a run that ended without releasing it; it is reported and taken over.

Limit: across nodes this is as good as the file system's flock. NFSv4, GPFS and Lustre mounted with
`flock` keep it across nodes; Lustre with `localflock` (or NFSv3 without lockd) keeps it per node
only, so two nodes are not kept apart there (docs/faults.md, "One run per directory").
"""

import contextlib
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path

LOCK_NAME = "run.lock"
_HELD = {}  # resolved lock path -> file descriptor, while this process holds it (re-entrant)


class RunDirectoryLocked(RuntimeError):
    """Another live run holds the run directory; the message names its pid and host and the fix."""


def lock_path(run_directory) -> Path:
    return Path(run_directory) / LOCK_NAME


def read_holder(path: Path):
    """The record in a lock file, or None when it is empty or unreadable (being written)."""
    try:
        return json.loads(path.read_text() or "null")
    except (OSError, ValueError):
        return None


def own_record() -> dict:
    command = getattr(sys, "orig_argv", sys.argv)
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": shlex.join(command)}


def refusal(run_directory, holder) -> str:
    """The one paragraph a second run gets."""
    if holder is None:
        who = "another process (its record in run.lock is not written yet)"
        stop = "wait for it to end"
    else:
        who = (f"pid {holder['pid']} on host {holder['host']} (started {holder.get('started', '?')}: "
               f"{holder.get('command', '?')})")
        stop = (f"wait for that run to end, or stop it with kill {holder['pid']} (it saves at the next "
                f"step and exits; rerunning its command then resumes it)"
                if holder["host"] == socket.gethostname() else "wait for that run to end")
    return (f"run directory {run_directory} is in use by another run: {who}. Two runs writing one "
            f"directory would overwrite each other's checkpoint and metrics, so this one starts nothing. "
            f"Fix: {stop}; or give this run its own directory with run_name=<name> or hydra.run.dir=<dir>.")


def _take(path: Path) -> int:
    """The file descriptor of `path` with our exclusive flock on it, or RunDirectoryLocked."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise RunDirectoryLocked(refusal(path.parent, read_holder(path))) from None
    return descriptor


def check_run_directory_free(run_directory) -> None:
    """Refuse at once if a live run holds `run_directory` (before this run writes anything into it);
    the lock itself is taken by `hold_run_directory`."""
    path = lock_path(run_directory)
    if str(path.resolve()) in _HELD or not path.exists():
        return
    descriptor = _take(path)
    fcntl.flock(descriptor, fcntl.LOCK_UN)
    os.close(descriptor)


@contextlib.contextmanager
def hold_run_directory(run_directory):
    """Hold `run_directory`'s lock within; yields the record of a dead holder whose lock was taken
    over (None when the last holder released it cleanly, or none existed). Re-entrant in one process."""
    path = lock_path(run_directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = str(path.resolve())
    if key in _HELD:
        yield None
        return
    descriptor = _take(path)
    stale = read_holder(path)
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, json.dumps(own_record()).encode(), 0)
    _HELD[key] = descriptor
    try:
        yield stale
    finally:
        del _HELD[key]
        os.ftruncate(descriptor, 0)  # a clean release: nothing for the next run to take over
        fcntl.flock(descriptor, fcntl.LOCK_UN)
        os.close(descriptor)


def taken_over_line(stale: dict) -> str:
    return (f"run directory lock taken over: the run that held it (pid {stale.get('pid')} on host "
            f"{stale.get('host')}, started {stale.get('started', '?')}) ended without releasing it")
