"""Per-rank checkpoints, written atomically: what every strategy with sharded or partial state uses.

A checkpoint is a directory `last.ckpt/` holding `rank{r}.pt` (that rank's Lightning checkpoint
dict: its own layers, shards, optimizer state) and `layout.json` (world size and degrees). Every
rank writes into `last.ckpt.tmp/`; after a barrier rank 0 swaps it in with renames, so a job killed
at any instant leaves either the previous complete checkpoint or the new one, never a mixture.

Why not torch.distributed.checkpoint: DCP treats a plain tensor key present on several ranks as
replicated and keeps rank 0's copy (ZeRO shards all share their names), and resharding on load is
not needed while a resume uses the same layout, which `layout.json` enforces with a clear error.
"""

import json
import os
import shutil
from pathlib import Path

import torch
from typing_extensions import override


def _old(path: Path) -> Path:
    return path.with_name(path.name + ".old")


def _temporary(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def checkpoint_exists(path: Path) -> bool:
    """A complete checkpoint is at `path` (file or directory), or survived a crash mid-swap."""
    path = Path(path)
    return path.exists() or _old(path).exists()


def save_per_rank(checkpoint: dict, path: Path, rank: int, layout: dict, barrier) -> None:
    path, temporary = Path(path), _temporary(Path(path))
    if rank == 0:
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
        (temporary / "layout.json").write_text(json.dumps(layout))
    barrier("checkpoint directory created")
    torch.save(checkpoint, temporary / f"rank{rank}.pt")
    barrier("every rank wrote its file")
    if rank == 0:
        if path.exists():
            os.replace(path, _old(path)) if path.is_dir() else path.unlink()
        os.replace(temporary, path)
        shutil.rmtree(_old(path), ignore_errors=True)
    barrier("checkpoint swapped in")


def load_per_rank(path: Path, rank: int, layout: dict) -> dict:
    path = Path(path)
    if not path.exists() and _old(path).exists():  # killed between the two renames
        path = _old(path)
    saved = json.loads((path / "layout.json").read_text())
    if saved != layout:
        raise ValueError(f"checkpoint {path} was written with layout {saved}; this run has "
                         f"{layout}. Fix: resume with the same strategy degrees and world size, "
                         f"or start a new run with run_name=<new name>.")
    return torch.load(path / f"rank{rank}.pt", map_location="cpu", weights_only=False)


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
        return load_per_rank(Path(checkpoint_path), self.global_rank, self.layout.describe())

    @override
    def remove_checkpoint(self, filepath) -> None:
        if self.global_rank == 0:
            shutil.rmtree(filepath, ignore_errors=True)
