"""mode=plan for strategy=pipefisher (layerwise/planning/pipefisher.py, cost/kfac.py): the
pipeline's bytes plus K-FAC's, and the step of the K-FAC units packed into the bubbles, priced by
the same code the paper-scale reproduction uses."""

import json
import sys
from pathlib import Path

import pytest

from layerwise.planning.result import plan_result
from layerwise.run.task import model_arguments
from layerwise.config.errors import ConfigError
from layerwise.preflight import validate
from models import build_model
from cost.kfac import factor_dimensions
from strategies.kfac import KFAC, block_linears
from strategies.stages import keep_local_stages
from tests.ranks import compose_config
from tests.warm_python import python

ROOT = Path(__file__).resolve().parent.parent
SHAPE = ["logger=none", "model=gpt_tiny", "model.layers=4", "strategy.pipeline_degree=2",
         "strategy.layers_per_stage=2", "strategy.micro_batches=4", "data.global_batch_size=16"]
LAYOUT = ["mode=plan", *SHAPE]


def planned(*overrides):
    cfg = compose_config(*LAYOUT, *overrides)
    return cfg, plan_result(cfg, validate(cfg))


def allocated_factor_bytes(cfg, stage: int) -> int:
    """What strategies/kfac.py allocates for one stage's factors: KFAC built on that stage's blocks
    of the real model (on the meta device: shapes and dtypes, no data)."""
    model = build_model(cfg.model.architecture, device="meta", **model_arguments(cfg.model, 256, cfg.seed))
    keep_local_stages(model, [stage], cfg.strategy.pipeline_degree, cfg.strategy.layers_per_stage)
    kfac = KFAC(block_linears(model), damping=1e-3)
    return sum(matrix.numel() * matrix.element_size() for pair in kfac.factors.values() for matrix in pair.values())


def test_kfac_bytes_are_the_factors_and_inverses_by_hand_plus_what_passes_at_the_stash_peak():
    # k = 1: every unit runs in the step that captured its a, g, so no capture outlives its step
    cfg, result = planned("strategy=pipefisher", "strategy.refresh_interval=1")
    h, wide = cfg.model.hidden, cfg.model.mlp_ratio * cfg.model.hidden
    per_block = (h * h + 9 * h * h) + (h * h + h * h) + (h * h + wide * wide) + (wide * wide + h * h)
    factors = 2 * per_block * 4  # two blocks per stage, fp32
    for role in result["roles"]:
        kfac = role["kfac_bytes"]
        assert allocated_factor_bytes(cfg, role["pipeline_ranks"][0]) == factors
        assert (kfac["factors"], kfac["inverses"], kfac["captures"]) == (factors, factors, 0)
        assert kfac["fresh_inverses"] <= factors and kfac["inversion_workspace"] <= 4 * wide * wide * 8
        assert role["memory_bytes"]["kfac"] == sum(kfac.values())
    # GPipe's last rank has no bubble at its stash peak (its forwards run back to back into its backwards)
    assert result["roles"][1]["kfac_bytes"]["fresh_inverses"] == result["roles"][1]["kfac_bytes"]["inversion_workspace"] == 0


def test_captures_are_held_only_when_units_run_in_a_later_step():
    cfg, result = planned("strategy=pipefisher")
    assert result["refresh_interval_fit"] > 1
    tokens = cfg.data.global_batch_size // cfg.strategy.micro_batches * cfg.data.sequence_length
    h, wide = cfg.model.hidden, cfg.model.mlp_ratio * cfg.model.hidden
    # at most every micro-batch's a (inputs h, h, h, wide) and g (outputs 3h, h, wide, h) of both blocks
    everything = cfg.strategy.micro_batches * 2 * tokens * (3 * h + wide + 5 * h + wide) * 4
    assert all(0 < role["kfac_bytes"]["captures"] <= everything for role in result["roles"])


def test_other_kinds_are_the_same_layouts_modular_pipeline_plan():
    _, ours = planned("strategy=pipefisher")
    _, theirs = planned("strategy=modular_pipeline", "strategy.schedule=gpipe")
    assert [role["pipeline_ranks"] for role in ours["roles"]] == [role["pipeline_ranks"] for role in theirs["roles"]]
    for mine, first_order in zip(ours["roles"], theirs["roles"]):
        assert {k: v for k, v in mine["memory_bytes"].items() if k != "kfac"} == first_order["memory_bytes"]
    assert ours["step_time_first_order_s"] == theirs["step_time_s"]
    assert ours["bubble_fraction_first_order"] == theirs["bubble_fraction"] > ours["bubble_fraction"]


def test_step_is_the_reproduction_modules_schedule_row():
    from layerwise.reproduce.pipefisher import schedule_row
    cfg, result = planned("strategy=pipefisher")
    first_order = compose_config(*LAYOUT, "strategy=gpipe")
    row = schedule_row(first_order, validate(first_order))
    assert result["step_time_s"] == row["step_pipefisher_s"] > row["step_first_order_s"]
    assert (result["refresh_interval"], result["kfac_work_per_bubble"]) == (row["k_needed"], row["kfac_work_per_bubble"])


def test_a_1d_grid_splits_one_factor_of_each_linear():
    from cost.inputs import Workload
    from cost.inputs import GptShape
    from parallel.dims import Layout
    workload = Workload(GptShape(hidden=64, mlp_ratio=4, vocabulary=256, length=16, max_length=16), layers=2,
                        heads=4, layout=Layout(1, 2, "1d", 4), layers_per_stage=1, micro_batch_rows=2)
    # qkv, fc_in column-parallel (their outputs split: B); proj, fc_out row-parallel (inputs split: A)
    assert factor_dimensions(workload) == {"q": ((64, 48),), "p": ((16, 64),), "i": ((64, 64),), "o": ((64, 64),)}


def test_train_py_mode_plan_strategy_pipefisher(tmp_path):
    result = python([sys.executable, "train.py", *LAYOUT, "strategy=pipefisher", f"hydra.run.dir={tmp_path}"],
                            cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "kfac" in result.stdout and "PipeFisher: first-order step" in result.stdout
    written = json.loads((tmp_path / "plan.json").read_text())
    assert written["strategy"] == "pipefisher" and written["refresh_interval"] >= 1
    assert written["step_time_s"] >= written["step_time_first_order_s"] > 0
    assert all(role["memory_bytes"]["kfac"] > 0 for role in written["roles"])
    assert (tmp_path / "plan.png").stat().st_size > 10_000 and (tmp_path / "plan_memory.png").stat().st_size > 5_000



def test_check_refuses_a_layout_whose_kfac_bytes_do_not_fit():
    _, result = planned("strategy=pipefisher")
    worst = max(result["roles"], key=lambda role: role["peak_with_margin_bytes"])
    first_order = worst["peak_with_margin_bytes"] * (1 - worst["memory_bytes"]["kfac"] / sum(worst["memory_bytes"].values()))
    limit = int((first_order + worst["peak_with_margin_bytes"]) / 2)  # the pipeline fits, with K-FAC it does not
    cfg = compose_config(*SHAPE, "mode=check", "strategy=pipefisher", f"hardware.device_memory_bytes={limit}")
    with pytest.raises(ConfigError) as error:
        validate(cfg)
    assert f"{worst['role']} needs" in str(error.value) and "kfac" in str(error.value)
    validate(compose_config(*SHAPE, "mode=check", "strategy=gpipe", f"hardware.device_memory_bytes={limit}"))


def test_predicted_peak_memory_is_within_5_percent_of_a_measured_pipefisher_run(tmp_path):
    """GPipe p2 m4, K-FAC packed into 7 steps: the peak comes in the cycle's second step, when the
    captures of units packed into later steps sit on top of a full stash (the meter counts K-FAC's
    factors and inverses as resident: PipeFisherStrategy.compute_resident_tensors)."""
    from layerwise.planning.mode import plan
    from layerwise.run.fit import train
    common = ["logger=none", "trainer.progress=none", "trainer.limit_val_batches=0", "model.layers=8",
              "strategy=pipefisher", "strategy.layers_per_stage=4"]
    cfg = compose_config(*common, "mode=plan")
    result = plan(cfg, validate(cfg), tmp_path / "plan")
    predicted = max(sum(role["memory_bytes"].values()) for role in result["roles"])
    assert result["refresh_interval_fit"] > 2 and max(role["kfac_bytes"]["captures"] for role in result["roles"]) > 0
    cfg = compose_config(*common, "trainer.max_steps=3", "trainer.measure_every_n_steps=1")
    measured = train(cfg, tmp_path / "run", validate(cfg))["peak_compute_bytes"]
    print(f"predicted {predicted / 2**20:.2f} MiB, measured {measured / 2**20:.2f} MiB")
    assert 0.97 <= predicted / measured <= 1.05
