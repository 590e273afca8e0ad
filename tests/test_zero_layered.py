"""ZeroLayeredStrategy equals the single-process reference, and its traffic is 3(n−1)/n·P per step.

Test ids: dp{n} = n data-parallel replicas, m{m} = micro-batches, pp{p} = pipeline degree (looping),
df = depth-first comparator (breadth_first_micro_batches=1). P is the *padded* flat parameter count
a rank holds: per stage, matrices and vectors each padded to a multiple of n (what is gathered).
"""

import csv
import math

import pytest
import torch

from layerwise.reproduce.measure import counted_fit
from layerwise.run.fit import train
from layerwise.config.errors import ConfigError
from layerwise.preflight import validate
from strategies.schedule import add_communication, build_plan, validate_plan
from strategies.schedule.zero import GATHER_BACKWARD, GATHER_FORWARD, REDUCE_SCATTER, add_zero
from tests.ranks import QUICK, compose_config, run_on_ranks
from tests.references import cached_references, compare_under_sgd, consolidated_parameters
from tests.same_checkpoints import assert_same_checkpoints
from tests.tolerances import EXACT_RTOL, OptimizerTrace, assert_same_losses, assert_same_parameters

STEPS = 5
BATCH = ["data.global_batch_size=16"]  # splits into n=4 ranks × m=4 and n=2 × m=8
BYTES = 4  # fp32


def overrides(steps, *extra):
    return [*QUICK, *BATCH, f"trainer.max_steps={steps}", "trainer.val_check_interval=5", *extra]


def run(directory, *extra, steps=STEPS):
    cfg = compose_config(*overrides(steps, *extra))
    return train(cfg, directory, validate(cfg))


# ----- an independent counter (layerwise/reproduce/measure.py: raw torch.distributed tensors)

def run_counted(directory, *extra, steps=STEPS):
    """Run with validation off (its gathers are not a training step's) and return the summary + tallies."""
    cfg = compose_config(*overrides(steps, "trainer.limit_val_batches=0", *extra))
    world = validate(cfg)
    tallies = run_on_ranks(counted_fit, world, cfg, directory, world)
    import json
    return json.loads((directory / "summary.json").read_text()), tallies


def metrics_rows(directory):
    with (directory / "metrics.csv").open() as handle:
        return list(csv.DictReader(handle))


def padded_parameters(parameters: dict, layers: int, stages_of_rank, data: int) -> int:
    """P of one pipeline rank: its stages' matrices and vectors, each padded to a multiple of n."""
    total = 0
    for stage in stages_of_rank:
        names = [n for n in parameters if n.startswith(f"model.blocks.{stage}.")]
        names += [n for n in parameters if stage == 0 and n.startswith("model.embed.")]
        names += [n for n in parameters if stage == layers - 1 and n.startswith("model.head.")]
        for matrix in (True, False):
            numel = sum(parameters[n].numel() for n in names if (parameters[n].dim() >= 2) == matrix)
            total += math.ceil(numel / data) * data
    return total


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return cached_references(tmp_path_factory, run)


# id: (strategy, layers, micro-batches, ranks, pipeline degree, gathers+scatters per stage per step)
CASES = {
    "dp2_m1": ("zero_layered", 2, 1, 2, 1, 3),
    "dp2_m2": ("zero_layered", 2, 2, 2, 1, 3),
    "dp2_m4": ("zero_layered", 2, 4, 2, 1, 3),
    "dp2_m8": ("zero_layered", 2, 8, 2, 1, 3),
    "dp4_m1": ("zero_layered", 2, 1, 4, 1, 3),
    "dp4_m2": ("zero_layered", 2, 2, 4, 1, 3),
    "dp4_m4": ("zero_layered", 2, 4, 4, 1, 3),
    "pp2_dp2_m4": ("zero_layered", 4, 4, 4, 2, 3),
    "df_dp2_m1": ("zero_depth_first", 2, 1, 2, 1, 3 * 1),
    "df_dp2_m2": ("zero_depth_first", 2, 2, 2, 1, 3 * 2),
    "df_dp2_m4": ("zero_depth_first", 2, 4, 2, 1, 3 * 4),
    "df_dp2_m8": ("zero_depth_first", 2, 8, 2, 1, 3 * 8),
}


@pytest.mark.parametrize("case", list(CASES))
def test_zero_equals_single_and_moves_3_n_minus_1_over_n_P(case, references, tmp_path):
    strategy, layers, micro_batches, ranks, pipeline, transfers = CASES[case]
    expected, reference_directory = references(layers)
    parameters = consolidated_parameters(reference_directory, "single")
    summary, tallies = run_counted(tmp_path, f"strategy={strategy}", f"model.layers={layers}",
                                   f"strategy.micro_batches={micro_batches}",
                                   f"hardware.devices_per_node={ranks}", f"strategy.pipeline_degree={pipeline}")
    assert summary["status"] == "completed" and summary["world_size"] == ranks
    assert_same_losses(summary["losses"], expected["losses"])
    assert_same_parameters(consolidated_parameters(tmp_path, strategy), parameters,
                           OptimizerTrace.load(reference_directory))
    data = ranks // pipeline
    per_rank = [padded_parameters(parameters, layers, range(r, layers, pipeline), data) for r in range(pipeline)]
    # transfers = 2 gathers + 1 reduce-scatter per run pair: 3 (layered), 3m (depth-first); P counted once each
    volume = transfers * (data - 1) / data * max(per_rank) * BYTES
    for row in metrics_rows(tmp_path):  # the strategy's own accounting, every step
        logged = float(row["comm_bytes_all_gather"]) + float(row["comm_bytes_reduce_scatter"])
        assert logged == pytest.approx(volume, rel=EXACT_RTOL), row
        assert float(row["comm_bytes_all_reduce"]) == 0
    # the independent counter, on every rank (pipeline ranks hold different P)
    for rank, tally in enumerate(tallies):
        mine = per_rank[rank % pipeline] * transfers * (data - 1) / data * BYTES
        assert (tally["all_gather"] + tally["reduce_scatter"]) / STEPS == pytest.approx(mine, rel=EXACT_RTOL)
        assert tally["reduce_scatter"] * 2 == pytest.approx(tally["all_gather"], rel=EXACT_RTOL)


@pytest.mark.parametrize("case", ["zero_layered_dp2_m4", "zero_layered_pp2_dp2_m4", "zero_depth_first_dp2_m4",
                                  pytest.param("fsdp2_dp2_m4", marks=pytest.mark.smoke),  # torch 2.11 too
                                  "llama_zero_layered_pp2_dp2_m4", "llama_fsdp2_dp2_m4"])
def test_zero_equals_single_under_sgd(case, tmp_path, tmp_path_factory):
    """Plain SGD sees the gradient's scale, which AdamW normalises away (references.SgdComparison):
    losses, the first step's gradients and the parameters after references.SGD_STEPS steps. fsdp2 is
    PyTorch's ZeRO-3, the baseline."""
    compare_under_sgd(case, tmp_path, tmp_path_factory).check()


def test_plan_counts_follow_the_zero_table():
    """Per stage and step: 2 gathers + 1 reduce-scatter layered, 2m + m depth-first (docs/strategies/zero_layered.md)."""
    for micro_batches in (1, 2, 4, 8):
        for breadth_first, runs in ((None, 1), (1, micro_batches)):
            plan = validate_plan(add_zero(add_communication(build_plan(
                "looped_breadth_first", pipeline_degree=1, stages=3, micro_batches=micro_batches,
                breadth_first_micro_batches=breadth_first))))
            for counts in gathers_per_step(plan, 0).values():
                assert counts == {GATHER_FORWARD: runs, GATHER_BACKWARD: runs, REDUCE_SCATTER: runs}
    looped = validate_plan(add_zero(add_communication(build_plan(
        "looped_breadth_first", pipeline_degree=2, stages=4, micro_batches=4))))
    assert str(looped.ranks[0][0]) == "0Af0" and str(looped.ranks[0][1]) == "2Af0"  # one run ahead


def test_peak_memory_is_below_the_unsharded_reference(tmp_path):
    """Shards + at most two gathered stages + activations, against the replicated layered run."""
    model = ["model.layers=4", "model.hidden=64", "strategy.micro_batches=2", "hardware.devices_per_node=2"]
    sharded = run(tmp_path / "zero", "strategy=zero_layered", *model, steps=2)
    replicated = run(tmp_path / "replicated", "strategy=modular_pipeline", "strategy.pipeline_degree=1",
                     *model, steps=2)
    parameters = consolidated_parameters(tmp_path / "zero", "zero_layered")
    whole = sum(p.numel() for p in parameters.values()) * BYTES
    largest_stage = max(padded_parameters(parameters, 4, [s], 2) for s in range(4)) * BYTES
    saved = sharded["peak_compute_bytes"] - replicated["peak_compute_bytes"]
    # weights, gradients and two Adam moments are 1/n; the price is ≤ 2 gathered stages + 2 stage gradients
    assert saved <= -4 * whole / 2 + 4 * largest_stage, (sharded["peak_compute_bytes"], replicated["peak_compute_bytes"])


def test_resume_is_bit_identical(tmp_path):
    extra = ["strategy=zero_layered", "strategy.micro_batches=2", "trainer.checkpoint_every_n_steps=3"]
    whole = run(tmp_path / "whole", *extra, steps=6)
    run(tmp_path / "resumed", *extra, steps=3)
    assert (tmp_path / "resumed" / "checkpoints" / "last.ckpt" / "rank1.pt").exists()
    resumed = run(tmp_path / "resumed", *extra, steps=6)
    assert resumed["losses"] == whole["losses"]
    after, reference = (consolidated_parameters(tmp_path / d, "zero_layered") for d in ("resumed", "whole"))
    assert after.keys() == reference.keys()
    assert all(torch.equal(after[name], reference[name]) for name in reference)
    assert_same_checkpoints(tmp_path / "resumed", tmp_path / "whole")  # every rank's shards and Adam state


BAD = [
    (["hardware.devices_per_node=4", "strategy.data_degree=3"], "strategy.data_degree=3 does not divide the world size 4"),
    (["strategy.pipeline_degree=2", "strategy.micro_batches=1", "model.layers=4"], "must be >= strategy.pipeline_degree"),
    (["optimizer=lamb"], "optimizer.name=lamb"),
    (["model.tie_embeddings=true"], "model.tie_embeddings=true"),
]


@pytest.mark.parametrize("extra,message", BAD, ids=[m[:28] for _, m in BAD])
def test_bad_zero_input_fails_before_launch(extra, message):
    with pytest.raises(ConfigError) as caught:
        validate(compose_config("strategy=zero_layered", *extra))
    assert message in str(caught.value)


def gathers_per_step(plan, rank: int) -> dict:
    """How many gathers and reduce-scatters rank `rank` runs per stage: the ZeRO table's counts."""
    counts = {}
    for action in plan.ranks[rank]:
        if action is not None and action.kind in (GATHER_FORWARD, GATHER_BACKWARD, REDUCE_SCATTER):
            counts.setdefault(action.stage, {}).setdefault(action.kind, 0)
            counts[action.stage][action.kind] += 1
    return counts
