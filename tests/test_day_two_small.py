"""Issue 55, item 8's smaller defects: the ETA after a resume, what mode=check shows and keeps, a
search's run directory name, and plan_memory.png for small models."""

import json
import re
import sys
from pathlib import Path

import pytest

from layerwise.config.store import compose
from layerwise.planning.render import CAPACITY_IN_VIEW, memory_figure
from layerwise.planning.result import plan_result
from layerwise.preflight import validate
from layerwise.run.console import Eta
from tests.warm_python import python

ROOT = Path(__file__).resolve().parent.parent
GIB, MIB = 2 ** 30, 2 ** 20


class FakeClock:
    """A clock the test moves by hand: the ETA is arithmetic on its readings, no wall time."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ----- (a) the ETA after a resume

def test_the_eta_divides_this_process_time_by_this_process_steps():
    """Resumed at step 25 of 100, a first step of 3 s (one-off costs), then four of 0.1 s: 70 steps
    left take 7 s (the old formula, this process's time over the global step count, said
    3.4 s / 30 steps × 70 = 7.9 s here, and 2 s in the issue's run where the first step was quick)."""
    clock = FakeClock()
    eta = Eta(clock)
    assert eta.describe(75) == "eta ?"  # nothing measured yet
    eta.start()
    assert eta.seconds_left(75) is None
    clock.now += 3.0
    eta.step()
    assert eta.seconds_left(74) == pytest.approx(3.0 * 74)  # the first step's time alone until a second ends
    for _ in range(4):
        clock.now += 0.1
        eta.step()
    assert eta.seconds_left(70) == pytest.approx(7.0)
    assert eta.describe(70) == "eta 7 s"
    assert eta.seconds_left(0) == 0.0
    eta.start()  # a second start (another resume in one process): the earlier steps no longer count
    clock.now += 5.0
    eta.step()
    assert eta.seconds_left(2) == pytest.approx(10.0)


def test_the_eta_reads_in_hours_past_an_hour():
    clock = FakeClock()
    eta = Eta(clock)
    eta.start()
    clock.now += 2.0
    eta.step()
    assert eta.describe(1000) == "eta 2000 s"
    assert eta.describe(3000) == "eta 1 h 40 min"


def test_a_resumed_runs_progress_line_uses_this_process_steps(tmp_path, capsys):
    """RunEvidence's progress line after a resume: 30 steps restored from the checkpoint, 5 run here
    at 0.2 s each; at step 35 of 100 the line says 65 × 0.2 = 13 s (the old formula: 1 s / 35 × 65 = 2 s)."""
    from layerwise.run.evidence import RunEvidence
    cfg = compose(["logger=none", "debug=fast", "trainer.max_steps=100"])
    evidence = RunEvidence(tmp_path, cfg, 1, {}, progress_lines=True)
    evidence._is_global_zero = True
    evidence.history["losses"] = [3.0] * 30  # load_state_dict's restored history
    clock = FakeClock()
    evidence._eta = Eta(clock)
    evidence._eta.start()
    for _ in range(5):
        clock.now += 0.2
        evidence._eta.step()
        evidence.history["losses"].append(3.0)
    evidence._progress({"step": 35, "loss": 3.0, "lr": 1e-3, "step_time_s": 0.2, "tokens_per_s": 640.0})
    assert capsys.readouterr().out.strip().endswith("640 tokens/s eta 13 s")


# ----- (b) mode=check shows and keeps the memory fit it checked

def test_mode_check_prints_each_roles_memory_fit_and_keeps_it_in_check_json(tmp_path):
    run = tmp_path / "run"
    result = python([sys.executable, "train.py", "mode=check", "logger=none", f"hydra.run.dir={run}"],
                    cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    cfg = compose(["mode=plan", "logger=none"])
    plan = plan_result(cfg, validate(cfg))  # plan mode's numbers for the same layout
    lines = [line for line in result.stdout.splitlines() if line.startswith("[layerwise] memory: ")]
    assert len(lines) == len(plan["roles"]) == 2, result.stdout
    for line, role in zip(lines, plan["roles"]):
        total = f"{role['peak_with_margin_bytes'] / MIB:.3g} MiB"
        assert re.fullmatch(rf"\[layerwise\] memory: {re.escape(role['role'])} {re.escape(total)} of 7.45 GiB "
                            r"per device \(plan mode's bytes \+ 10% allocator margin\): fits", line), line
    assert "[layerwise] memory lower bound (fp32 weights, gradients and adamw state sharded over 2 rank(s)):" \
        in result.stdout
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == \
        ["check.json", "config.yaml", "train.log"]
    kept = json.loads((run / "check.json").read_text())
    assert kept["status"] == "valid" and kept["world_size"] == 2
    assert kept["memory"]["device_memory_bytes"] == cfg.hardware.device_memory_bytes
    assert [(r["role"], r["peak_with_margin_bytes"], r["fits"]) for r in kept["memory"]["roles"]] == \
        [(r["role"], r["peak_with_margin_bytes"], r["fits"]) for r in plan["roles"]]
    assert kept["memory"]["lower_bound"]["needed_per_rank_bytes"] > 0


def test_mode_check_names_a_strategy_plan_mode_does_not_price(tmp_path):
    """fsdp2 has no per-role plan: the line says so, and the lower bound is still shown and kept."""
    from layerwise.planning.mode import check
    cfg = compose(["mode=check", "logger=none", "strategy=fsdp2"])
    lines = check(cfg, validate(cfg), tmp_path)
    assert lines[0] == "memory: no per-role plan (strategy=fsdp2: mode=plan does not price it)"
    assert lines[1].startswith("memory lower bound") and lines[1].endswith(": fits")
    assert "roles" not in json.loads((tmp_path / "check.json").read_text())["memory"]


# ----- (c) a search's run directory

def test_a_search_run_directory_is_named_search_not_after_the_default_strategy(tmp_path):
    result = python([sys.executable, str(ROOT / "train.py"), "mode=plan", "plan.search=true", "logger=none",
                     "model=gpt_small", "hardware=dgx_a100_80g", "hardware.nodes=2", "hardware.device_memory_bytes=2e8",
                     "data.global_batch_size=32", "data.sequence_length=128", "plan.search_replan=0"],
                    cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["search-gpt_small-dgx_a100_80g"]
    assert (tmp_path / "runs" / "search-gpt_small-dgx_a100_80g" / "plan_search.csv").is_file()
    # a plan of one layout, and a fit, keep the strategy's name
    assert compose(["mode=plan", "strategy=ddp"]).run_name == "ddp-gpt_tiny-cpu"
    assert compose(["plan.search=true"]).run_name == "modular_pipeline-gpt_tiny-cpu"  # not a plan: no search


# ----- (d) plan_memory.png reads at any scale

def _plan(*overrides):
    cfg = compose(["mode=plan", "logger=none", *overrides])
    return cfg, plan_result(cfg, validate(cfg))


def _largest(plan) -> float:
    return max(sum(role["memory_bytes"].values()) for role in plan["roles"])


def test_plan_memory_chart_of_a_small_model_scales_to_its_bars(tmp_path):
    """gpt_tiny's roles take ~45 MiB of a 7.45 GiB device: the axis is in MiB and ends within 2× the
    largest bar (it ended at 7.1 GiB, 168× the bar); the device's memory is stated in the title."""
    cfg, plan = _plan()
    figure = memory_figure(plan, cfg.hardware.device_memory_bytes)
    axes = figure.axes[0]
    largest = _largest(plan) / MIB
    assert axes.get_xlabel() == "MiB per device"
    assert largest < axes.get_xlim()[1] <= 2 * largest
    assert "device memory less the allocator margin: 6.77 GiB" in axes.get_title()
    assert not axes.lines  # no capacity line far off the bars
    figure.savefig(tmp_path / "plan_memory.png")


def test_plan_memory_chart_draws_the_device_line_when_it_is_near_the_bars():
    """gpt3_175b on 128 A100s (README's mode=check example): 43.2 GiB roles against 67.7 GiB usable:
    the axis is in GiB and ends just past the device line."""
    cfg, plan = _plan("model=gpt3_175b", "data.sequence_length=2048", "hardware=dgx_a100_80g", "hardware.nodes=16",
                      "data.global_batch_size=256", "strategy=zero_layered", "strategy.tensor_parallel=2d",
                      "strategy.tensor_grid=2", "strategy.micro_batches=2", "strategy.activation_recompute=full")
    capacity = cfg.hardware.device_memory_bytes / (1 + plan["allocator_margin"])
    assert capacity <= CAPACITY_IN_VIEW * _largest(plan)
    axes = memory_figure(plan, cfg.hardware.device_memory_bytes).axes[0]
    assert axes.get_xlabel() == "GiB per device"
    assert [line.get_xdata()[0] for line in axes.lines] == [pytest.approx(capacity / GIB)]
    assert capacity / GIB < axes.get_xlim()[1] <= 1.05 * capacity / GIB
