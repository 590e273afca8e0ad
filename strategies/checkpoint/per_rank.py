"""Per-rank checkpoints, written atomically: what every strategy with sharded or partial state uses.

A checkpoint is a directory `last.ckpt/` holding `rank{r}.pt` (that rank's Lightning checkpoint
dict: its own layers, shards, optimizer state) and `layout.json` (world size and degrees). Every
rank writes into `last.ckpt.tmp/`; after a barrier rank 0 swaps it in with renames, so a job killed
at any instant leaves either the previous complete checkpoint or the new one, never a mixture.

Faults (docs/faults.md): the checkpoint before `last` is kept as `previous.ckpt`, so a `last` that
turns out truncated or corrupt (every file's zip CRCs are checked on load) is skipped with a message
naming the file, and the run resumes from `previous`; every rank must agree, so the ranks vote. A
write that fails (disk full) removes its partial file and leaves `last` as it was. Files are read
without running code from them (strategies/checkpoint/safe_load.py); a file asking to is refused, not skipped.

Two formats, and why. These per-rank files are the same-layout resume: bit-identical, CRC-checked
per file, voted fall-back to `previous`. Every save also writes a portable checkpoint beside it
(`last.ckpt` -> `last/`, strategies/checkpoint/portable.py) with torch.distributed.checkpoint (DCP), which any
strategy at any world size resumes from (`resume_from=`). DCP treats a plain tensor key present on
several ranks as replicated and keeps one copy (ZeRO shards all share their names), so the portable
format stores every tensor under its plain name as a ShardedTensor whose local shards are this
rank's rectangles at their offsets in the full tensor (a ZeRO flat range of a matrix: partial row,
whole rows, partial row); identical rectangles (data replicas) are written once, by the lowest
rank. The per-rank files stay because the fault handling above (CRC per zip file, the rank vote,
the disk-full message) is built on them and DCP's files carry no checksums; one format would need
that rebuilt on DCP's storage layer first.
"""

import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import torch
from typing_extensions import override

from strategies.checkpoint.safe_load import dcp_file_problems, load_torch_file


def _old(path: Path) -> Path:
    return path.with_name(path.name + ".old")


def _temporary(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def previous_checkpoint(path: Path) -> Path:
    """Where the checkpoint before `path` is kept: `previous.ckpt` beside `last.ckpt` (other names,
    such as a test's `step3.ckpt`, get their own `step3.previous.ckpt`)."""
    path = Path(path)
    return path.with_name(("previous" if path.stem == "last" else path.stem + ".previous") + path.suffix)


def candidates(path: Path) -> list:
    """The checkpoints a resume may use, newest first: `last`, its pre-swap copy, `previous`."""
    path = Path(path)
    return [p for p in (path, _old(path), previous_checkpoint(path)) if p.exists()]


def checkpoint_exists(path: Path) -> bool:
    """A checkpoint is at `path` (file or directory), survived a crash mid-swap, or precedes it."""
    return bool(candidates(path))


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the file and the fix."""


# What torch.load, zipfile and json raise on a truncated or overwritten file (not a layout mismatch).
UNREADABLE = (CheckpointError, RuntimeError, EOFError, OSError, pickle.UnpicklingError,
              zipfile.BadZipFile, json.JSONDecodeError, UnicodeDecodeError)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def write_checkpoint_file(checkpoint: dict, file: Path) -> None:
    """torch.save through a Python file, so a full disk raises OSError (a path gives torch's
    opaque stream error); synced before any rename relies on it. A failed write leaves no file."""
    try:
        with open(file, "wb") as handle:
            torch.save(checkpoint, handle)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        file.unlink(missing_ok=True)
        raise CheckpointError(
            f"could not write checkpoint file {file}: {error.strerror or error}. Nothing was "
            f"swapped in: the last complete checkpoint beside it is untouched. Fix: free space "
            f"on that file system (or give the run another directory with hydra.run.dir=...), then "
            f"rerun the same command: it resumes from that checkpoint.") from error


def swap_in(temporary: Path, path: Path) -> None:
    """Make `temporary` the checkpoint at `path`, keeping the one it replaces as `previous`.

    Renames only: a crash leaves `path`, or (between the renames) `previous` and the temporary,
    each complete. The old `previous` is renamed aside before it is deleted, never half-deleted."""
    previous = previous_checkpoint(path)
    if path.exists():  # the first save of a name keeps whatever `previous` there is
        _remove(_old(previous))
        if previous.exists():
            os.replace(previous, _old(previous))
        os.replace(path, previous)
    os.replace(temporary, path)
    _remove(_old(previous))


def verify_zip(file: Path) -> None:
    """torch.save's zip CRCs: torch.load itself loads a file with overwritten tensor bytes silently."""
    with zipfile.ZipFile(file) as archive:
        damaged = archive.testzip()
    if damaged is not None:
        raise CheckpointError(f"{file}: entry {damaged} fails its CRC check (the file is corrupt)")


def read_checkpoint_file(file: Path) -> dict:
    """One checkpoint file, checked; CheckpointError naming the file if it is damaged, and
    UnsafeCheckpointError (no fallback) if it asks to run code (strategies/checkpoint/safe_load.py)."""
    try:
        verify_zip(file)
        return load_torch_file(file)
    except UNREADABLE as error:
        raise CheckpointError(f"{file} is unreadable ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else 'empty'})") from error


def portable_problems(path: Path) -> list:
    """Why the portable (DCP) checkpoint directory `path` cannot be loaded: [] when its sidecar
    passes its zip CRCs and every data file its `.metadata` names is there at full length
    (safe_load.dcp_file_problems). A probe: it loads no tensor."""
    path = Path(path)
    for needed in (".metadata", "lightning.pt"):
        if not (path / needed).is_file():
            return [f"{path / needed} is missing"]
    try:
        verify_zip(path / "lightning.pt")
        return dcp_file_problems(path)
    except Exception as error:  # noqa: BLE001 - any failure to read means "not intact"; the message says which
        return [f"{path} is unreadable ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"]


def intact_portable_copies(path: Path) -> list:
    """The portable checkpoints saved with per-rank or single-file `path` and with its previous
    (`last.ckpt` -> `last/`, `previous.ckpt` -> `previous/`) that are intact, newest first: any
    strategy and layout resume from them with `resume_from=`."""
    copies = [Path(p).with_suffix("") for p in (path, previous_checkpoint(path)) if Path(p).suffix == ".ckpt"]
    return [copy for copy in copies if copy.is_dir() and not portable_problems(copy)]


def unreadable_fix(path: Path) -> str:
    """The fix when no per-rank or single-file checkpoint at `path` is readable: the intact portable
    copy beside it first (it holds the same step), else starting over."""
    start_over = (f"delete the damaged checkpoint ({path}) to start over, or rerun with resume=false (or "
                  f"another run_name) to start a new run without it")
    copies = intact_portable_copies(path)
    if not copies:
        return f"Fix: {start_over}."
    return (f"Fix: resume from the portable copy saved beside it, which is intact: rerun the same command "
            f"with resume=false resume_from={copies[0]} (it holds the same weights and optimizer state, "
            f"and any strategy or layout loads it); or {start_over}.")


def load_first_readable(path: Path, read, agree=lambda ok: ok, say=print):
    """`read(candidate)` of the newest candidate every rank can read (`agree` votes).

    A damaged `last` is reported and skipped for `previous`; if none is readable, the error names
    each file and the fix."""
    problems = []
    for candidate in candidates(path):
        try:
            state, problem = read(candidate), None
        except UNREADABLE as error:
            state, problem = None, str(error)
        if agree(problem is None):
            if problems:
                say(f"[layerwise] checkpoint {path} is damaged ({'; '.join(problems)}): "
                    f"falling back to {candidate}")
            return state
        problems.append(problem or f"another rank could not read its file of {candidate}")
    raise CheckpointError(f"no readable checkpoint at {path}: {'; '.join(problems) or 'nothing there'}. "
                          f"{unreadable_fix(Path(path))}")


def save_per_rank(checkpoint: dict, path: Path, rank: int, layout: dict, barrier) -> None:
    path, temporary = Path(path), _temporary(Path(path))
    if rank == 0:
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
        (temporary / "layout.json").write_text(json.dumps(layout))
    barrier("checkpoint directory created")
    write_checkpoint_file(checkpoint, temporary / f"rank{rank}.pt")
    barrier("every rank wrote its file")
    if rank == 0:
        swap_in(temporary, path)
    barrier("checkpoint swapped in")


def load_per_rank(path: Path, rank: int, layout: dict, agree=lambda ok: ok) -> dict:
    """This rank's file of the newest checkpoint all ranks can read (see load_first_readable)."""
    return load_first_readable(Path(path), lambda candidate: _read_rank(candidate, rank, layout),
                               agree, say=print if rank == 0 else lambda message: None)


def _read_rank(path: Path, rank: int, layout: dict) -> dict:
    try:
        saved = json.loads((path / "layout.json").read_text())
    except UNREADABLE as error:
        raise CheckpointError(f"{path / 'layout.json'} is unreadable ({error})") from error
    if saved != layout:  # not damage: a ValueError, never a fallback to an older checkpoint
        raise ValueError(f"checkpoint {path} was written with layout {saved}; this run has "
                         f"{layout}. Fix: resume with the same strategy degrees and world size, "
                         f"or start a new run with run_name=<new name>.")
    return read_checkpoint_file(path / f"rank{rank}.pt")


class PerRankCheckpoints:
    """Strategy mixin: each rank saves and restores its own state (see the module docstring).

    The subclass provides `self.layout` (a ParallelLayout). Restoring happens after `setup`,
    once the model holds only this rank's layers or shards, so the state dict keys match.
    """

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return True

    @override
    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        save_per_rank(checkpoint, Path(filepath), self.global_rank,
                      self.layout.describe(), self.barrier)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        # every rank must resume from the same checkpoint: a file damaged on one rank moves all
        return load_per_rank(Path(checkpoint_path), self.global_rank, self.layout.describe(),
                             agree=lambda ok: self.reduce_boolean_decision(ok, all=True))

    @override
    def remove_checkpoint(self, filepath) -> None:
        if self.global_rank == 0:
            shutil.rmtree(filepath, ignore_errors=True)
