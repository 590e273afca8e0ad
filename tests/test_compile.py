"""trainer.compile=true (issue 59): each block compiled once, equal to eager, no graph after the first step.

Every comparison is tests/references.py's SGD oracle against an eager run: the losses of every step,
the first step's gradient (recovered from the weights after step 1) and the parameters after the
last, at the eager tolerances (tests/tolerances.py: compiled kernels reorder a few fp32 sums, ~1e-7
relative, inside LOSS_RTOL/GRADIENT_RTOL = 1e-5). The families: the whole model (single, with
dropout and full recomputation, whose checkpoint sits inside the compiled block; ddp), a pipeline
(modular_pipeline, p = 2 looping, 2 micro-batches), a sharded one (zero_layered, d = 2), the
relay (l2l: two graphs, its no_grad forward and the backward's recomputation with autograd). Cold compiles cost ~10 s a graph here, so the
runs share one micro-batch shape (8 rows) where they can: ddp's graph serves the pipeline from the
inductor cache (so do zero_layered's, m = 1, and L2L's). Validation refuses the strategies whose blocks cannot compile, with the reason.
"""

import pytest

from layerwise.preflight import validate
from strategies import strategy_entry
from strategies.compile import KFAC_HOOKS, TENSOR_GRID, eager_note, pipeline_eager_blocks
from tests.ranks import QUICK, compose_config
from tests.references import SgdComparison, SgdRun, sgd_reference

COMPILE = "trainer.compile=true"
# single: dropout (compiled equals eager only under inductor's fallback_random) and full
# recomputation (checkpoint inside the compiled region), one graph of 16 rows
DROPOUT_RECOMPUTE = ("strategy=single", "model.dropout=0.1", "strategy.activation_recompute=full")


def assert_compiled_once(summary: dict, blocks: int, graphs: int = 1) -> None:
    """Every block this run holds compiled; the first step made `graphs` per rank (blocks share
    them), later steps none, and no guard failed (torch's own counters, layerwise/run/compiled.py)."""
    record = summary["compile"]
    assert record["blocks_compiled"] == blocks, record
    assert record["graphs_first_step"] == graphs and record["graphs_after_first_step"] == 0, record
    assert record["recompiles"] == 0 and record["validation_graphs"] == 0, record
    assert record["compile_s"] > 0, record


@pytest.mark.parametrize("strategy, overrides, reason", [
    ("kfac", [], KFAC_HOOKS), ("pipefisher", [], KFAC_HOOKS),
    ("tp_1d", ["strategy.tensor_grid=2"], TENSOR_GRID),
    ("one_f_one_b", ["strategy.schedule=zero_bubble_h1"], "splits the backward into I and W"),
])
def test_compile_where_blocks_cannot_compile_runs_them_eager_and_says_why(strategy, overrides, reason):
    """Validation accepts the run (a sweep over strategies runs every point); the note the run prints
    and keeps in summary.json's compile.eager names the strategy and the reason."""
    cfg = compose_config(*QUICK, "model.layers=4", f"strategy={strategy}", *overrides, COMPILE)
    validate(cfg)
    note = eager_note(cfg, strategy_entry(strategy))
    assert f"trainer.compile=true: strategy={strategy} runs its blocks eager" in note
    assert reason.split(":")[0][:40] in note
    assert eager_note(compose_config(*QUICK, "model.layers=4", f"strategy={strategy}", *overrides),
                      strategy_entry(strategy)) is None


def test_a_tensor_grid_under_compile_runs_eager_equal_to_single_and_its_summary_says_why(tmp_path, tmp_path_factory):
    """tp_1d with trainer.compile=true: no block compiled, the SGD oracle holds, and summary.json's
    compile.eager carries the reason instead of the regional note."""
    actual = SgdRun(tmp_path, "strategy=tp_1d", "strategy.tensor_grid=2", COMPILE)
    SgdComparison(actual, sgd_reference(tmp_path_factory)).check()
    record = actual.summary["compile"]
    assert record["blocks_compiled"] == 0 and record["graphs_first_step"] == 0, record
    assert "runs its blocks eager" in record["eager"] and TENSOR_GRID[:40] in record["eager"], record


def test_validation_accepts_compile_where_blocks_compile():
    for overrides in (["strategy=single"], ["strategy=ddp"], ["strategy=gpipe"], ["strategy=fsdp2"], ["strategy=l2l"],
                      ["strategy=modular_pipeline", "strategy.activation_recompute=full"]):
        validate(compose_config(*QUICK, "model.layers=4", *overrides, COMPILE))
    assert pipeline_eager_blocks(compose_config(*QUICK, "strategy=one_f_one_b")) is None


def test_single_compiled_with_dropout_and_recompute_equals_eager(tmp_path, tmp_path_factory):
    expected = sgd_reference(tmp_path_factory, *DROPOUT_RECOMPUTE)
    actual = SgdRun(tmp_path, *DROPOUT_RECOMPUTE, COMPILE)
    SgdComparison(actual, expected).check()
    assert_compiled_once(actual.summary, blocks=4)


@pytest.mark.parametrize("overrides", [
    ["strategy=ddp"],
    ["strategy=modular_pipeline", "strategy.pipeline_degree=2", "strategy.micro_batches=2"],
    ["strategy=zero_layered", "strategy.micro_batches=1"],
    ["strategy=l2l", "strategy.micro_batches=2", "hardware.devices_per_node=1"],
], ids=["ddp_dp2", "modular_pipeline_pp2_v2_m2", "zero_layered_dp2_m1", "l2l_m2"])
def test_compiled_strategy_equals_eager_single(overrides, tmp_path, tmp_path_factory):
    """ddp and zero_layered on 2 replicas (4 blocks each: 8 compiled; zero_layered's weights are
    gathered into its flat shards' views before each run), a looping pipeline (2 stages a rank: 4)
    and L2L on one rank (4 blocks relayed through the host store, each compiled)."""
    actual = SgdRun(tmp_path, *overrides, COMPILE)
    SgdComparison(actual, sgd_reference(tmp_path_factory)).check()
    relay = "strategy=l2l" in overrides  # its forward runs without autograd, its backward reruns it with
    assert_compiled_once(actual.summary, blocks=8 if actual.summary["world_size"] == 2 and
                         "strategy.pipeline_degree=2" not in overrides else 4, graphs=2 if relay else 1)
