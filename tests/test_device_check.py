"""The GPU node's first check (scripts/device_check.sh, layerwise/tools/device_check.py), proven on CPU.

The end-to-end test runs the script as the GPU node will, with `--cpu --subset` (one row or a skip per
section, tiny sizes), and reads the JSON it wrote: each number is compared with the run files it came
from (summary.json, plan.json), not with an exit code. The fast tests hold the row logic (goals,
failures, the time budget, a section that raises) on made-up summaries."""

import json
import math
import subprocess
from pathlib import Path

import pytest

from layerwise.tools import device_check
from layerwise.tools.device_check import CPU, FP32_LOSS_RTOL, SECTIONS, Row

ROOT = Path(__file__).resolve().parent.parent


def completed(losses, **fields):
    return {"status": "completed", "losses": losses, "precision": "32-true", **fields}


def test_rows_hold_losses_to_their_reference_and_name_failures():
    reference = completed([5.0, 4.0])
    equal = device_check.compared("equality", "ddp", completed([5.0, 4.0 * (1 + FP32_LOSS_RTOL / 2)]), reference,
                                  FP32_LOSS_RTOL, "single")
    assert equal.status == "ok" and equal.value == pytest.approx(FP32_LOSS_RTOL / 2)
    differs = device_check.compared("equality", "ddp", completed([5.0, 4.1]), reference, FP32_LOSS_RTOL, "single")
    assert differs.status == "missed" and differs.value == pytest.approx(0.1 / 4.0)
    short = device_check.compared("equality", "ddp", completed([5.0]), reference, FP32_LOSS_RTOL, "single")
    assert short.status == "missed" and math.isinf(short.value)
    wrong_precision = device_check.compared("precision", "bf16", completed([5.0, 4.0]), reference, 1e-2, "single",
                                            precision="bf16-mixed")
    assert wrong_precision.status == "missed"  # equal losses, but autocast did not run: not bf16
    broken = device_check.compared("equality", "ddp", {"status": "failed", "error": "rank 0: boom"}, reference,
                                   FP32_LOSS_RTOL, "single")
    assert broken.status == "failed" and broken.detail == "ddp: rank 0: boom"


def test_a_failed_runs_reason_is_its_exception_not_hydras_hint():
    output = ("Error executing job with overrides: ['strategy=kfac']\nTraceback (most recent call last):\n"
              "  File \"train.py\", line 90, in main\nImportError: cannot import name 'x' from 'y'\n"
              "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.\n")
    assert device_check.last_error(output) == "ImportError: cannot import name 'x' from 'y'"
    assert device_check.last_error("no exception\nlast line\n") == "last line"


def test_speed_and_plan_rows_compute_their_ratios_from_the_runs():
    ours = {"status": "completed", "tokens_per_s_median": 900.0, "mfu": 0.45, "step_time_s_median": 0.2}
    plain = {"status": "completed", "tokens_per_s": 1000.0, "flops_per_token": 1e6, "step_s": 0.18,
             "parameters": 2e6, "batch": 4, "sequence": 8, "precision": "bf16-mixed", "peak_bytes": None}
    row = device_check.speed_row("gpt_small", ours, plain)
    assert row.status == "missed" and row.value == pytest.approx(0.9)
    # both MFUs against the peak the run's summary implies: 900 tokens/s × 1e6 FLOPs / 0.45 = 2e9 FLOP/s
    assert row.numbers["peak_flops"] == pytest.approx(2e9) and row.numbers["plain_mfu"] == pytest.approx(0.5)
    planned = {"status": "completed", "step_time_s": 0.11, "roles": [{"peak_compute_bytes": 96.0},
                                                                   {"peak_compute_bytes": 104.0}]}
    measured = {"status": "completed", "step_time_s_median": 0.1, "allocator_peak_bytes": 100.0,
                "peak_compute_bytes": 90.0}
    step, memory = device_check.plan_rows("single", planned, measured, CPU)
    assert step.status == "ok" and step.value == pytest.approx(1.1)
    assert memory.status == "ok" and memory.value == pytest.approx(1.04)  # the largest role
    off_gpu = device_check.plan_rows("single", planned, {**measured, "allocator_peak_bytes": None}, CPU)[1]
    assert off_gpu.status == "skipped" and off_gpu.detail.startswith("CUDA only")


def test_a_section_that_raises_or_finds_no_time_leaves_a_row_and_the_next_runs(tmp_path):
    def broken(*arguments):
        raise RuntimeError("a typo")

    def fine(mode, budget, report, subset, directory):
        return [Row("speed", "fine", "ok", 1.0)]
    functions = {**device_check.SECTION_FUNCTIONS, "equality": broken, "speed": fine}
    rows = device_check.check(tmp_path, CPU, ["equality", "speed"], functions=functions)
    assert [(row.section, row.status) for row in rows] == [("equality", "failed"), ("speed", "ok")]
    assert rows[0].detail == "RuntimeError: a typo"
    written = json.loads((tmp_path / "device_check.json").read_text())
    assert [row["status"] for row in written["rows"]] == ["failed", "ok"]
    rows = device_check.check(tmp_path / "late", CPU, ["speed"], budget_s=5, functions=functions)
    assert rows[0].status == "skipped" and rows[0].detail.startswith("time budget")


def read_summary(directory: Path) -> dict:
    return json.loads((directory / "summary.json").read_text())


@pytest.mark.slow
def test_the_cpu_subset_runs_every_section_end_to_end(tmp_path):
    """~1 minute alone (8 subprocesses): the script as the GPU node runs it, on the cpu profile."""
    result = subprocess.run([str(ROOT / "scripts" / "device_check.sh"), "--cpu", "--subset", str(tmp_path)],
                            capture_output=True, text=True, timeout=900)
    document = json.loads((tmp_path / "device_check.json").read_text())
    rows = {(row["section"], row["name"]): row for row in document["rows"]}
    assert document["mode"] == "cpu" and {row["section"] for row in document["rows"]} == set(SECTIONS), result.stdout
    assert document["environment"]["device"].startswith("CPU") and document["environment"]["matmul_tflops"] > 0

    # single on the checked device against single on the CPU: here the same device, so equal to the bit
    equality = rows["equality", "single device"]
    runs = tmp_path / "runs" / "equality"
    device, cpu = read_summary(runs / "single-device"), read_summary(runs / "single-cpu")
    assert equality["status"] == "ok" and len(device["losses"]) == 4
    assert equality["numbers"]["losses"] == device["losses"] and equality["numbers"]["reference_losses"] == cpu["losses"]
    assert equality["value"] == max(abs(a - b) / abs(b) for a, b in zip(device["losses"], cpu["losses"])) <= FP32_LOSS_RTOL

    scaler = rows["precision", "agreed scaler skips an injected inf"]
    assert scaler["status"] == "ok" and "scale 65536 → 32768" in scaler["detail"]

    speed = rows["speed", "gpt_small: ours / plain loop"]
    ours = read_summary(tmp_path / "runs" / "speed" / "gpt_small")
    assert speed["status"] in ("ok", "missed")  # a ratio on 2 shared cores is no verdict on a GPU
    assert speed["numbers"]["ours_tokens_per_s"] == ours["tokens_per_s_median"]
    assert speed["value"] == pytest.approx(ours["tokens_per_s_median"] / speed["numbers"]["plain_tokens_per_s"])

    plan = rows["plan", "single gpt_tiny: predicted / measured step"]
    planned = json.loads((tmp_path / "runs" / "plan" / "single-gpt_tiny" / "plan" / "plan.json").read_text())
    measured = read_summary(tmp_path / "runs" / "plan" / "single-gpt_tiny" / "run")
    assert plan["status"] in ("ok", "missed")
    assert plan["value"] == pytest.approx(planned["step_time_s"] / measured["step_time_s_median"])
    memory = rows["plan", "single gpt_tiny: predicted / allocator peak"]
    assert memory["status"] == "skipped" and memory["detail"].startswith("CUDA only")

    for section in ("precision", "held_out"):  # the parts --subset leaves out say so
        assert any(row["status"] == "skipped" and row["detail"] == "--subset"
                   for (name, _), row in rows.items() if name == section)
    table = (tmp_path / "results.md").read_text().splitlines()
    assert table[0] == "# device_check (cpu mode): " + document["environment"]["device"]
    assert sum(line.startswith("| ") for line in table) == len(document["rows"]) + 1  # header + a line per row
