"""Faults and misuse a user meets on the second day (issue 55): each case runs `python train.py` as a
user would, breaks or misuses it, and asserts on the message, the exit code, what is left on disk and
that no process of the run survives.

Shared helpers come first; each section below is self-contained (later sections append their own).
Every subprocess call has a timeout, so nothing hangs; no assertion is on a duration.
"""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# A tiny 2-rank CPU run (debug=fast-like): steps of a few tens of ms, long enough to be stopped mid-way.
SMALL = ["debug=fast", "strategy=ddp", "trainer.charts=false", "trainer.progress=none",
         "trainer.val_check_interval=1000", "trainer.checkpoint_every_n_steps=1000"]
WAIT_S = 300  # a bound on waiting for a run to reach a state (generous: the machine is shared)


def train_command(run_directory: Path, *overrides: str) -> list:
    return [sys.executable, "train.py", *SMALL, *overrides, f"hydra.run.dir={run_directory}"]


def environment() -> dict:
    return {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}


def start(command: list, log: Path) -> subprocess.Popen:
    """`command` in its own session (a terminal's foreground group of its own: killpg reaches every
    process of it, as Ctrl-C does), stdout and stderr to files (a pipe nobody reads could block it)."""
    return subprocess.Popen(command, cwd=ROOT, env=environment(), start_new_session=True,
                            stdout=open(log.with_suffix(".out"), "w"), stderr=open(log.with_suffix(".err"), "w"))


def run(command: list, timeout: float = WAIT_S) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=timeout)


def finish(process: subprocess.Popen, log: Path, timeout: float = WAIT_S) -> tuple:
    """(exit code, stdout, stderr) once `process` ends."""
    code = process.wait(timeout=timeout)
    return code, log.with_suffix(".out").read_text(), log.with_suffix(".err").read_text()


def metrics_steps(run_directory: Path) -> list:
    path = run_directory / "metrics.csv"
    if not path.exists():
        return []
    with path.open() as handle:
        return [int(row["step"]) for row in csv.DictReader(handle) if row.get("step")]


def wait_for_steps(process: subprocess.Popen, run_directory: Path, steps: int) -> None:
    """Until rank 0 has written `steps` rows of metrics.csv (the run is mid-training)."""
    deadline = time.monotonic() + WAIT_S
    while len(metrics_steps(run_directory)) < steps:
        assert process.poll() is None, f"the run ended early with {process.returncode}"
        assert time.monotonic() < deadline, f"no {steps} steps within {WAIT_S} s"
        time.sleep(0.1)


def process_state(pid: int) -> str:
    """"gone" (no such process, or a zombie: PID 1 here reaps slowly, docs/faults.md), else "alive"."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return "gone" if stat[stat.rindex(")") + 2] in "ZX" else "alive"


def descendants(pid: int) -> set:
    """Every live process below `pid`, from each process's parent in /proc/<pid>/stat."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return {p for p in found if process_state(p) == "alive"}


def rank_pids(run_directory: Path) -> set:
    """The ranks' pids as each wrote them at fit start (processes/rank-<k>.json)."""
    return {json.loads(path.read_text())["pid"] for path in (run_directory / "processes").glob("rank-*.json")}


def survivors(pids: set) -> set:
    """Those of `pids` still running, waited for a moment (an exiting process is still alive briefly)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(process_state(p) == "alive" for p in pids):
        time.sleep(0.1)
    return {p for p in pids if process_state(p) == "alive"}


@pytest.fixture
def reaper():
    """Pids to SIGKILL after the test, whatever it asserted (a failing test leaves no stray rank)."""
    pids = set()
    yield pids
    for pid in pids:
        if process_state(pid) == "alive":
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def summary_of(run_directory: Path) -> dict:
    return json.loads((run_directory / "summary.json").read_text())


def saved_step(run_directory: Path) -> int:
    from strategies.checkpoint.per_rank import read_checkpoint_file
    path = run_directory / "checkpoints" / "last.ckpt"
    return read_checkpoint_file(path / "rank0.pt" if path.is_dir() else path)["global_step"]


# ============================================================ stopping a run: the launcher owns its ranks

STEPS = 60  # a rerun finishes in seconds; the signal comes after 3 rows, far from the end
ENDLESS = 100000  # a run no orphaned rank could finish while a test waits for it to be gone


def started_run(tmp_path: Path, reaper: set, steps: int = STEPS, *overrides: str):
    """A run mid-training (2 ranks): (process, its run directory, its command, its log, its processes)."""
    directory, log = tmp_path / "run", tmp_path / "run.log"
    command = train_command(directory, f"trainer.max_steps={steps}", *overrides)
    process = start(command, log)
    reaper.add(process.pid)
    wait_for_steps(process, directory, 3)
    pids = descendants(process.pid) | rank_pids(directory)
    reaper.update(pids)
    return process, directory, command, log, pids | {process.pid}


def assert_interrupted(code, out, err, directory, command, signum):
    """Exit 128 + signal, one line naming the saved step and the resume command, no traceback, the
    summary and the checkpoint at that step."""
    assert code == 128 + signum, f"exit {code}\n{err[-3000:]}"
    assert "Traceback" not in err + out and "KeyboardInterrupt" not in err + out, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err[-3000:]
    summary = summary_of(directory)
    assert summary["status"] == "interrupted" and summary["signal"] == signal.Signals(signum).name
    step = summary["saved_step"]
    assert 3 <= step < STEPS and saved_step(directory) == step
    assert f"step {step}" in lines[0] and " ".join(command[1:]) in lines[0], lines[0]
    assert metrics_steps(directory) == list(range(1, step + 1))
    return step


def test_sigterm_to_the_parent_saves_at_the_step_stops_every_rank_and_the_rerun_resumes(tmp_path, reaper):
    process, directory, command, log, pids = started_run(tmp_path, reaper)
    process.send_signal(signal.SIGTERM)  # what kill, timeout and schedulers send: to the parent alone
    code, out, err = finish(process, log)
    step = assert_interrupted(code, out, err, directory, command, signal.SIGTERM)
    assert survivors(pids) == set()
    rerun = run(command)  # the same command resumes: every step once in metrics.csv
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming from {directory / 'checkpoints' / 'last.ckpt'}" in rerun.stdout
    assert summary_of(directory)["status"] == "completed"
    assert metrics_steps(directory) == list(range(1, STEPS + 1)), f"interrupted at {step}"


@pytest.mark.parametrize("strategy", ["ddp", "single"])  # 2 forked ranks; the launcher as the only rank
def test_ctrl_c_saves_at_the_step_and_exits_130_in_one_line(tmp_path, reaper, strategy):
    process, directory, command, log, pids = started_run(tmp_path, reaper, STEPS, f"strategy={strategy}")
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground group
    code, out, err = finish(process, log)
    assert_interrupted(code, out, err, directory, command, signal.SIGINT)
    assert survivors(pids) == set()


def test_a_parent_killed_with_sigkill_takes_its_ranks_and_its_stale_lock_is_taken_over(tmp_path, reaper):
    process, directory, command, log, pids = started_run(tmp_path, reaper, ENDLESS)
    assert len(rank_pids(directory)) == 2
    process.kill()  # no handler runs: the ranks must die by themselves (PR_SET_PDEATHSIG)
    process.wait(timeout=WAIT_S)
    assert survivors(pids) == set()
    holder = json.loads((directory / "run.lock").read_text())  # the dead run's record stays
    assert holder["pid"] == process.pid
    rerun = run(train_command(directory, f"trainer.max_steps={STEPS}"))  # no checkpoint yet: starts over
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"pid {process.pid}" in rerun.stdout and "taken over" in rerun.stdout, rerun.stdout[-3000:]
    assert metrics_steps(directory) == list(range(1, STEPS + 1))  # the killed run's rows dropped
    assert (directory / "run.lock").read_text() == ""  # released at the end


def test_a_second_run_on_a_directory_in_use_is_refused_at_once_naming_the_holder(tmp_path, reaper):
    import socket
    process, directory, command, log, pids = started_run(tmp_path, reaper, ENDLESS)
    second = run(command, timeout=120)
    assert second.returncode == 2, second.stderr[-3000:]
    message = second.stderr.strip()
    assert len(message.splitlines()) == 1 and "Traceback" not in message, message
    assert f"pid {process.pid} on host {socket.gethostname()}" in message and "Fix:" in message, message
    assert process.poll() is None  # the first run goes on, untouched
    process.send_signal(signal.SIGTERM)
    code, out, err = finish(process, log)
    assert code == 143, err[-3000:]
    assert survivors(pids) == set()
    assert metrics_steps(directory) == sorted(set(metrics_steps(directory)))


def signal_dispositions(rank: int) -> tuple:
    """What a rank does with the terminal's signals, and which signals it still blocks."""
    return (signal.getsignal(signal.SIGINT) == signal.SIG_IGN, signal.getsignal(signal.SIGHUP) == signal.SIG_IGN,
            set(signal.pthread_sigmask(signal.SIG_BLOCK, [])))


@pytest.mark.parametrize("method", ["fork", "spawn"])  # CPU ranks; GPU ranks (a fresh interpreter)
def test_ranks_ignore_the_terminals_signals_from_their_start(method):
    """A rank ignores SIGINT and SIGHUP (the terminal sends them to the whole group) and blocks none:
    the launcher starts it with them blocked, so a spawned rank's imports cannot take a Ctrl-C."""
    from layerwise.run.launch import run_ranks
    before = signal.getsignal(signal.SIGINT)
    assert run_ranks(signal_dispositions, 2, method=method, timeout=120) == [(True, True, set())] * 2
    assert signal.getsignal(signal.SIGINT) is before and signal.pthread_sigmask(signal.SIG_BLOCK, []) == set()


def test_a_lock_left_by_a_dead_holder_on_another_host_is_taken_over(tmp_path):
    """The kernel's lock decides (fcntl.flock, released when its holder dies, whatever killed it);
    the record in run.lock only names the holder in messages."""
    from layerwise.run.lock import RunDirectoryLocked, hold_run_directory
    (tmp_path / "run.lock").write_text(json.dumps({"pid": 4242, "host": "elsewhere", "started": "earlier"}))
    with hold_run_directory(tmp_path) as stale:
        assert stale["host"] == "elsewhere"
        assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
        held = run([sys.executable, "-c", "from layerwise.run.lock import hold_run_directory as h\n"
                    f"with h({str(tmp_path)!r}): pass"], timeout=120)
        assert "RunDirectoryLocked" in held.stderr and f"pid {os.getpid()}" in held.stderr
    assert (tmp_path / "run.lock").read_text() == ""
    with hold_run_directory(tmp_path) as stale:  # a clean release leaves nothing to take over
        assert stale is None
    assert issubclass(RunDirectoryLocked, RuntimeError)
