"""Test runs as train.py makes them: configs composed like train.py composes them, and functions run
on forked gloo ranks.

`run_on_ranks` is the launcher train.py uses (layerwise.run.launch.run_ranks): ranks are forked, get
MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK/LOCAL_RANK/NODE_RANK in their own environment (the test
process's environment is never touched), destroy their process group on the way out, and are
killed if any rank fails; the failing rank's traceback is raised here.
"""

import os
from pathlib import Path

from layerwise.config.store import compose
from layerwise.run.launch import run_ranks

CONFIG_DIRECTORY = str(Path(__file__).resolve().parent.parent / "conf")
# Every multi-process test runs the strict point-to-point check (NCCL's issue order; parallel/comm.py).
STRICT_POINT_TO_POINT = "trainer.check_point_to_point_order=true"
# trainer.charts=false: no PNGs at a run's end (~0.3 s of rank 0's matplotlib per run); the tests that
# read charts turn them back on.
QUICK = ["logger=none", "trainer.progress=none", "trainer.charts=false", "trainer.limit_val_batches=1",
         "data.global_batch_size=8", "data.sequence_length=32", "model.layers=2", "model.hidden=32",
         "model.heads=2", "data.max_bytes=2000000", STRICT_POINT_TO_POINT]


def compose_config(*overrides: str):
    """The composed (unvalidated) config for these overrides, as train.py would see it, with the
    strict point-to-point check on (first, so a test that means to turn it off still can)."""
    return compose([STRICT_POINT_TO_POINT, *overrides])


def run_on_ranks(function, world_size: int, *arguments):
    assert "LOCAL_RANK" not in os.environ, "a previous test leaked LOCAL_RANK"
    return run_ranks(function, world_size, *arguments, timeout=300)


def add_callbacks(set_attribute, *callbacks, first=()):
    """Every Trainer layerwise.run.fit builds (also in forked ranks, which inherit the patch) gets
    `callbacks` appended and `first` put in front; `set_attribute` is monkeypatch.setattr, which
    puts build_trainer back after the test."""
    import layerwise.run.fit as fit
    build = fit.build_trainer

    def build_with(*arguments, **keywords):
        trainer = build(*arguments, **keywords)
        trainer.callbacks[:0] = list(first)
        trainer.callbacks.extend(callbacks)
        return trainer
    set_attribute(fit, "build_trainer", build_with)


def process_parents() -> dict:
    """{pid: parent pid} of every process in the table (zombies included), read from /proc/<pid>/stat
    (the command name in brackets may hold spaces: the fields after its closing one are split)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    return parents
