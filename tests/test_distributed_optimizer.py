"""The distributed optimizer (strategy.distributed_optimizer=true, strategies/distributed_optimizer.py).

Pipeline × data (pp2 dp2, 4 ranks) and pipeline × 1-D tensor grid × data (pp2 p2 dp2, 8 ranks):
1. equal to `single` under SGD (losses, the first step's gradients, the parameters: a wrong
   gradient scale shows) and AdamW (3 steps: losses and parameters within the update rule's bound);
2. equal to the same layout with distributed_optimizer=false within reduction-order tolerance;
3. bytes: the reduce-scatter and the all-gather each move (d−1)/d × the padded buckets × 4 bytes
   per rank, together exactly the all-reduce bytes they replace, every other kind unchanged;
4. optimizer state: each rank holds 1/d of the replicated optimizer's moments (measured);
5. the portable checkpoint holds whole tensors and whole optimizer state (equal to the replicated
   run's), and a resumed run is bit-identical to the uninterrupted one;
6. configurations it cannot compose with are refused by the check, naming the field and the fix.
"""

import json
from pathlib import Path

import pytest
import torch

from layerwise.config.errors import ConfigError
from layerwise.config.validate import composition_problem
from layerwise.preflight import validate
from layerwise.run.fit import train
from parallel.comm import KINDS
from tests.ranks import QUICK, compose_config
from tests.references import (SgdComparison, SgdRun, consolidated_parameters, sgd_reference, trainer_callbacks,
                              tracing_optimizer)
from tests.same_checkpoints import assert_same_checkpoints
from tests.test_resume_matrix import OPTIMIZER_STATE_RTOL
from tests.tolerances import (GRADIENT_SCALE_ATOL, OptimizerTrace, assert_same_losses, assert_same_parameters,
                              tolerance_excess)

ON = "strategy.distributed_optimizer=true"
LAYOUTS = {  # id: overrides; d = 2 data ranks in both
    "pp2_dp2": ["strategy=modular_pipeline", "strategy.pipeline_degree=2", "hardware.devices_per_node=4"],
    "pp2_p2_dp2": ["strategy=modular_pipeline", "strategy.pipeline_degree=2", "strategy.tensor_parallel=1d",
                   "strategy.tensor_grid=2", "hardware.devices_per_node=8"],
}
DATA = 2
STEPS = 3
ADAMW = ["optimizer=adamw", "optimizer.warmup_steps=0", "optimizer.lr_schedule=constant", "optimizer.lr=0.01",
         "optimizer.weight_decay=0.01"]
MODEL = ["model.layers=4", "data.global_batch_size=16", "trainer.limit_val_batches=0",
         f"trainer.val_check_interval={STEPS}"]
FACTS = "distributed_optimizer_rank{rank}.json"


def record_facts():
    """A trainer callback: at the end of training, each rank writes what it held (tests only)."""
    import lightning.pytorch as pl

    class Facts(pl.Callback):
        def __init__(self):
            self.bytes = None

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
            self.bytes = trainer.strategy.communicator().snapshot()  # this rank's, this step (reset at its start)

        def on_train_end(self, trainer, module):
            strategy, (optimizer,) = trainer.strategy, trainer.optimizers
            moments = sum(value.numel() * value.element_size() for state in optimizer.state.values()
                          for key, value in state.items() if key != "step")
            facts = {"moment_bytes": moments, "bytes": self.bytes,
                     "parameter_elements": sum(p.numel() for p in module.model.parameters()),
                     "buckets": [] if getattr(strategy, "sharded", None) is None else
                     [(sum(p.numel() for p in b.parameters), b.weights.numel()) for b in strategy.sharded.all_buckets()]}
            (Path(trainer.default_root_dir) / FACTS.format(rank=trainer.global_rank)).write_text(json.dumps(facts))
    return Facts()


def run(directory, *overrides, steps=STEPS):
    cfg = compose_config(*QUICK, *MODEL, f"trainer.max_steps={steps}", *overrides)
    with trainer_callbacks(record_facts()):
        summary = train(cfg, directory, validate(cfg))
    assert summary["status"] == "completed", summary.get("error")
    return summary


def facts(directory, world: int) -> list:
    return [json.loads((Path(directory) / FACTS.format(rank=rank)).read_text()) for rank in range(world)]


@pytest.fixture(scope="module")
def adamw_single(tmp_path_factory):
    directory = tmp_path_factory.mktemp("single_adamw")
    with tracing_optimizer(directory):
        summary = run(directory, "strategy=single", *ADAMW)
    return summary, consolidated_parameters(directory, "single"), OptimizerTrace.load(directory)


@pytest.fixture(scope="module")
def adamw_runs(tmp_path_factory):
    """`runs(layout)`: (directory, summary) of the AdamW run with the distributed optimizer off and on."""
    cache = {}

    def runs(layout):
        if layout not in cache:
            made = {}
            for switch in ("false", "true"):
                directory = tmp_path_factory.mktemp(f"{layout}_{switch}")
                made[switch] = directory, run(directory, *LAYOUTS[layout], *ADAMW,
                                              f"strategy.distributed_optimizer={switch}",
                                              f"trainer.checkpoint_every_n_steps={STEPS}")
            cache[layout] = made
        return cache[layout]
    return runs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_equals_single_under_sgd(layout, tmp_path, tmp_path_factory):
    comparison = SgdComparison(SgdRun(tmp_path, *LAYOUTS[layout], ON), sgd_reference(tmp_path_factory))
    comparison.check()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_equals_single_and_the_replicated_optimizer_under_adamw(layout, adamw_single, adamw_runs):
    expected, expected_parameters, trace = adamw_single
    (off_directory, off), (on_directory, on) = adamw_runs(layout)["false"], adamw_runs(layout)["true"]
    assert on["layout"]["data"] == DATA
    assert_same_losses(on["losses"], expected["losses"])
    assert_same_parameters(consolidated_parameters(on_directory, "modular_pipeline"), expected_parameters, trace)
    assert_same_losses(on["losses"], off["losses"])
    assert_same_parameters(consolidated_parameters(on_directory, "modular_pipeline"),
                           consolidated_parameters(off_directory, "modular_pipeline"), trace)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bytes_and_optimizer_state(layout, adamw_runs):
    """Reduce-scatter + all-gather replace the all-reduce byte for byte; state is 1/d per rank."""
    (off_directory, off), (on_directory, on) = adamw_runs(layout)["false"], adamw_runs(layout)["true"]
    held_on, held_off = facts(on_directory, on["world_size"]), facts(off_directory, off["world_size"])
    for on_rank, off_rank in zip(held_on, held_off):  # each rank's last step
        before, after = off_rank["bytes"], on_rank["bytes"]
        # formula: (d − 1)/d × the padded bucket elements × 4 bytes, each way
        formula = sum(padded for _, padded in on_rank["buckets"]) * 4 * (DATA - 1) / DATA
        assert formula > 0, "no shards: strategy.distributed_optimizer=true reached no code"
        assert after["reduce_scatter"] - before["reduce_scatter"] == formula
        assert after["all_gather"] - before["all_gather"] == formula
        # padding: fewer than d elements per bucket; the buckets hold every local parameter
        assert all(0 <= padded - elements < DATA for elements, padded in on_rank["buckets"])
        assert sum(elements for elements, _ in on_rank["buckets"]) == on_rank["parameter_elements"]
        # an all-reduce's logical bytes = a reduce-scatter's + an all-gather's (of the unpadded buckets)
        unpadded = sum(elements for elements, _ in on_rank["buckets"]) * 4 * 2 * (DATA - 1) / DATA
        assert before["all_reduce"] - after["all_reduce"] == unpadded
        for kind in set(KINDS) - {"all_reduce", "reduce_scatter", "all_gather"}:
            assert after[kind] == before[kind], kind
        # AdamW: two fp32 moments per element held
        assert off_rank["moment_bytes"] == 2 * 4 * off_rank["parameter_elements"]
        assert on_rank["moment_bytes"] == 2 * 4 * sum(padded for _, padded in on_rank["buckets"]) // DATA
        assert on_rank["moment_bytes"] <= off_rank["moment_bytes"] / DATA + 2 * 4 * len(on_rank["buckets"])
    before, after = off["comm_bytes_per_step"], on["comm_bytes_per_step"]
    print(f"{layout}: bytes per step (max over ranks) before {before}, after {after}; optimizer moments per rank before "
          f"{[r['moment_bytes'] for r in held_off]}, after {[r['moment_bytes'] for r in held_on]}; peak compute "
          f"bytes before {off['peak_compute_bytes']}, after {on['peak_compute_bytes']}")


def test_portable_checkpoint_holds_whole_tensors_and_optimizer_state(adamw_runs):
    from strategies.checkpoint.portable import read_portable
    (off_directory, _), (on_directory, _) = adamw_runs("pp2_p2_dp2")["false"], adamw_runs("pp2_p2_dp2")["true"]
    for prefix in ("model.", "optimizer."):
        on, off = (read_portable(d / "checkpoints" / "last", prefix) for d in (on_directory, off_directory))
        assert on.keys() == off.keys() and on, prefix
        for name in off:
            assert on[name].shape == off[name].shape, name
            atol = GRADIENT_SCALE_ATOL * float(off[name].abs().max())
            assert tolerance_excess(on[name], off[name], OPTIMIZER_STATE_RTOL, atol) <= 1, name


def test_portable_resume_loads_whole_state_into_shards(tmp_path, adamw_runs):
    """resume_from the 8-rank run's portable checkpoint into pp2 × dp2 (another layout), one more
    step, with the distributed optimizer on and off: its shards load their ranges of the moments
    (strategies/checkpoint/portable.py), so both continue alike and save the same whole state."""
    from strategies.checkpoint.portable import read_portable
    source = adamw_runs("pp2_p2_dp2")["true"][0] / "checkpoints" / "last"
    resumed = {switch: run(tmp_path / switch, *LAYOUTS["pp2_dp2"], *ADAMW, f"strategy.distributed_optimizer={switch}",
                           f"resume_from={source}", steps=STEPS + 1) for switch in ("false", "true")}
    assert resumed["true"]["losses"] == resumed["false"]["losses"]
    assert len(resumed["true"]["losses"]) == STEPS + 1
    for prefix in ("model.", "optimizer."):
        on, off = (read_portable(tmp_path / switch / "checkpoints" / "last", prefix) for switch in ("true", "false"))
        assert on.keys() == off.keys() and all(torch.equal(on[name], off[name]) for name in off), prefix


def test_resume_is_bit_identical(tmp_path, adamw_runs):
    (whole_directory, whole) = adamw_runs("pp2_dp2")["true"]
    overrides = [*LAYOUTS["pp2_dp2"], *ADAMW, ON, "trainer.checkpoint_every_n_steps=2"]
    run(tmp_path, *overrides, steps=2)
    resumed = run(tmp_path, *overrides[:-1], f"trainer.checkpoint_every_n_steps={STEPS}")
    assert resumed["losses"] == whole["losses"]
    after, reference = (consolidated_parameters(d, "modular_pipeline") for d in (tmp_path, whole_directory))
    assert all(torch.equal(after[name], reference[name]) for name in reference)
    assert_same_checkpoints(tmp_path, whole_directory)  # every rank's weights and sharded Adam state


def test_fp16_loss_scaling_unscales_and_checks_the_shards(tmp_path):
    """16-mixed (CPU's emulation, tests/test_precision.py): the agreed GradScaler unscales and checks
    the optimizer's parameters, here the shards, whose gradients are the reduced slices."""
    from tests.test_precision import run_fp16, relative_gap
    from tests.tolerances import BF16_LOSS_RTOL
    single = run_fp16(tmp_path / "single", "strategy=single")
    sharded = run_fp16(tmp_path / "sharded", *LAYOUTS["pp2_dp2"], ON)
    assert sharded["status"] == "completed" and sharded["precision"] == "16-mixed"
    assert relative_gap(sharded["losses"], single["losses"]) <= BF16_LOSS_RTOL


def test_a_tied_weight_is_sharded_once(tmp_path):
    """One pipeline rank holding every stage with model.tie_embeddings=true: the embedding and the
    head share one weight, sharded once (in stage 0, reduced after every backward reached it)."""
    tied = ["model.tie_embeddings=true", *ADAMW]
    single = run(tmp_path / "single", "strategy=single", *tied)
    sharded = run(tmp_path / "sharded", "strategy=modular_pipeline", "strategy.pipeline_degree=1",
                  "hardware.devices_per_node=2", ON, *tied)
    assert_same_losses(sharded["losses"], single["losses"])


def test_dry_run_at_64_ranks_holds_the_formulas_bytes_and_less_memory():
    """The dry run (fake process group; layerwise/tools/dry_run.py) of pp2 × dp32: the reduce-scatter
    and the all-gather each carry half the all-reduce they replace, plus fewer than d padding elements
    per bucket; fake tensors give the real ones' bytes and peak, and the peak falls by the moments
    the rank no longer holds (no gloo temporaries here)."""
    from layerwise.tools.dry_run import dry_run
    world, data = 64, 32

    def config(switch):
        return compose_config(*QUICK, f"data.global_batch_size={4 * world}", "mode=plan", "model.layers=4",
                              "strategy=modular_pipeline", "strategy.pipeline_degree=2",
                              f"strategy.distributed_optimizer={switch}")
    off, on = dry_run(config("false"), 0, world), dry_run(config("true"), 0, world)
    fake = dry_run(config("true"), 0, world, fake_tensors=True)
    assert fake["bytes_by_kind"] == on["bytes_by_kind"] and fake["peak_compute_bytes"] == on["peak_compute_bytes"]
    before, after = off["bytes_by_kind"], on["bytes_by_kind"]
    assert after.get("all_reduce", 0) == 0 and after["reduce_scatter"] == after["all_gather"]
    padding = after["reduce_scatter"] - before["all_reduce"] / 2  # 2 buckets (stages) on this rank
    assert 0 <= padding < 2 * data * 4 * (data - 1) / data
    assert on["peak_compute_bytes"] < off["peak_compute_bytes"]
    print(f"dry run pp2 × dp32, rank 0: bytes before {before}, after {after}; peak compute bytes "
          f"{off['peak_compute_bytes']} -> {on['peak_compute_bytes']}")


@pytest.mark.parametrize("overrides, message", [
    (["strategy=modular_pipeline", "strategy.pipeline_degree=2", "optimizer=lamb", ON],
     "optimizer.name=lamb scales each tensor by its own trust ratio"),
    (["strategy=zero_layered", ON], "strategy=zero_layered already shards weights, gradients and optimizer state"),
    (["strategy=pipefisher", ON], "strategy=pipefisher preconditions each layer's whole gradient"),
])
def test_refused_where_it_cannot_compose(overrides, message):
    """A pipeline's check refuses LAMB; strategies without the setting say why (train.py reports
    composition errors through `composition_problem`), both naming the fix."""
    try:
        problems = validate(compose_config(*QUICK, "hardware.devices_per_node=4", *overrides))
        text = str(problems)
    except ConfigError as error:
        text = str(error)
    except Exception as error:  # noqa: BLE001 - Hydra's composition error, as train.py explains it
        text = composition_problem(error)
    assert message in text and "Fix:" in text, text
