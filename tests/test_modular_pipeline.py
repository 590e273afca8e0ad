"""ModularPipelineStrategy and its comparators equal the single-process reference.

Test ids: pp{p}_v{v}_m{m} = pipeline degree p, v loops (stages per rank), m micro-batches;
dp{n} = n data-parallel replicas.
"""

import json

import pytest

from layerwise.run.fit import train
from layerwise.config.errors import ConfigError
from layerwise.preflight import validate
from tests.ranks import QUICK, compose_config
from tests.references import cached_references, compare_under_sgd, consolidated_parameters
from tests.same_checkpoints import assert_same_checkpoints
from tests.tolerances import OptimizerTrace, assert_same_losses, assert_same_parameters

STEPS = 5


def run(directory, *overrides, steps=STEPS):
    cfg = compose_config(*QUICK, f"trainer.max_steps={steps}", "trainer.val_check_interval=5",
                         *overrides)
    return train(cfg, directory, validate(cfg))


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return cached_references(tmp_path_factory, run)


CASES = {
    "pp2_v1_m2": ("modular_pipeline", 2, 2, 2, 1, ["strategy.pipeline_degree=2"]),
    "pp2_v2_m4": ("modular_pipeline", 4, 4, 2, 1, ["strategy.pipeline_degree=2"]),
    "pp4_v2_m4": ("modular_pipeline", 8, 4, 4, 1, ["strategy.pipeline_degree=4"]),
    "pp2_dp2_v2_m4": ("modular_pipeline", 4, 4, 4, 1, ["strategy.pipeline_degree=2"]),
    "gpipe_pp2_m4": ("gpipe", 4, 4, 2, 2, []),
    "one_f_one_b_pp2_m4": ("one_f_one_b", 4, 4, 2, 2, []),
    "zero_bubble_h1_pp2_m4": ("one_f_one_b", 4, 4, 2, 2, ["strategy.schedule=zero_bubble_h1"]),
    "zero_bubble_h1_pp4_m8": ("one_f_one_b", 4, 8, 4, 1, ["strategy.schedule=zero_bubble_h1",
                                                          "strategy.pipeline_degree=4"]),
    "zero_bubble_h2_pp2_m4": ("one_f_one_b", 4, 4, 2, 2, ["strategy.schedule=zero_bubble_h2"]),
    "zero_bubble_h2_pp4_m8": ("one_f_one_b", 4, 8, 4, 1, ["strategy.schedule=zero_bubble_h2",
                                                          "strategy.pipeline_degree=4"]),
    "zbv_pp2_m4": ("one_f_one_b", 4, 4, 2, 1, ["strategy.schedule=zbv"]),
    "zbv_pp4_m8": ("one_f_one_b", 8, 8, 4, 1, ["strategy.schedule=zbv", "strategy.pipeline_degree=4"]),
    "interleaved_pp2_v2_m4": ("interleaved_1f1b", 4, 4, 2, 1, []),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_equals_single(case, references, tmp_path):
    strategy, layers, micro_batches, ranks, per_stage, extra = CASES[case]
    expected, reference_directory = references(layers)
    summary = run(tmp_path, f"strategy={strategy}", f"model.layers={layers}",
                  f"strategy.micro_batches={micro_batches}", f"hardware.devices_per_node={ranks}",
                  f"strategy.layers_per_stage={per_stage}", *extra)
    assert summary["status"] == "completed" and summary["world_size"] == ranks
    assert_same_losses(summary["losses"], expected["losses"])
    assert_same_parameters(consolidated_parameters(tmp_path, strategy),
                           consolidated_parameters(reference_directory, "single"),
                           OptimizerTrace.load(reference_directory))


@pytest.mark.parametrize("case", ["modular_pipeline_pp2_v2_m4", "modular_pipeline_pp2_dp2_v2_m4", "gpipe_pp2_m4",
                                  "one_f_one_b_pp2_m4", "zero_bubble_h1_pp2_m4", "zero_bubble_h1_pp4_m8",
                                  "zero_bubble_h1_pp2_dp2_m4", "zero_bubble_h1_pp2_p2_m4",
                                  "zero_bubble_h2_pp2_m4", "zero_bubble_h2_pp4_m8",
                                  "zbv_pp2_m4", "zbv_pp4_m8", "zbv_pp2_p2_m4", "interleaved_1f1b_pp2_v2_m4",
                                  "llama_interleaved_1f1b_pp2_v2_m4"])
def test_pipeline_equals_single_under_sgd(case, tmp_path, tmp_path_factory):
    """Plain SGD sees the gradient's scale, which AdamW normalises away (references.SgdComparison):
    losses, the first step's gradients and the parameters after references.SGD_STEPS steps."""
    compare_under_sgd(case, tmp_path, tmp_path_factory).check()


def test_executed_order_equals_the_plan_and_evidence_is_written(tmp_path):
    summary = run(tmp_path, "strategy=modular_pipeline", "model.layers=4", "trainer.charts=true")
    order = json.loads((tmp_path / "schedule.json").read_text())
    assert order["executed_last_step"] == order["plan"]
    assert order["plan"][0][0] == "0F0" and order["plan"][1][0] == "1F0←0"
    bubble = summary["bubble_fraction"]
    assert 0 < bubble["simulated"] < 1 and 0 <= bubble["measured"] < 1
    assert (tmp_path / "schedule_planned.png").stat().st_size > 10_000
    assert (tmp_path / "schedule_executed.png").stat().st_size > 10_000
    # v·m activations of b·s·h fp32 forward and as many gradients back, per rank (docs/strategies/modular_pipeline.md):
    # here rank 0 sends stage 0 → 1 and 2 → 3 forward and stage 2 → 1 backward.
    activation = 8 // 4 * 32 * 32 * 4  # micro-batch 2 sequences × 32 tokens × 32 wide × 4 bytes
    assert summary["comm_bytes_per_step"]["send_recv"] == 3 * 4 * activation


def test_resume_is_bit_identical(tmp_path):
    overrides = ["strategy=modular_pipeline", "model.layers=4", "trainer.checkpoint_every_n_steps=3"]
    whole = run(tmp_path / "whole", *overrides, steps=6)
    run(tmp_path / "resumed", *overrides, steps=3)
    assert (tmp_path / "resumed" / "checkpoints" / "last.ckpt" / "rank1.pt").exists()
    resumed = run(tmp_path / "resumed", *overrides, steps=6)
    assert resumed["losses"] == whole["losses"]
    assert consolidated_parameters(tmp_path / "resumed", "modular_pipeline").keys() == \
        consolidated_parameters(tmp_path / "whole", "modular_pipeline").keys()
    assert_same_checkpoints(tmp_path / "resumed", tmp_path / "whole")  # every rank: weights, Adam state


BAD = [
    (["strategy.micro_batches=1", "model.layers=4"], "must be >= strategy.pipeline_degree"),
    (["model.layers=3", "strategy.layers_per_stage=2"], "model.layers=3 is not divisible by strategy.layers_per_stage"),
    (["model.layers=3"], "model.layers=3 makes 3 stages"),
    (["strategy.pipeline_degree=3"], "strategy.pipeline_degree=3 does not divide the world size 2"),
    (["strategy.schedule=zigzag"], "strategy.schedule='zigzag' is unknown"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[m[:28] for _, m in BAD])
def test_bad_pipeline_input_fails_before_launch(overrides, message):
    with pytest.raises(ConfigError, match=None) as caught:
        validate(compose_config("strategy=modular_pipeline", *overrides))
    assert message in str(caught.value)
