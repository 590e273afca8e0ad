"""train.py as a user runs it: one run, a sweep, a resume; asserts on the evidence, not exit codes."""

import csv
import json
import os
import sys
from pathlib import Path
from tests.warm_python import python


ROOT = Path(__file__).resolve().parent.parent
FAST = ["debug=fast", "model.layers=2", "trainer.max_steps=6", "trainer.val_check_interval=3",
        "data.max_bytes=2000000", "trainer.check_point_to_point_order=true"]


def train_py(*arguments, wandb_mode="disabled", timeout=300):
    environment = {**os.environ, "WANDB_MODE": wandb_mode}
    result = python([sys.executable, "train.py", *arguments], cwd=ROOT, env=environment, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def read_metrics(directory):
    with (Path(directory) / "metrics.csv").open() as handle:
        return list(csv.DictReader(handle))


def test_default_strategy_run_leaves_its_evidence(tmp_path):
    result = train_py(*FAST, "data.global_batch_size=8", f"hydra.run.dir={tmp_path}")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["strategy"] == "modular_pipeline"
    assert summary["world_size"] == 2 and summary["layout"] == {"data": 1, "pipeline": 2, "tensor": 1,
                                                                 "order": ["tensor", "pipeline", "data"]}
    assert summary["steps"] == 6 and len(summary["losses"]) == 6
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    rows = read_metrics(tmp_path)
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(float(r["comm_bytes_send_recv"]) > 0 for r in rows)
    assert (tmp_path / "schedule_planned.png").exists() and (tmp_path / "config.yaml").exists()
    assert "completed: validation loss" in result.stdout


def test_sweep_gives_each_point_a_directory_and_one_wandb_group(tmp_path):
    sweep = tmp_path / "sweep"
    train_py("-m", "strategy=single,ddp", *FAST, "logger.name=wandb", f"hydra.sweep.dir={sweep}",
             wandb_mode="offline")
    points = sorted(p for p in sweep.iterdir() if p.is_dir() and (p / "summary.json").exists())
    assert len(points) == 2
    assert points[0].name.startswith("0_") and "strategy=single" in points[0].name
    assert points[1].name.startswith("1_") and "strategy=ddp" in points[1].name
    strategies = [json.loads((p / "summary.json").read_text())["strategy"] for p in points]
    assert strategies == ["single", "ddp"]
    for point in points:
        runs = list((point / "wandb").glob("offline-run-*/run-*.wandb"))
        assert len(runs) == 1, f"{point}: one offline W&B run"
        assert sweep.name.encode() in runs[0].read_bytes(), "the sweep's name is the W&B group"


def test_rerun_resumes_from_the_run_directory(tmp_path):
    train_py(*FAST, "strategy=ddp", "trainer.max_steps=4", "trainer.checkpoint_every_n_steps=2",
             f"hydra.run.dir={tmp_path}")
    result = train_py(*FAST, "strategy=ddp", "trainer.checkpoint_every_n_steps=2",
                      f"hydra.run.dir={tmp_path}")
    assert "resuming from" in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 6 and len(summary["losses"]) == 6
    assert [int(r["step"]) for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]


def test_mode_check_starts_nothing(tmp_path):
    result = train_py("mode=check", f"hydra.run.dir={tmp_path}")
    assert "configuration is valid" in result.stdout
    assert not (tmp_path / "metrics.csv").exists()
