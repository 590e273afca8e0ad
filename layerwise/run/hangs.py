"""A hang names its rank: a watchdog thread per rank over the flight record, one diagnosis, stragglers.

Each rank records every operation it issues and what it waits in (parallel/flight.py). Then:

1. watchdog: a thread, independent of the backend's own timeout, reads the rank's current wait
   every `poll_s`; one longer than `trainer.collective_timeout_s` (× `long_timeout_factor` in the
   first step, validation and checkpoints) writes `hang/rank-<k>.json` — the last operations, the
   wait, the Python stack of every thread (faulthandler) — and asks the other ranks for theirs
   (`hang/request`: each watchdog answers within one poll, whatever its main thread is doing).
   Every process group's own timeout is longer than all of this (`TimeoutChain`): the backend never
   aborts a rank before the diagnosis is written;
2. diagnosis: the lowest rank with a record, once every rank answered or is known stopped or gone
   (/proc/<pid>/stat on its host), follows "waits for" from the rank that blocked first: a wait in
   collective #n over a group waits for the members that issued fewer than n there, a receive #n
   from p for p while p has sent fewer than n; the chain ends at the stuck rank (no record, or a
   cycle: the rank that skipped an operation and went on). It prints one paragraph, writes
   `hang/diagnosis.json` and `summary.json` ("status": "hung"), kills stuck processes on its host;
3. every rank with a watchdog exits with HUNG_EXIT_CODE; the launcher kills what is left
   (layerwise/run/launch.py). Nothing was written since the last checkpoint: a rerun resumes.

Stragglers: each rank's compute time of a step (step time minus the time blocked in waits) travels
in the step's evidence exchange; a rank above STRAGGLER_RATIO × the median for
`trainer.straggler_window` consecutive steps is flagged (a line, metrics.csv `stragglers`,
summary.json `stragglers` with rank and node).
"""

import faulthandler
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Optional

import lightning.pytorch as pl

from parallel.flight import COLLECTIVE, FlightRecorder, marks_for
from layerwise.run.timeouts import TimeoutChain, collective_timeout_s, run_timeout_chain
from parallel.timing import StepTimer

HUNG_EXIT_CODE = 124  # as coreutils' `timeout`: every rank of a hung run exits with it
STRAGGLER_RATIO = 1.5  # a rank slower than this × the median compute time is a straggler
RING_SIZE = 64  # operations kept per rank
REPOSITORY = str(Path(__file__).resolve().parents[2])


def hang_directory(run_directory) -> Path:
    return Path(run_directory) / "hang"


def write_json(path: Path, payload: dict) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(temporary, path)


def read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


# ============================================================================ process state

def process_state(pid: Optional[int], host: Optional[str] = None) -> str:
    """"alive", "stopped", "gone" or "unknown" (another host), from /proc/<pid>/stat's state."""
    if pid is None:
        return "unknown"
    if host is not None and host != socket.gethostname():
        return "unknown"
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    state = stat[stat.rindex(")") + 2]
    return {"T": "stopped", "t": "stopped", "Z": "gone", "X": "gone"}.get(state, "alive")


def describe_state(state: str, exit_code: Optional[int] = None) -> str:
    if exit_code is not None and exit_code < 0:
        return f"gone (killed by signal {-exit_code}, {signal.Signals(-exit_code).name})"
    if exit_code is not None and exit_code not in (0, HUNG_EXIT_CODE):
        return f"gone (exited with code {exit_code})"
    return {"stopped": "stopped (SIGSTOP: /proc state T)", "gone": "gone",
            "alive": "alive", "unknown": "on another node (not checked)"}.get(state, state)


# ============================================================================ diagnosis

def describe_operation(operation: Optional[dict]) -> str:
    if operation is None:
        return "nothing"
    if operation["peer"] is not None:
        direction = "to" if operation["kind"] == "send" else "from"
        what = f"{operation['kind']} {direction} rank {operation['peer']} #{operation['sequence']}"
    else:
        ranks = operation["ranks"]
        members = f"ranks {ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) and \
            len(ranks) > 2 else "ranks " + ", ".join(map(str, ranks))
        what = f"{operation['kind']} #{operation['sequence']} over the {operation['group']} group ({members})"
    where = [f"step {operation['step']}"] + ([f"action {operation['action']}"] if operation.get("action") else [])
    if operation.get("in_flight"):  # e.g. torch DDP's reducer waits on its future, not through the record
        where.append("in flight, not waited on through the record")
    return f"{what} ({', '.join(where)})"


def _issued(record: dict, key: tuple) -> int:
    for entry in record["issued_by_group"]:
        collective = entry["kind"] == COLLECTIVE
        if ((COLLECTIVE, tuple(entry["ranks"])) if collective else (entry["kind"], entry["peer"])) == key:
            return entry["issued"]
    return 0


def waits_for(rank: int, record: dict, records: dict) -> list:
    """The ranks this rank's current wait needs to act: members behind in its group, or its peer."""
    operation = record.get("waiting")
    if operation is None:
        return []
    if operation["peer"] is not None:
        peer = operation["peer"]
        matching = "send" if operation["kind"] == "receive" else "receive"
        behind = peer not in records or _issued(records[peer], (matching, rank)) < operation["sequence"]
        return [peer] if behind else []
    key = (COLLECTIVE, tuple(operation["ranks"]))
    return [member for member in operation["ranks"] if member != rank
            and (member not in records or _issued(records[member], key) < operation["sequence"])]


def _wait_started(record: dict) -> float:
    return record["time"] - record["waiting"]["waited_s"]


def _last_completed_time(record: Optional[dict]) -> float:
    if record is None or record.get("last_completed") is None:
        return float("-inf")
    return record["last_completed"]["completed"] or float("-inf")


def find_stuck(records: dict, world_size: int, known: Optional[int] = None) -> tuple:
    """(the stuck rank, the chain of ranks followed to it, whether the chain closed in a cycle)."""
    if known is not None:
        return known, [known], False
    waiting = {rank: record for rank, record in records.items() if record.get("waiting")}
    if not waiting:  # nobody waits: the rank without a record, or the oldest last completion
        silent = [rank for rank in range(world_size) if rank not in records]
        stuck = silent[0] if silent else min(records, key=lambda r: _last_completed_time(records[r]))
        return stuck, [stuck], False
    current = min(waiting, key=lambda rank: _wait_started(waiting[rank]))
    chain = [current]
    while True:
        targets = waits_for(current, records[current], records) if current in records else []
        if not targets:
            return current, chain, False
        # the rank without a record first (it cannot answer), then the oldest last completion
        following = min(targets, key=lambda r: (r in records, _last_completed_time(records.get(r))))
        if following in chain:
            return current, chain, True
        chain.append(following)
        current = following


def diagnose(records: dict, world_size: int, states: dict, exit_codes: Optional[dict] = None,
             known: Optional[int] = None, checkpoint: str = "") -> dict:
    """One paragraph naming the stuck rank and what every other rank waits in, and its facts.

    records: rank -> its hang record; states: rank -> process_state; exit_codes: rank -> exit code
    where a launcher knows it; known: a rank the launcher saw die."""
    exit_codes = exit_codes or {}
    stuck, chain, cycle = find_stuck(records, world_size, known)
    state = describe_state(states.get(stuck, "unknown"), exit_codes.get(stuck))
    record = records.get(stuck)
    step = max((r["step"] for r in records.values()), default=None)
    sentences = [f"hang diagnosis{f' at step {step}' if step else ''}: rank {stuck} stopped progressing "
                 f"(the others wait for it); its process is {state}"]
    if record is None:
        sentences[0] += " and wrote no record (its watchdog could not run)"
    else:
        sentences[0] += (f"; it waits in {describe_operation(record['waiting'])}" if record.get("waiting")
                         else "; it waits in no recorded operation")
        sentences[0] += f", its last completed operation was {describe_operation(record.get('last_completed'))}"
    oldest = min(range(world_size), key=lambda r: (r in records, _last_completed_time(records.get(r))))
    if oldest == stuck and record is not None:
        sentences[0] += ", the oldest of all ranks"
    if record is not None and len(chain) > 1:  # it has a record, yet its peer waits for it: behind
        waiter = chain[chain.index(stuck) - 1] if chain.index(stuck) else chain[-1]
        sentences.append(f"rank {stuck} never issued {describe_operation(records[waiter]['waiting'])} that "
                         f"rank {waiter} waits in, and went on: it skipped or mismatched an operation")
    if record is not None and not record.get("waiting") and record.get("main_thread"):
        sentences[0] += f"; its main thread is in {record['main_thread']}"
    others = []
    for rank in range(world_size):
        if rank == stuck:
            continue
        other = records.get(rank)
        if other is None:
            others.append(f"rank {rank} wrote no record (its process is "
                          f"{describe_state(states.get(rank, 'unknown'), exit_codes.get(rank))})")
        elif other.get("waiting"):
            others.append(f"rank {rank} waits in {describe_operation(other['waiting'])} "
                          f"for {other['waiting']['waited_s']:.1f} s")
        else:
            where = f"main thread in {other['main_thread']}; " if other.get("main_thread") else ""
            others.append(f"rank {rank} waits in no recorded operation "
                          f"({where}last completed: {describe_operation(other.get('last_completed'))})")
    if others:
        sentences.append("; ".join(others))
    sentences.append("every rank exits non-zero and no process is left running" +
                     (f"; {checkpoint}" if checkpoint else ""))
    paragraph = ". ".join(sentence[0].upper() + sentence[1:] for sentence in sentences) + "."
    return {"stuck_rank": stuck, "chain": chain, "cycle": cycle, "step": step,
            "states": {str(rank): describe_state(states.get(rank, "unknown"), exit_codes.get(rank))
                       for rank in range(world_size)},
            "records": sorted(records), "paragraph": paragraph}


def fresh(path: Path, since: float) -> bool:
    """Whether `path` exists and was written by this run (a rerun finds the last hang's files)."""
    try:
        return path.stat().st_mtime >= since
    except OSError:
        return False


def read_records(directory: Path, world_size: int, since: float = 0.0) -> dict:
    """rank -> its hang record, those written since `since` (epoch seconds)."""
    records = {}
    for rank in range(world_size):
        path = directory / f"rank-{rank}.json"
        record = read_json(path) if fresh(path, since) else None
        if record is not None:
            records[rank] = record
    return records


def processes_directory(run_directory) -> Path:
    return Path(run_directory) / "processes"


def read_processes(run_directory, world_size: int) -> dict:
    """rank -> {pid, host, node} as each rank wrote it at fit start."""
    return {rank: process for rank in range(world_size)
            if (process := read_json(processes_directory(run_directory) / f"rank-{rank}.json")) is not None}


def checkpoint_sentence(run_directory: Path) -> str:
    from strategies.checkpoint.per_rank import checkpoint_exists
    last = Path(run_directory) / "checkpoints" / "last.ckpt"
    if checkpoint_exists(last):
        return f"{last} is intact and a rerun of the same command resumes from it"
    return "no checkpoint was written before it: a rerun starts over"


# ============================================================================ the watchdog

class Watchdog:
    """A daemon thread watching one rank's flight record (module docstring, step 1)."""

    def __init__(self, recorder: FlightRecorder, rank: int, world_size: int, run_directory: Path,
                 chain: TimeoutChain, summary: dict):
        self.recorder, self.rank, self.world_size = recorder, rank, world_size
        self.run_directory, self.directory = Path(run_directory), hang_directory(run_directory)
        self.chain = chain  # its allowances and deadlines (TimeoutChain)
        self.timeout_s, self.long_s, self.poll_s = chain.step_s, chain.long_s, chain.poll_s
        self.summary = summary  # the run's names for summary.json, should this rank write it
        self.started = time.time()  # files older than this are a previous run's
        self._stopped = threading.Event()
        self.fired = False  # set once a hang is recorded: the main thread must write nothing more
        self._thread = threading.Thread(target=self._watch, name="layerwise-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def allowance(self) -> float:
        return self.timeout_s if self.recorder.phase == "step" else self.long_s

    def _watch(self) -> None:
        request = self.directory / "request"
        while not self._stopped.wait(self.poll_s):
            current = self.recorder.current
            if current is not None and time.monotonic() - current[1] > self.allowance():
                return self._hung("timeout")
            if current is None and self.recorder.stalled(self.allowance()) is not None:
                return self._hung("timeout (an operation in flight, nothing issued since)")
            if fresh(request, self.started):
                return self._hung(f"asked ({request.read_text().strip()})")

    def _hung(self, reason: str) -> None:
        self.fired = True
        try:
            self._record_and_conclude(reason)
        except Exception as error:  # the rank must still end: a hung rank kept alive holds the job
            print(f"[layerwise] rank {self.rank}: the hang record failed: {error!r}", file=sys.stderr, flush=True)
        finally:
            os._exit(HUNG_EXIT_CODE)

    def _record_and_conclude(self, reason: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        write_json(self.directory / f"rank-{self.rank}.json", self.record(reason))
        request = self.directory / "request"
        if not fresh(request, self.started):
            request.write_text(f"rank {self.rank} timed out")
        dump_nccl_trace(self.rank)
        if self._answered_or_stuck():
            self._conclude()
        else:
            deadline = time.monotonic() + 2 * self.timeout_s + 5
            while time.monotonic() < deadline and not fresh(self.directory / "diagnosis.json", self.started):
                time.sleep(self.poll_s)

    def record(self, reason: str) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "reason": reason,
                "time": time.time(), "timeout_s": self.allowance(),
                **self.recorder.snapshot(None if self.recorder.current else self.recorder.stalled(self.poll_s)),
                "main_thread": main_thread_frame(), "stack": python_stacks()}

    def _answered_or_stuck(self) -> bool:
        """Wait until every rank wrote a record or is known stopped or gone; True on the lowest
        rank with a record (it concludes)."""
        deadline = time.monotonic() + self.chain.answers_s
        processes = read_processes(self.run_directory, self.world_size)
        while time.monotonic() < deadline:
            records = read_records(self.directory, self.world_size, self.started)
            silent = [rank for rank in range(self.world_size) if rank not in records]
            if all(process_state(*_pid_host(processes.get(rank))) in ("stopped", "gone") for rank in silent):
                break
            time.sleep(self.poll_s / 2)
        return min(read_records(self.directory, self.world_size, self.started), default=self.rank) == self.rank

    def _conclude(self) -> None:
        processes = read_processes(self.run_directory, self.world_size)
        states = {rank: process_state(*_pid_host(processes.get(rank))) for rank in range(self.world_size)}
        records = read_records(self.directory, self.world_size, self.started)
        verdict = diagnose(records, self.world_size, states, checkpoint=checkpoint_sentence(self.run_directory))
        verdict["nccl_traces"] = sorted(path.name for path in self.directory.glob(f"{NCCL_TRACE_PREFIX}*"))
        print(f"[layerwise] {verdict['paragraph']}", file=sys.stderr, flush=True)
        write_json(self.run_directory / "summary.json", {
            "status": "hung", "error": verdict["paragraph"], "hung_rank": verdict["stuck_rank"],
            "steps": verdict["step"], **self.summary, "world_size": self.world_size})
        write_json(self.directory / "diagnosis.json", verdict)  # last: the other ranks exit once it exists
        for rank, state in states.items():  # no process left behind: stuck ones on this host
            pid = processes.get(rank, {}).get("pid")
            if rank not in records and state in ("stopped", "alive") and pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass


def clear_previous_hang(run_directory, rank: int) -> None:
    """A rerun starts without the last hang's request, diagnosis and this rank's record (the record of
    a rank that cannot hang before every rank has passed this point: set-up is collective)."""
    directory = hang_directory(run_directory)
    for name in [f"rank-{rank}.json"] + (["request", "diagnosis.json"] if rank == 0 else []):
        (directory / name).unlink(missing_ok=True)


def _pid_host(process: Optional[dict]) -> tuple:
    return (None, None) if process is None else (process["pid"], process["host"])


def main_thread_frame() -> Optional[str]:
    """Where the main thread is: its innermost frame, and the innermost of this repository's."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return None
    stack = traceback.extract_stack(frame)
    def name(entry):
        return f"{entry.name} ({Path(entry.filename).name}:{entry.lineno})"
    ours = [entry for entry in stack if entry.filename.startswith(REPOSITORY) and "site-packages" not in entry.filename]
    inner = name(stack[-1])
    return inner if not ours or ours[-1] is stack[-1] else f"{inner}, called from {name(ours[-1])}"


def python_stacks() -> str:
    """Every thread's Python stack, as faulthandler prints it (it needs a real file)."""
    with tempfile.TemporaryFile("w+") as handle:
        faulthandler.dump_traceback(handle, all_threads=True)
        handle.seek(0)
        return handle.read()


def dump_nccl_trace(rank: int) -> None:
    """On NCCL, ask PyTorch's flight recorder for its dump too, into hang/ beside ours, named by
    `rank` (the global rank the trainer knows: srun sets no RANK) as torch names its own dump on a
    timeout (TORCH_NCCL_DEBUG_INFO_TEMP_FILE + the global rank). Not run on a GPU here (README)."""
    if os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0") == "0":
        return
    try:
        import torch.distributed as dist
        dump = getattr(dist.distributed_c10d, "_dump_nccl_trace", None) or getattr(
            __import__("torch")._C._distributed_c10d, "_dump_nccl_trace", None)
        if dump is not None:
            trace = dump()
            Path(f"{os.environ['TORCH_NCCL_DEBUG_INFO_TEMP_FILE']}{rank}").write_bytes(trace)
    except Exception as error:  # evidence only: the diagnosis goes on without it
        print(f"[layerwise] NCCL flight recorder dump failed: {error}", file=sys.stderr, flush=True)


NCCL_TRACE_PREFIX = "nccl_trace_rank_"  # + the global rank: torch's name for its own dump, and ours


def nccl_flight_recorder_environment(cfg, run_directory) -> dict:
    """The variables that switch NCCL's flight recorder on for GPU profiles (hardware.nccl_trace_buffer_size),
    and its folder, made here at fit start: NCCL's own watchdog may dump before ours fires (ours
    makes hang/ only then), and the dump goes into an existing folder only."""
    size = cfg.hardware.nccl_trace_buffer_size
    if cfg.hardware.process_group_backend != "nccl" or not size:
        return {}
    directory = hang_directory(run_directory)
    directory.mkdir(parents=True, exist_ok=True)
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": str(size), "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(directory / NCCL_TRACE_PREFIX)}


# ============================================================================ stragglers

class StragglerDetector:
    """Counts, per rank, the consecutive steps its compute time exceeded STRAGGLER_RATIO × the median."""

    def __init__(self, window: int):
        self.window = window
        self.streak = {}

    def update(self, compute_s: list) -> list:
        """The ranks slow for `window` steps in a row as of these times (every rank's, one step)."""
        median = statistics.median(compute_s)
        if median <= 0:
            return []
        for rank, seconds in enumerate(compute_s):
            self.streak[rank] = self.streak.get(rank, 0) + 1 if seconds > STRAGGLER_RATIO * median else 0
        return [rank for rank, streak in self.streak.items() if streak >= self.window]


# ============================================================================ the callback

class HangWatch(pl.Callback):
    """Starts the flight record and the watchdog on every rank at fit start; sets the phase and
    step the watchdog reads; times each step's compute for the straggler check.

    Place it right after RunEvidence: its step-end hook then runs after the evidence's exchange wait
    (still the step's allowance) and before the checkpoint (the long allowance).
    """

    def __init__(self, cfg, run_directory: Path, world_size: int, evidence, devices_per_node: int):
        self.cfg, self.run_directory, self.world_size = cfg, Path(run_directory), world_size
        self.evidence, self.devices_per_node = evidence, devices_per_node
        self.timeout_s = collective_timeout_s(cfg)
        self.stragglers = StragglerDetector(cfg.trainer.straggler_window) if cfg.trainer.straggler_window else None
        self.recorder, self.watchdog, self._process = None, None, {}
        self.compute_s, self._timer, self._steps_here, self._reported = 0.0, None, 0, set()
        self.flagged = ""  # the ranks flagged as of this step, for its metrics.csv row
        if self.stragglers is not None and world_size > 1:
            evidence.per_rank["compute_s"] = lambda: self.compute_s
            evidence.row_columns["stragglers"] = lambda: self.flagged

    def on_fit_start(self, trainer, module):
        if self.world_size == 1 or (self.timeout_s == 0 and self.stragglers is None):
            return  # one process waits on nobody; both off: no record at all (benchmarks/overhead.py)
        communicator = trainer.strategy.communicator()
        self.recorder = FlightRecorder(RING_SIZE, marks_for(trainer.strategy.root_device))
        self._timer = StepTimer(trainer.strategy.root_device, self.recorder)  # the device's time on a GPU
        if communicator is not None:
            communicator.recorder = self.recorder
        self.evidence.recorder = self.recorder
        if self.timeout_s > 0:
            rank = trainer.global_rank
            clear_previous_hang(self.run_directory, rank)
            processes_directory(self.run_directory).mkdir(parents=True, exist_ok=True)
            self._process = {"pid": os.getpid(), "host": socket.gethostname(), "node": rank // self.devices_per_node}
            write_json(self._process_path(rank), self._process)
            names = {"strategy": self.cfg.strategy.name, "model": self.cfg.model.name,
                     "hardware": self.cfg.hardware.name, "data": self.cfg.data.name}
            self.watchdog = Watchdog(self.recorder, rank, self.world_size, self.run_directory,
                                     run_timeout_chain(self.cfg), names)
            self.watchdog.start()

    def _process_path(self, rank: int) -> Path:
        return processes_directory(self.run_directory) / f"rank-{rank}.json"

    def _write_waits(self, rank: int) -> None:
        """The rank's waits by group and kind, over its steps, beside its pid in processes/rank-<k>.json
        (docs/evidence.md): measured communication time, which plan mode prices."""
        write_json(self._process_path(rank), {**self._process, "steps": self._steps_here,
                                              "waits": self.recorder.waits()})

    def on_train_batch_start(self, trainer, module, batch, batch_index):
        if self.recorder is None:
            return
        self.recorder.step = trainer.global_step + 1
        self.recorder.phase = "step" if self._steps_here else "first step"
        self.recorder.take_blocked()
        self._timer.start()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
        if self.recorder is None:
            return
        # both on the timeline that blocks (parallel/flight.py): on a GPU the step's device time less
        # the compute stream's stalls in waits, after the timer's sync has let every mark pass
        self.compute_s = self._timer.stop() - self.recorder.take_blocked()
        self.recorder.phase, self.recorder.action = "between steps", None
        self._steps_here += 1
        if self.stragglers is not None:
            self._check_stragglers(trainer)

    def _check_stragglers(self, trainer) -> None:
        """The exchange of this step carried every rank's compute time of the step before: the
        ranks flagged by it go into this step's row (written by the evidence after this hook)."""
        times = self.evidence.per_rank_values("compute_s")
        if times is None or min(times) <= 0:  # no exchange yet, or the first step here: no step before it
            return
        slow = self.stragglers.update(times)
        median = statistics.median(times)
        step = trainer.global_step
        self.flagged = " ".join(map(str, slow))
        history = self.evidence.history.setdefault("stragglers", [])
        for rank in slow:
            entry = next((e for e in history if e["rank"] == rank), None)
            if entry is None:
                entry = {"rank": rank, "node": rank // self.devices_per_node, "first_step": step, "steps": 0}
                history.append(entry)
            entry["steps"] += 1
            entry["last_step"], entry["ratio"] = step, round(times[rank] / median, 2)
            if rank not in self._reported and trainer.is_global_zero:
                self._reported.add(rank)
                print(f"[layerwise] straggler: rank {rank} (node {entry['node']}) computed "
                      f"{times[rank]:.3f} s at step {step}, {times[rank] / median:.1f}x the median "
                      f"{median:.3f} s, above {STRAGGLER_RATIO}x for {self.stragglers.window} steps in a row "
                      f"(trainer.straggler_window)", flush=True)

    def teardown(self, trainer, module, stage):
        self._detach(trainer)

    def on_exception(self, trainer, module, exception):
        if self.watchdog is not None and self.watchdog.fired:
            # a peer's exit broke this rank's wait: the summary is the diagnosis's, not a failure's;
            # park until the watchdog ends the process (HUNG_EXIT_CODE)
            threading.Event().wait()
        self._detach(trainer)

    def _detach(self, trainer) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
            self._write_waits(trainer.global_rank)
        communicator = trainer.strategy.communicator()
        if communicator is not None:
            communicator.recorder = None
        self.evidence.recorder = None
