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

from tests.ranks import process_parents

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


# pid -> its start time when a helper here first saw it: a pid the kernel has reused since (pid_max is
# 32768 here, and other work starts processes) is another process, and counts as gone
_BIRTHS = {}


def _stat_fields(pid: int):
    """/proc/<pid>/stat's fields after the command name (state first), or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def remember(pids) -> set:
    """`pids`, each one's start time noted (field 22 of /proc/<pid>/stat) the first time it is seen."""
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            _BIRTHS.setdefault(pid, int(fields[19]))
    return set(pids)


def process_state(pid: int) -> str:
    """"gone" (no such process, a zombie: PID 1 here reaps slowly, docs/faults.md, or the pid reused by
    a process started since it was remembered), else "alive"."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in "ZX":
        return "gone"
    return "gone" if _BIRTHS.get(pid, int(fields[19])) != int(fields[19]) else "alive"


def descendants(pid: int) -> set:
    """Every live process below `pid`, from each process's parent in /proc/<pid>/stat."""
    parents = process_parents()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return remember({p for p in found if process_state(p) == "alive"})


def rank_pids(run_directory: Path) -> set:
    """The ranks' pids as each wrote them at fit start (processes/rank-<k>.json)."""
    return remember({json.loads(path.read_text())["pid"] for path in (run_directory / "processes").glob("rank-*.json")})


def survivors(pids: set) -> set:
    """Those of `pids` still running, waited for a moment (an exiting process is still alive briefly)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(process_state(p) == "alive" for p in pids):
        time.sleep(0.1)
    return {p for p in pids if process_state(p) == "alive"}


class Remembered(set):
    """A set of pids whose start times are noted as they are added (see `remember`)."""

    def add(self, pid):
        super().add(pid)
        remember([pid])

    def update(self, *others):
        for pids in others:
            for pid in pids:
                self.add(pid)


def naming(text: str) -> set:
    """Live processes whose command line contains `text` (a test's own directory)."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.add(int(entry.name))
        except OSError:
            continue
    return {pid for pid in found if process_state(pid) == "alive"}


@pytest.fixture
def reaper(tmp_path):
    """Pids to SIGKILL after the test, whatever it asserted (a failing test leaves no stray rank),
    and every process whose command line names the test's directory (a rank orphaned by a parent that
    a subprocess timeout killed); never a process that has since taken a reused pid."""
    pids = Remembered()
    yield pids
    for pid in set(pids) | remember(naming(str(tmp_path))):
        if process_state(pid) == "alive" and pid != os.getpid():
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


def test_a_hang_up_saves_at_the_step_and_exits_129(tmp_path, reaper):
    process, directory, command, log, pids = started_run(tmp_path, reaper)
    process.send_signal(signal.SIGHUP)  # the terminal closed (or `kill -HUP`)
    code, out, err = finish(process, log)
    assert_interrupted(code, out, err, directory, command, signal.SIGHUP)
    assert survivors(pids) == set()


def test_ctrl_c_while_tokenizing_stops_at_once_in_one_line_and_leaves_no_partial_cache(tmp_path, reaper):
    """Before any rank starts (data=text tokenizes in the launcher) there is nothing to save: Ctrl-C
    stops at once, in one line, exit 130, and the cache keeps no half-written entry."""
    from tests.test_text_data import STDLIB, train_tokenizer
    corpus, cache = tmp_path / "text", tmp_path / "cache"
    corpus.mkdir()
    for copy in range(4):  # ~10 MB: seconds of tokenizing
        for source in sorted(STDLIB.glob("*.py"))[:150]:
            (corpus / f"{copy}_{source.stem}.txt").write_text(source.read_text(errors="ignore"))
    directory, log = tmp_path / "run", tmp_path / "run.log"
    command = train_command(directory, "data=text", f"data.path={corpus}", "data.max_bytes=100000000",
                            f"data.tokenizer={train_tokenizer(tmp_path / 'tokenizer')}", f"data.cache_dir={cache}")
    process = start(command, log)
    reaper.add(process.pid)
    deadline = time.monotonic() + WAIT_S
    while not any(".partial" in path.name for path in cache.glob("*")):
        assert process.poll() is None and time.monotonic() < deadline, "tokenizing never started"
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGINT)
    code, out, err = finish(process, log)
    assert code == 130 and "Traceback" not in err + out, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "interrupted by SIGINT: stopped at once" in lines[0], err[-3000:]
    assert " ".join(command[1:]) in lines[0]
    assert not any(".partial" in path.name for path in cache.glob("*"))
    assert summary_of(directory)["status"] == "interrupted" and survivors({process.pid}) == set()


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


def sleep_after_saying(rank: int, directory: str) -> None:
    (Path(directory) / f"rank-{rank}").touch()
    time.sleep(WAIT_S)


def test_ranks_that_do_not_train_are_stopped_at_once(tmp_path):
    """Outside training (calibration) no rank reads the agreed-stop flag: the first Ctrl-C kills the
    ranks at once and run_ranks raises RunInterrupted, not a failure."""
    import threading
    from layerwise.run.launch import RunInterrupted, run_ranks

    def interrupt_when_started():
        deadline = time.monotonic() + WAIT_S
        while len(list(tmp_path.glob("rank-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # to this process: run_ranks' handler is installed by now
    threading.Thread(target=interrupt_when_started, daemon=True).start()
    with pytest.raises(RunInterrupted) as stopped:
        run_ranks(sleep_after_saying, 2, str(tmp_path), timeout=WAIT_S)
    assert stopped.value.forced and stopped.value.exit_code == 130


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


# ============================================================ run-time errors: one paragraph, an exit code by kind
# (issue 55, items 3 and 7, and item 8's summary after a SIGKILLed rank; docs/faults.md "Exit codes")

PIPELINE = ["debug=fast", "strategy=modular_pipeline", "trainer.charts=false", "trainer.progress=none"]


def assert_one_paragraph(result, code: int, directory: Path, kind: str, *phrases: str) -> str:
    """The run ended with `code`, its stderr's last line is the paragraph (no traceback on the
    console), train.log holds the traceback, and summary.json holds the paragraph and its kind."""
    assert result.returncode == code, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "HYDRA_FULL_ERROR" not in result.stderr, result.stderr[-3000:]
    paragraph = result.stderr.strip().splitlines()[-1]
    assert paragraph.startswith("layerwise: the run stopped") and f"exit code {code}" in paragraph, paragraph
    for phrase in phrases:
        assert phrase in paragraph, (phrase, paragraph)
    assert "Traceback (most recent call last):" in (directory / "train.log").read_text()
    summary = summary_of(directory)
    assert summary["status"] == "failed" and summary["error"] == paragraph.removeprefix("layerwise: ")
    assert summary["failure_kind"] == kind and summary["exit_code"] == code
    return paragraph


def test_a_data_error_at_run_time_is_one_paragraph_with_exit_3(tmp_path):
    """A corpus too short for data.sequence_length passes validation (it checks the files exist)
    and fails when the first batch is cut: before, a 20-line Hydra traceback and exit 1."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello world " * 8)  # 96 bytes: 5 of them held out for validation
    directory = tmp_path / "run"
    result = run([sys.executable, "train.py", "debug=fast", "strategy=single", "data=text_files",
                  f"data.path={corpus}", f"hydra.run.dir={directory}"])
    assert_one_paragraph(result, 3, directory, "data", "data error (rank 0, before the first step)",
                         "data.sequence_length: 32 needs at least 33 tokens")
    assert summary_of(directory)["failed_rank"] == 0


def test_a_nonfinite_loss_is_one_paragraph_with_exit_5(tmp_path):
    """optimizer.lr=1e30: step 1's update makes step 2's loss NaN (faults.NonFiniteGuard stops it)."""
    directory = tmp_path / "run"
    result = run([sys.executable, "train.py", "debug=fast", "strategy=single", "optimizer.lr=1e30",
                  f"hydra.run.dir={directory}"])
    assert_one_paragraph(result, 5, directory, "non-finite loss", "(rank 0, after step 1)",
                         "non-finite training loss (nan) at step 2", "Fix: lower optimizer.lr")


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory) -> Path:
    """A 2-rank modular_pipeline run with per-rank and portable checkpoints: last (step 6) and
    previous (step 3) of each; tests damage copies of it."""
    directory = tmp_path_factory.mktemp("source") / "run"
    result = run([sys.executable, "train.py", *PIPELINE, "trainer.max_steps=6",
                  "trainer.checkpoint_every_n_steps=3", f"hydra.run.dir={directory}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert (directory / "checkpoints" / "last" / "__1_0.distcp").is_file()
    return directory


def damaged_copy(source: Path, tmp_path: Path) -> Path:
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    return copy


def test_both_per_rank_checkpoints_damaged_offer_the_intact_portable_copy_and_it_resumes(pipeline_run, tmp_path):
    """last.ckpt's rank 1 file and previous.ckpt's rank 0 file truncated: no per-rank checkpoint is
    readable; the portable last/ beside them is intact and the paragraph offers it (exit 4). Before:
    `CheckpointError: no readable checkpoint ... Fix: delete the damaged checkpoint ...` in a Hydra
    traceback, exit 1, no word of the portable copy. The command it offers then resumes at step 6."""
    directory = damaged_copy(pipeline_run, tmp_path)
    for name in ("last.ckpt/rank1.pt", "previous.ckpt/rank0.pt"):
        os.truncate(directory / "checkpoints" / name, 1000)
    command = [sys.executable, "train.py", *PIPELINE, "trainer.max_steps=8", f"hydra.run.dir={directory}"]
    failed = run(command)
    portable = directory / "checkpoints" / "last"
    paragraph = assert_one_paragraph(failed, 4, directory, "checkpoint", "checkpoint error (rank ",
                                     "no readable checkpoint at", f"resume=false resume_from={portable}")
    assert "rank1.pt is unreadable" in paragraph or "rank0.pt is unreadable" in paragraph, paragraph
    resumed = run(command + ["resume=false", f"resume_from={portable}"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {portable}" in resumed.stdout
    assert summary_of(directory)["status"] == "completed" and summary_of(directory)["steps"] == 8


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_a_damaged_portable_shard_is_named_before_any_rank_starts(pipeline_run, tmp_path, damage):
    """resume_from= a portable checkpoint missing `__1_0.distcp`, or with it cut to half: refused at
    validation (exit 2, nothing started), naming the file and offering the intact previous/ and the
    per-rank copy. Before: the ranks started and DCP raised `CheckpointException ranks:dict_keys([1])
    ... FileNotFoundError: ... __1_0.distcp` through an 89-line traceback, exit 1."""
    source = damaged_copy(pipeline_run, tmp_path)
    shard = source / "checkpoints" / "last" / "__1_0.distcp"
    if damage == "deleted":
        shard.unlink()
    else:
        os.truncate(shard, shard.stat().st_size // 2)
    directory = tmp_path / "run"
    result = run([sys.executable, "train.py", *PIPELINE, "trainer.max_steps=8",
                  f"resume_from={source / 'checkpoints' / 'last'}", f"hydra.run.dir={directory}"])
    assert result.returncode == 2, result.stderr[-3000:]
    message = result.stderr
    assert "Traceback" not in message and "CheckpointException" not in message, message[-3000:]
    assert f"{shard} is {'missing' if damage == 'deleted' else 'truncated'}" in message, message
    assert f"resume_from={source / 'checkpoints' / 'previous'}" in message
    assert str(source / "checkpoints" / "last.ckpt") in message and "Fix:" in message
    assert not (directory / "processes").exists()  # no rank started


def test_a_damaged_portable_shard_found_at_load_is_named_too(pipeline_run, tmp_path):
    """The same check where the load reads (a shard lost after validation): CheckpointError naming
    the file and the fix, raised before DCP's collectives, instead of DCP's CheckpointException."""
    from strategies.checkpoint.per_rank import CheckpointError
    from strategies.checkpoint.portable import load_portable
    source = damaged_copy(pipeline_run, tmp_path)
    (source / "checkpoints" / "last" / "__1_0.distcp").unlink()

    class Strategy:  # load_portable reads the sidecar first, then checks the files before building views
        lightning_module = optimizers = None

    with pytest.raises(CheckpointError, match=r"__1_0.distcp is missing.*Fix: resume from the portable checkpoint"):
        load_portable(Strategy(), source / "checkpoints" / "last")


def test_a_sigkilled_rank_is_named_in_the_summary_and_the_exit_code(tmp_path, reaper):
    """SIGKILL to rank 1 mid-run: the paragraph, summary.json's `error` and `failed_rank` name rank 1
    (before: summary.json held rank 0's gloo text, "Connection reset by peer", and failed_rank null,
    while the console named rank 1), exit 6, no rank left."""
    directory = tmp_path / "run"
    log = tmp_path / "run-log"
    process = start([sys.executable, "train.py", *PIPELINE, "trainer.max_steps=200",
                     "trainer.val_check_interval=1000", "trainer.checkpoint_every_n_steps=2",
                     f"hydra.run.dir={directory}"], log)
    reaper.add(process.pid)
    wait_for_steps(process, directory, 3)
    pids = rank_pids(directory)
    reaper.update(pids)
    rank_one = json.loads((directory / "processes" / "rank-1.json").read_text())["pid"]
    os.kill(rank_one, signal.SIGKILL)
    code, out, err = finish(process, log)
    result = subprocess.CompletedProcess(process.args, code, out, err)
    paragraph = assert_one_paragraph(result, 6, directory, "rank", "a rank failed (rank 1, after step",
                                     "rank 1 is gone (killed by signal 9, SIGKILL)", "it resumes from")
    assert summary_of(directory)["failed_rank"] == 1 and "rank 1 is gone" in summary_of(directory)["error"]
    assert survivors(pids) == set(), paragraph


# ============================================================ bad text, a mismatched tokenizer, the export
# (issue 55, items 4, 5 and 6; docs/hf.md "Text checked as it is read", docs/reliability.md)

TEXT_RUN = ["debug=fast", "strategy=single", "trainer.charts=false", "trainer.progress=none", "data=text"]


@pytest.fixture(scope="module")
def dirty_text(tmp_path_factory) -> dict:
    """A text corpus holding the ls program saved as ls.txt and a Latin-1 file, and a BPE tokenizer."""
    import sysconfig
    from tests.test_text_data import train_tokenizer
    root = tmp_path_factory.mktemp("dirty")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = root / "corpus"
    corpus.mkdir()
    for name in ("textwrap.py", "shlex.py", "string.py"):
        (corpus / f"{name}.txt").write_text((stdlib / name).read_text())
    (corpus / "ls.txt").write_bytes(Path("/bin/ls").read_bytes())
    (corpus / "latin.txt").write_bytes(("Café crème, señor: naïve façade. " * 60).encode("latin-1"))
    return {"corpus": corpus, "tokenizer": train_tokenizer(root / "tokenizer"), "cache": root / "cache"}


def text_run(dirty: dict, directory: Path, *overrides: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "train.py", *TEXT_RUN, f"data.path={dirty['corpus']}",
                f"data.tokenizer={dirty['tokenizer']}", f"data.cache_dir={dirty['cache']}", *overrides,
                f"hydra.run.dir={directory}"])


@pytest.fixture(scope="module")
def utf8_run(dirty_text, tmp_path_factory) -> tuple:
    """(result, run directory) of one run on the dirty corpus under the default data.encoding=utf-8."""
    directory = tmp_path_factory.mktemp("utf8") / "run"
    return text_run(dirty_text, directory), directory


def test_a_binary_and_a_latin_1_file_are_skipped_and_counted_and_latin_1_reads_with_data_encoding(
        dirty_text, utf8_run, tmp_path):
    """Before: ls became 222 k of 229 k training tokens and the Latin-1 file U+FFFD, with no word."""
    result, _ = utf8_run
    assert result.returncode == 0, result.stderr[-3000:]
    assert "skipped 1 binary file (ls.txt), 1 undecodable as utf-8 (latin.txt)" in result.stdout, result.stdout[-3000:]
    assert sum("tokenizing: file" in line for line in result.stdout.splitlines()) <= 2  # not a line per file
    result = text_run(dirty_text, tmp_path / "latin", "data.encoding=latin-1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "skipped 1 binary file (ls.txt), 0 undecodable as latin-1" in result.stdout, result.stdout[-3000:]
    metas = [json.loads(path.read_text()) for path in dirty_text["cache"].glob("*/meta.json")]
    assert sorted(meta["encoding"] for meta in metas) == ["latin-1", "utf-8"] and all(meta["files"] in (3, 4) for meta in metas)
    assert not [path for path in dirty_text["cache"].iterdir() if ".partial" in path.name]


def test_a_tokenizer_larger_than_the_model_is_refused_before_launch_naming_the_three_numbers(dirty_text, tmp_path):
    """Before: every check passed, the ranks started, and an 80-line traceback ended in
    `IndexError: index out of range in self` (a device-side assert on a GPU)."""
    directory = tmp_path / "run"
    result = text_run(dirty_text, directory, "model.vocab_size=256")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith("layerwise: invalid configuration (1 problem):"), result.stderr[-3000:]
    assert "gives token ids 0..299 (EOS 0" in result.stderr and "model.vocab_size=256" in result.stderr
    assert "Fix: model.vocab_size=300" in result.stderr and "Traceback" not in result.stderr
    assert not (directory / "processes").exists() and not (directory / "checkpoints").exists()


def test_the_hf_export_of_a_text_run_carries_its_eos_a_generation_config_and_umask_modes(utf8_run, tmp_path):
    """Before: config.json had no bos/eos ids (transformers fell back to 50256), no
    generation_config.json, model.safetensors mode 0600."""
    import stat
    result, directory = utf8_run
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "hf"
    result = subprocess.run(["sh", "-c", f"umask 022 && {sys.executable} -m layerwise.export {directory} --format hf "
                             f"--out {out}"], cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=WAIT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == 0 and json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 0
    assert {oct(stat.S_IMODE(path.stat().st_mode)) for path in out.iterdir()} == {oct(0o644)}
    assert (out / "tokenizer.json").is_file()


def test_the_kind_is_read_from_a_rank_s_traceback_text():
    """A local rank's exception reaches the launcher as text: its last section's exception decides,
    not a traceback nested in a message (DCP's "(RANK 1)"), nor a chained cause."""
    from layerwise.run.faults import EXIT_CODES, describe_failure, kind_of, last_exception
    from layerwise.run.launch import RankError
    nested = ("Traceback (most recent call last):\n  File \"a.py\", line 1, in f\n    g()\nValueError: first\n\n"
              "The above exception was the direct cause of the following exception:\n\n"
              "Traceback (most recent call last):\n  File \"b.py\", line 2, in h\n    raise X\n"
              "strategies.checkpoint.per_rank.CheckpointError: the portable checkpoint p is damaged\n"
              "Traceback (most recent call last): (RANK 1)\n  File \"c.py\", line 3\nFileNotFoundError: x\n")
    assert last_exception(nested)[0] == "CheckpointError"
    assert kind_of("ValueError", "data.path: /x does not exist") == "data"
    assert kind_of("OSError", "[Errno 28] No space left on device") == "checkpoint"
    assert kind_of("RuntimeError", "data.path looks like a field, but RuntimeError is not ours") == "unknown"
    failure = describe_failure(RankError(1, nested), "/run", steps=4)
    assert failure.kind == "checkpoint" and failure.rank == 1 and failure.code == EXIT_CODES["checkpoint"] == 4
    assert failure.paragraph.startswith("the run stopped on a checkpoint error (rank 1, after step 4): the portable")
    assert "\n" not in failure.paragraph and "Full traceback: /run/train.log" in failure.paragraph
    assert "RANK 1" not in failure.paragraph  # the nested traceback stays in train.log


def test_a_sweep_runs_its_points_and_ends_with_the_first_failed_point_s_paragraph_and_code(tmp_path):
    """In a sweep (-m) a failed point does not stop the others; Hydra names its overrides, then the
    paragraph, and the command exits with that point's code."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello world " * 8)
    result = run([sys.executable, "train.py", "-m", "debug=fast", "strategy=single", "data=text_files",
                  f"data.path={corpus}", "data.sequence_length=32,40", f"hydra.sweep.dir={tmp_path}/sweep"])
    assert result.returncode == 3, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "Error executing job with overrides" in result.stderr
    assert "data.sequence_length: 32 needs at least 33 tokens" in result.stderr.strip().splitlines()[-1]
    assert len(list((tmp_path / "sweep").rglob("summary.json"))) == 2  # both points ran


def test_a_hang_and_a_dead_rank_get_their_own_codes_and_a_full_disk_keeps_the_traceback(tmp_path):
    """124 for a hang (as every hung rank already exits), 6 for a rank that died without a word;
    when the run directory cannot be written, the traceback goes to the console instead."""
    from layerwise.run.faults import describe_failure, report_failure
    from layerwise.run.launch import HangError, RankError
    from omegaconf import OmegaConf
    hung = describe_failure(HangError(2, "Hang diagnosis at step 3: rank 2 stopped progressing."), tmp_path, 3)
    assert hung.code == 124 and hung.rank == 2 and "(rank 2, after step 3): Hang diagnosis" in hung.paragraph
    dead = describe_failure(RankError(1, "process exited with code 9 without reporting an error"), tmp_path)
    assert dead.code == 6 and "Nothing was checkpointed yet" in dead.paragraph
    cfg = OmegaConf.create({name: {"name": name} for name in ("strategy", "model", "hardware", "data")})
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the run directory should be: every write fails
    failure = report_failure(OSError(28, "No space left on device"), blocked / "run", 0.0, cfg, 1)
    assert failure.code == 4 and failure.traceback_on_console and "could not be written" in failure.paragraph
