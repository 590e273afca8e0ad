"""The GPU check (layerwise/tools/gpu_check.py, scripts/gpu_check.sh): its skip path on a machine without
CUDA, and its table, built here from real runs on CPU ranks (hardware=cpu). The runs go through
layerwise.run.fit.train in this process (what train.py calls after validating), not a train.py
subprocess per point, to keep the test fast; the table code reads the same summary.json."""

import json
import os
import subprocess
from pathlib import Path

from layerwise.tools import gpu_check
from layerwise.run.fit import train
from layerwise.preflight import validate
from tests.ranks import compose_config
from tests.tolerances import LOSS_RTOL

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.layers=2", "model.hidden=32", "model.heads=2", "data.sequence_length=32",
        "data.max_bytes=2000000"]


def test_the_script_skips_without_a_cuda_device(tmp_path):
    fake = tmp_path / "nvidia-smi"  # a driver that lists no GPU, whatever this machine has
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    environment = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    result = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True,
                            text=True, timeout=60, env=environment)
    assert result.returncode == 0 and result.stdout.strip() == "gpu_check: no CUDA device: skipped"


def test_the_module_skips_without_a_cuda_device(monkeypatch, capsys):
    monkeypatch.setattr("layerwise.run.launch.local_gpu_count", lambda: 0)
    assert gpu_check.main([]) == 0
    assert capsys.readouterr().out.strip() == gpu_check.SKIPPED_MESSAGE


def train_in_process(overrides, run_directory):
    cfg = compose_config(*overrides)
    return train(cfg, run_directory, validate(cfg))


def test_the_table_holds_what_the_summaries_say(tmp_path):
    rows = gpu_check.check(["ddp", "three_d"], [2], steps=2, hardware="cpu", directory=tmp_path,
                           extra=TINY, run=train_in_process, preflight=validate)
    assert [(row.strategy, row.ranks, row.status) for row in rows] == [
        ("single", 1, "completed"), ("ddp", 2, "completed"), ("three_d", 2, "skipped")]
    single = json.loads((tmp_path / "single-1" / "summary.json").read_text())
    ddp = json.loads((tmp_path / "ddp-2" / "summary.json").read_text())
    assert len(ddp["losses"]) == 2 and ddp["world_size"] == 2
    difference = max(abs(a - b) for a, b in zip(ddp["losses"], single["losses"]))
    assert rows[1].max_loss_difference == difference <= LOSS_RTOL * max(single["losses"])
    assert rows[1].step_time_s == ddp["step_time_s_median"]
    assert rows[1].allocator_peak_bytes is None is ddp["allocator_peak_bytes"]  # CUDA only
    assert rows[0].max_loss_difference == 0.0 and rows[0].step_time_s == single["step_time_s_median"]
    assert "needs data × 8 ranks" in rows[2].reason
    table = gpu_check.format_table(rows, tolerance=1e-3).splitlines()
    assert table[0].split() == ["strategy", "ranks", "max", "|Δloss|", "step", "time", "allocator",
                                "peak", "result"]
    assert table[3].split()[:3] == ["ddp", "2", f"{difference:.2e}"] and "equals single" in table[3]
    assert "skipped: strategy.tensor_grid=2" in table[4]


def test_pipefisher_is_compared_with_kfac_and_failures_keep_their_reason():
    completed = {"status": "completed", "losses": [5.0, 4.0], "world_size": 2,
                 "step_time_s_median": 0.5, "allocator_peak_bytes": 2.0 ** 20}
    kfac = {**completed, "losses": [5.0, 4.5]}
    calls = []

    def run(overrides, directory):
        calls.append(directory.name)
        return kfac if "strategy=kfac" in overrides else completed

    import tempfile
    with tempfile.TemporaryDirectory() as directory:
        rows = gpu_check.check(["pipefisher"], [2], 2, "cpu", Path(directory), run=run, preflight=validate)
    assert calls == ["single-1", "pipefisher-2", "kfac-1"]  # each reference runs once
    assert rows[1].reference == "kfac" and rows[1].max_loss_difference == 0.5
    assert not gpu_check.passed(rows[1], tolerance=1e-3)
    assert "DIFFERS from kfac" in gpu_check.format_table(rows, 1e-3)
    failed = gpu_check.row_of("ddp", 2, {"status": "failed", "error": "rank 1: boom"}, completed, "single")
    assert failed.status == "failed" and "failed: rank 1: boom" in gpu_check.format_table([failed], 1e-3)


def test_the_users_overrides_win_over_the_checks_defaults():
    overrides = gpu_check.point_overrides("ddp", 4, 10, "dgx_h100", ["hardware.precision=bf16-mixed"])
    assert "hardware.precision=bf16-mixed" in overrides and "hardware.precision=32-true" not in overrides
    assert {"strategy=ddp", "hardware=dgx_h100", "hardware.devices_per_node=4",
            "trainer.max_steps=10"} <= set(overrides)


def test_l2l_with_dropout_is_not_held_to_single_on_a_gpu():
    """L2L draws dropout masks from the CPU generator in single's order: equal to single on CPU,
    but on a GPU single draws from CUDA's generator (issue 37, item 10)."""
    from tests.ranks import compose_config

    def reason(*overrides):
        return gpu_check.incomparable(compose_config("strategy=l2l", *overrides))

    assert reason("hardware=dgx_h100", "model.dropout=0.1").startswith("model.dropout=0.1: l2l's masks")
    assert reason("hardware=dgx_h100") is None  # dropout 0, the check's default: comparable
    assert reason("model.dropout=0.1") is None  # on CPU both draw from the CPU generator (test_l2l.py)
    assert gpu_check.incomparable(compose_config("strategy=ddp", "hardware=dgx_h100")) is None
