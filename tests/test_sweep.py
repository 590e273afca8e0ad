"""A sweep is checked whole before its first point runs, whatever the launcher (layerwise/sweep.py).

End to end through train.py: the issue's sweep (#35), whose point #3 is invalid, is rejected with
exit code 2 before any point starts under Hydra's basic launcher (the default), ours and
hydra-submitit's local one, and by our local launcher alone when the callback is removed; a valid
sweep runs; `mode=check` over a sweep prints the table of points and runs none; `mode=plan` over a
sweep writes the sweep report with predictions only. In process:
under hydra/launcher=slurm the same check also holds the job resources against the Trainer, and the
launcher takes the checked points instead of checking again.
"""

import csv
import json
import os
import re
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode

from layerwise import sweep as sweep_module
from layerwise.config.store import register_schemas
from tests.ranks import CONFIG_DIRECTORY
from tests.warm_python import python

ROOT = Path(__file__).resolve().parent.parent
ISSUE_SWEEP = ["strategy=modular_pipeline,zero_layered", "strategy.micro_batches=2,4", "debug=fast"]
POINT_3_FIX = ("point #3 (strategy=zero_layered strategy.micro_batches=4 debug=fast): data.global_batch_size=4 "
               "does not split into 2 data-parallel ranks × 4 micro-batches. Fix: data.global_batch_size=8.")


def train_py(*arguments, timeout=300):
    started = time.monotonic()
    result = python([sys.executable, "train.py", *arguments], cwd=ROOT,
                            timeout=timeout, env={**os.environ, "WANDB_MODE": "disabled"})
    return result, time.monotonic() - started


def csv_rows(path: Path) -> list:
    with path.open() as handle:
        return list(csv.DictReader(handle))


# ================================================================ end to end: rejected, run, dry, planned

@pytest.mark.parametrize("launcher", [None, "hydra/launcher=local", "hydra/launcher=submitit_local"])
def test_the_issues_sweep_is_rejected_before_any_point_runs(launcher, tmp_path):
    """Before #35 the default launcher ran points #0-#2 (≈11 s here) before #3 failed."""
    sweep = tmp_path / "sweep"
    result, seconds = train_py("-m", *ISSUE_SWEEP, *([launcher] if launcher else []), f"hydra.sweep.dir={sweep}")
    print(f"{launcher or 'default launcher'}: rejected in {seconds:.1f} s")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert "sweep rejected before its first point: 1 of 4 points invalid" in result.stderr
    assert POINT_3_FIX in result.stderr
    assert not re.search(r"point #[012] ", result.stderr), "only the invalid point is named"
    assert "run directory" not in result.stdout, "no point started"
    assert not sweep.exists(), "no sweep directory, no point directory"


def test_our_launcher_checks_by_itself_without_the_callback(tmp_path):
    """The local launcher calls the same check (layerwise.sweep.check_points): with the callback
    removed the sweep is still rejected before a point starts (only Hydra's multirun.yaml exists)."""
    sweep = tmp_path / "sweep"
    result, _ = train_py("-m", *ISSUE_SWEEP, "hydra/launcher=local", "~hydra.callbacks.sweep_check",
                         f"hydra.sweep.dir={sweep}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert POINT_3_FIX in result.stderr and "run directory" not in result.stdout
    assert [path.name for path in sweep.iterdir()] == ["multirun.yaml"]


def test_every_invalid_point_is_named_at_once_with_its_field_and_fix(tmp_path):
    """A knob one point's strategy lacks (a composition error) and a cross-group problem, together."""
    sweep = tmp_path / "sweep"
    result, _ = train_py("-m", "strategy=single,modular_pipeline", "strategy.micro_batches=3", "debug=fast",
                         f"hydra.sweep.dir={sweep}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "2 of 2 points invalid" in result.stderr
    assert ("point #0 (strategy=single strategy.micro_batches=3 debug=fast): Could not override "
            "'strategy.micro_batches'") in result.stderr and "Fix: remove strategy.micro_batches=3" in result.stderr
    assert ("point #1 (strategy=modular_pipeline strategy.micro_batches=3 debug=fast): data.global_batch_size=4 "
            "does not split into 1 data-parallel ranks × 3 micro-batches. Fix: data.global_batch_size=3 or 6.") \
        in result.stderr
    assert not sweep.exists()


def test_a_valid_sweep_still_runs(tmp_path):
    sweep = tmp_path / "sweep"
    result, _ = train_py("-m", "strategy=single,ddp", "debug=fast", "trainer.max_steps=2", "data.max_bytes=2000000",
                         f"hydra.sweep.dir={sweep}")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = csv_rows(sweep / "sweep_summary.csv")
    assert [(row["strategy"], row["status"], row["steps"]) for row in rows] == \
        [("single", "completed", "2"), ("ddp", "completed", "2")]
    for row in rows:
        assert json.loads((Path(row["directory"]) / "summary.json").read_text())["status"] == "completed"
    assert "2 of 2 points completed" in result.stdout


def test_mode_check_over_a_sweep_prints_the_table_and_runs_nothing(tmp_path):
    sweep = tmp_path / "sweep"
    result, _ = train_py("-m", *ISSUE_SWEEP, "mode=check", f"hydra.sweep.dir={sweep}")
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    title = next(i for i, line in enumerate(lines) if "dry sweep (mode=check)" in line)
    assert "nothing run: 3 of 4 points valid; every point: debug=fast mode=check" in lines[title]
    header, *table = lines[title + 1:title + 6]
    assert header.split() == ["#", "point", "ranks", "valid", "problem", "and", "fix"]
    assert [line.split()[:5] for line in table] == [
        [str(n), f"strategy={s}", f"strategy.micro_batches={m}", "2", valid] for n, s, m, valid in
        [(0, "modular_pipeline", 2, "yes"), (1, "modular_pipeline", 4, "yes"), (2, "zero_layered", 2, "yes"),
         (3, "zero_layered", 4, "no")]]
    assert table[3].endswith("Fix: data.global_batch_size=8.")
    assert "1 of 4 points invalid" in result.stderr
    assert "run directory" not in result.stdout and not sweep.exists()
    valid, _ = train_py("-m", *ISSUE_SWEEP, "mode=check", "data.global_batch_size=8", f"hydra.sweep.dir={sweep}")
    assert valid.returncode == 0, valid.stderr[-3000:]
    assert "4 of 4 points valid" in valid.stdout and " no " not in valid.stdout
    assert not sweep.exists(), "a dry sweep makes no directory"


def test_mode_plan_over_a_sweep_writes_the_report_with_predictions_only(tmp_path):
    sweep = tmp_path / "sweep"
    result, _ = train_py("-m", "strategy=modular_pipeline,gpipe", "strategy.micro_batches=2,4", "mode=plan",
                         "data.global_batch_size=8", f"hydra.sweep.dir={sweep}")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = csv_rows(sweep / "sweep_summary.csv")
    assert [(row["strategy"], row["status"]) for row in rows] == \
        [("modular_pipeline", "planned")] * 2 + [("gpipe", "planned")] * 2
    for row in rows:
        point = Path(row["directory"])
        plan = json.loads((point / "plan.json").read_text())
        assert float(row["predicted_step_time_s"]) == pytest.approx(plan["step_time_s"], rel=1e-12)
        assert float(row["predicted_bubble_fraction"]) == pytest.approx(plan["bubble_fraction"], rel=1e-12)
        assert float(row["predicted_peak_compute_bytes"]) == max(sum(role["memory_bytes"].values()) for role in plan["roles"])
        assert row["prediction"].startswith("plan mode, hardware=cpu")
        measured = ("steps", "final_val_loss", "step_time_s_median", "peak_compute_bytes", "comm_bytes_send_recv")
        assert all(row[column] == "" for column in measured), "nothing was run, nothing measured"
        assert not (point / "summary.json").exists() and not (point / "checkpoints").exists()
    # more micro-batches, smaller bubble: the predictions differ per point
    assert float(rows[1]["predicted_bubble_fraction"]) < float(rows[0]["predicted_bubble_fraction"])
    report = (sweep / "sweep_report.md").read_text()
    assert "4 of 4 points planned" in report and "| planned |" in report and "Failed points" not in report
    assert (sweep / "sweep_report.png").exists() and not (sweep / "wandb").exists()
    assert "4 of 4 points planned" in result.stdout


# ============================================================== in process: the Slurm launcher's path

@contextmanager
def multirun_config(*overrides):
    """The multirun's own config, as Hydra composes it before on_multirun_start (sweeps unexpanded)."""
    register_schemas()
    with initialize_config_dir(config_dir=CONFIG_DIRECTORY, version_base="1.3"):
        hydra = GlobalHydra.instance().hydra
        yield hydra.compose_config("config", list(overrides), run_mode=RunMode.MULTIRUN,
                                   with_log_configuration=False), hydra.config_loader


GPU_SWEEP = ["strategy=ddp", "hardware=dgx_a100_80g", "hardware.nodes=1,2", "model=gpt_small",
             "data.global_batch_size=64"]


def test_slurm_sweep_checks_job_resources_and_not_this_machines_gpus(tmp_path, capsys, monkeypatch):
    """Point #0 asks the launcher for 2 nodes while its Trainer runs 1: rejected, named, with the fix.
    The GPU profile itself is fine: the GPUs are on the cluster (submitting), not on this machine."""
    monkeypatch.setattr("layerwise.run.rules.gpu_available", lambda: False)  # as here, whatever the machine
    with multirun_config("hydra/launcher=slurm", *GPU_SWEEP, "hydra.launcher.nodes=2",
                         f"hydra.sweep.dir={tmp_path}/slurm") as (cfg, _):
        with pytest.raises(SystemExit) as stopped:
            sweep_module.SweepCheck().on_multirun_start(config=cfg)
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert "1 of 2 points invalid" in error
    assert ("point #0 (strategy=ddp hardware=dgx_a100_80g hardware.nodes=1 model=gpt_small data.global_batch_size=64): "
            "hydra.launcher.nodes=2 but the Trainer runs hardware.nodes=1") in error
    assert "Fix: drop hydra.launcher.nodes" in error and "CUDA" not in error
    # the same points under the basic launcher would run here, where there is no GPU
    with multirun_config(*GPU_SWEEP, f"hydra.sweep.dir={tmp_path}/basic") as (cfg, _):
        with pytest.raises(SystemExit):
            sweep_module.SweepCheck().on_multirun_start(config=cfg)
    error = capsys.readouterr().err
    assert "2 of 2 points invalid" in error and error.count("needs CUDA GPUs and this machine has none") == 2


def test_slurm_launcher_takes_the_points_the_callback_checked(tmp_path, monkeypatch):
    """A valid Slurm sweep passes the callback; SlurmLauncher.launch's check_points then returns the
    same points, resources filled from the profile, without checking them again."""
    with multirun_config("hydra/launcher=slurm", *GPU_SWEEP, f"hydra.sweep.dir={tmp_path}/slurm") as (cfg, loader):
        sweep_module.SweepCheck().on_multirun_start(config=cfg)  # valid: returns
        overrides = sweep_module.sweep_points(cfg, loader)
        monkeypatch.setattr(sweep_module, "check_point", lambda *a: pytest.fail("a point was checked twice"))
        points = sweep_module.check_points(loader, cfg, overrides)
    assert [p["name"] for p in points] == [
        f"strategy=ddp hardware=dgx_a100_80g hardware.nodes={n} model=gpt_small data.global_batch_size=64"
        for n in (1, 2)]
    assert [(p["world"], p["resources"]["nodes"], p["resources"]["tasks_per_node"], p["resources"]["gpus_per_node"])
            for p in points] == [(8, 1, 8, 8), (16, 2, 8, 8)]
