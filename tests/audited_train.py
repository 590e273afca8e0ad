"""train.py with a write audit: every file this process creates, writes, renames or removes under
$AUDIT_RUN_DIRECTORY is logged with its global rank to $AUDIT_LOG_DIRECTORY/<pid>.log.

Used by tests/test_torchrun.py as torchrun's script to prove that only global rank 0 writes the run
directory's files (a rank writing its own checkpoint shard is the one exception). Python's audit
hooks see every open(), os.replace, os.link, os.mkdir and os.remove, whoever calls them.
"""

import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN_DIRECTORY = os.path.abspath(os.environ["AUDIT_RUN_DIRECTORY"])
LOG = os.open(os.path.join(os.environ["AUDIT_LOG_DIRECTORY"], f"{os.getpid()}.log"),
              os.O_WRONLY | os.O_CREAT | os.O_APPEND)
WRITING_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT
PATH_EVENTS = ("os.rename", "os.link", "os.mkdir", "os.remove", "os.rmdir", "shutil.rmtree")


def written_path(event: str, arguments: tuple):
    """The path an event writes, or None when it only reads."""
    if event == "open":
        path, _, flags = arguments
        return path if isinstance(flags, int) and flags & WRITING_FLAGS else None
    if event in PATH_EVENTS:
        return arguments[1] if event in ("os.rename", "os.link") else arguments[0]
    return None


def audit(event: str, arguments: tuple) -> None:
    path = written_path(event, arguments)
    if not isinstance(path, (str, bytes, os.PathLike)) or isinstance(path, bytes):
        return
    path = os.path.abspath(os.fspath(path))
    if path.startswith(RUN_DIRECTORY):
        os.write(LOG, f"{os.environ.get('RANK', 'agent')}\t{event}\t{path}\n".encode())


sys.addaudithook(audit)
sys.path.insert(0, str(ROOT))
sys.argv[0] = str(ROOT / "train.py")
runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
