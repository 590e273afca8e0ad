"""A warm interpreter: imports train.py's libraries once, then forks one child per command it is given.

Why: every `python train.py ...` a test runs first spends ~6 s of CPU importing torch, Lightning and
Hydra; the documented commands alone are ~60 such processes. A child forked from a process that has
imported them, and has run nothing (no OpenMP pool, no CUDA, one thread), starts at once and is still
a process of its own: its own session, working directory, environment, argv, stdout, stderr and exit
code, which is all a test looks at. atexit handlers run at its end as they would in `python train.py`.

    result = python([sys.executable, "train.py", "mode=check"], cwd=ROOT, timeout=120)  # like subprocess.run
    result.returncode, result.stdout, result.stderr

One server serves the whole test session (started by the first call, stopped by conftest).

The server (this file run as a script) reads one JSON request per line on stdin and answers on stdout
with {"id", "pid"} when the child starts and {"id", "code"} when it ends. `argv` is what a shell would
run: `python SCRIPT args...` or `python -m MODULE args...`.
"""

import atexit
import json
import os
import queue
import runpy
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parent.parent
PRELOAD = ("torch", "lightning.pytorch", "hydra", "omegaconf", "layerwise.config.store", "layerwise.run.launch",
           "layerwise.run.fit", "layerwise.planning.mode", "layerwise.preflight")


# ================================================================ the server (this file as a script)

def _run_as_main(argv: List[str]) -> int:
    """What `python argv[1:]` does in this process: a script or `-m module`, SystemExit as exit code."""
    try:
        if argv[1] == "-m":
            sys.argv = [argv[2], *argv[3:]]
            sys.path[0] = os.getcwd()  # python -m puts the working directory first
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv[1:]
            sys.path[0] = str(Path(argv[1]).resolve().parent)  # python SCRIPT puts the script's folder first
            runpy.run_path(argv[1], run_name="__main__")
        return 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - the interpreter prints an uncaught exception and exits 1
        traceback.print_exc()
        return 1


def _child(request: dict) -> None:
    os.setsid()  # its own session: a timeout kills it and every rank it forked, as with start_new_session
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY),
                           (2, request["stderr"], os.O_WRONLY)):
        os.dup2(os.open(path, mode), fd)
    code = _run_as_main(request["argv"])
    try:
        atexit._run_exitfuncs()  # what the interpreter does on the way out (logging, multiprocessing)
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)


def _reply(message: dict) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def serve() -> None:
    for name in PRELOAD:
        __import__(name)
    assert threading.active_count() == 1, "a preloaded module started a thread: forking would copy a lock held"
    _reply({"ready": os.getpid()})
    children, pending, open_ = {}, b"", True
    while open_ or children:
        if open_ and select.select([0], [], [], 0.02)[0]:
            chunk = os.read(0, 1 << 16)
            open_, pending = bool(chunk), pending + chunk
            *lines, pending = pending.split(b"\n")
            for line in filter(None, lines):
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request)
                children[pid] = request["id"]
                _reply({"id": request["id"], "pid": pid})
        elif not open_:
            time.sleep(0.02)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _reply({"id": children.pop(pid), "code": os.waitstatus_to_exitcode(status)})


# ================================================================ the client (tests)

class WarmPython:
    """Runs `python ...` command lines as children of one warm server; thread-safe, one server per session."""

    def __init__(self):
        # torch.distributed's first import (c10d's C++ initialisation) aborted the pytest process
        # without a message in 2 of 4 runs of the documented commands while this reader thread and
        # the runner's waited; imported before the thread starts, it has not since
        import torch.distributed  # noqa: F401
        self.process = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        cwd=ROOT, start_new_session=True)
        self.lock, self.queues, self.next_id = threading.Lock(), {}, 0
        ready = json.loads(self.process.stdout.readline() or "{}")
        assert "ready" in ready, "the warm interpreter did not start (its error is on stderr above)"
        threading.Thread(target=self._read, daemon=True, name="warm-python").start()

    def _read(self) -> None:
        for line in self.process.stdout:
            message = json.loads(line)
            self.queues[message["id"]].put(message)

    def run(self, argv: List[str], cwd: Path, env: dict, timeout_s: float) -> subprocess.CompletedProcess:
        """`argv` run in `cwd` with `env`, as subprocess.run(..., capture_output=True, text=True) would
        return it; killed after timeout_s and subprocess.TimeoutExpired raised, with what it wrote."""
        outputs = Path(tempfile.mkdtemp(prefix="warm-python-"))
        out, err = outputs / "stdout", outputs / "stderr"
        out.touch(), err.touch()
        with self.lock:
            ident, self.next_id = self.next_id, self.next_id + 1
            answers = self.queues[ident] = queue.Queue()
            request = {"id": ident, "argv": [str(a) for a in argv], "cwd": str(cwd), "env": dict(env),
                       "stdout": str(out), "stderr": str(err)}
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
        try:
            pid = answers.get(timeout=60)["pid"]
            try:
                code = answers.get(timeout=timeout_s)["code"]
            except queue.Empty:
                self._kill(pid)
                answers.get(timeout=60)  # its exit, once killed
                raise subprocess.TimeoutExpired(argv, timeout_s, out.read_text(), err.read_text())
            self._kill(pid)  # a rank left behind by a failed run
            return subprocess.CompletedProcess(argv, code, out.read_text(), err.read_text())
        finally:
            self.queues.pop(ident, None)
            shutil.rmtree(outputs, ignore_errors=True)

    @staticmethod
    def _kill(pid: int) -> None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


_SERVER: List[WarmPython] = []


def python(argv: List[str], cwd: Path = ROOT, env: dict = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout), forked
    from the session's warm interpreter (started on first use); argv is `python SCRIPT ...` or
    `python -m MODULE ...`."""
    if not _SERVER:
        _SERVER.append(WarmPython())
    return _SERVER[0].run(argv, Path(cwd), dict(os.environ if env is None else env), timeout)


def server_pids() -> set:
    """The running server's pid, if one started (a test that counts this process's children skips it)."""
    return {server.process.pid for server in _SERVER}


def stop() -> None:
    """Stops the session's server, if one started (conftest, at the session's end)."""
    while _SERVER:
        _SERVER.pop().close()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    serve()
