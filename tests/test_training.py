"""Numerics and evidence of the plain strategies: ddp equals single; bytes equal the formula."""

import csv

import pytest

from layerwise.run.fit import train
from layerwise.preflight import validate
from strategies.checkpoint.per_rank import read_checkpoint_file
from tests.ranks import QUICK, compose_config
from tests.references import compare_under_sgd, tracing_optimizer
from tests.same_checkpoints import SAVED_AT_ANOTHER_HOOK, assert_same_checkpoints
from tests.tolerances import OptimizerTrace, assert_same_losses, assert_same_parameters

STEPS = 10


def run(tmp_path, name, *overrides):  # noqa: D103
    cfg = compose_config(*QUICK, f"trainer.max_steps={STEPS}", "trainer.val_check_interval=5",
                         *overrides)
    world = validate(cfg)
    directory = tmp_path / name
    summary = train(cfg, directory, world)
    return summary, directory


def final_parameters(directory):  # single and ddp write one file
    state = read_checkpoint_file(directory / "checkpoints" / "last.ckpt")["state_dict"]
    return {name.removeprefix("module."): value for name, value in state.items()}


def metrics(directory):
    with (directory / "metrics.csv").open() as handle:
        return list(csv.DictReader(handle))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    # every step measured: the schema test reads peak_compute_bytes on every row
    directory = tmp_path_factory.mktemp("single")
    with tracing_optimizer(directory / "single"):
        return run(directory, "single", "strategy=single", "trainer.measure_every_n_steps=1")


def test_ddp_reproduces_single(reference, tmp_path):
    single_summary, single_directory = reference
    ddp_summary, ddp_directory = run(tmp_path, "ddp", "strategy=ddp")
    assert ddp_summary["status"] == "completed" and ddp_summary["world_size"] == 2
    assert_same_losses(ddp_summary["losses"], single_summary["losses"])
    assert_same_parameters(final_parameters(ddp_directory), final_parameters(single_directory),
                           OptimizerTrace.load(single_directory))


@pytest.mark.parametrize("case", ["ddp_dp2", "llama_ddp_dp2"])
def test_ddp_equals_single_under_sgd(case, tmp_path, tmp_path_factory):
    """Plain SGD sees the gradient's scale, which AdamW normalises away (references.SgdComparison):
    losses, the first step's gradients and the parameters after references.SGD_STEPS steps."""
    compare_under_sgd(case, tmp_path, tmp_path_factory).check()


def test_ddp_communication_equals_the_ring_formula(tmp_path):
    summary, directory = run(tmp_path, "ddp", "strategy=ddp", "trainer.max_steps=3")
    parameters = sum(p.numel() for p in final_parameters(directory).values())
    expected = 2 * (2 - 1) / 2 * parameters * 4  # 2(n-1)/n · P · bytes, n = 2, fp32
    rows = metrics(directory)
    assert [float(r["comm_bytes_all_reduce"]) for r in rows] == [expected] * 3
    assert summary["comm_bytes_per_step"]["all_reduce"] == expected
    assert summary["comm_bytes_per_step"]["send_recv"] == 0.0


def test_single_run_is_bit_identical_on_rerun(reference, tmp_path):
    again, _ = run(tmp_path, "single", "strategy=single")
    assert again["losses"] == reference[0]["losses"]


def test_evidence_files_follow_the_schema(reference):
    summary, directory = reference
    for key in ("status", "strategy", "model", "hardware", "data", "world_size", "layout", "steps",
                "tokens_per_step", "losses", "initial_val_loss", "final_val_loss",
                "final_train_loss", "step_time_s_median", "tokens_per_s_median",
                "comm_bytes_per_step", "peak_compute_bytes", "versions", "git_sha", "mfu",
                "tokens_per_s_per_device"):
        assert key in summary, key
    assert summary["steps"] == STEPS and len(summary["losses"]) == STEPS
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    rows = metrics(directory)
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    assert [r["val_loss"] != "" for r in rows] == [s in (5, 10) for s in range(1, STEPS + 1)]
    assert all(float(r["peak_compute_bytes"]) > 0 for r in rows)


@pytest.mark.smoke  # also under torch 2.11 (make smoke-torch211): one resume
def test_resume_continues_bit_identically(reference, tmp_path):
    """Stop after 4 steps, rerun with 10: steps 5-10 equal the uninterrupted run."""
    cfg_overrides = ["strategy=single", "trainer.checkpoint_every_n_steps=2"]
    first, directory = run(tmp_path, "resumed", *cfg_overrides, "trainer.max_steps=4")
    assert first["steps"] == 4
    cfg = compose_config(*QUICK, f"trainer.max_steps={STEPS}", "trainer.val_check_interval=5",
                         *cfg_overrides)
    resumed = train(cfg, directory, 1)
    assert resumed["losses"][4:] == reference[0]["losses"][4:]
    # weights, Adam state, scheduler (the reference saved at the end of training, this run after step 10)
    assert_same_checkpoints(directory, reference[1], skip=SAVED_AT_ANOTHER_HOOK)
    assert [int(r["step"]) for r in metrics(directory)] == list(range(1, STEPS + 1))


@pytest.mark.parametrize("logger,produced", [("csv", "csv_logs"), ("tensorboard", "tensorboard")])
def test_file_loggers_receive_the_metrics(tmp_path, logger, produced):
    summary, directory = run(tmp_path, logger, "strategy=single", "trainer.max_steps=2",
                             f"logger={logger}")
    assert summary["status"] == "completed"
    files = [p for p in (directory / produced).rglob("*") if p.is_file()]
    assert files and any(p.stat().st_size > 0 for p in files)
