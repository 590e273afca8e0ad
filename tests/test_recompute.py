"""Activation recomputation (`strategy.activation_recompute=full`) changes memory, not numbers
(`selective`, the core attention alone: tests/test_selective_recompute.py).

Each strategy that keeps block activations runs with `none` and with `full` under dropout (so the
replayed RNG state matters): losses and parameters are bit-identical, because the recomputed forward
is the same computation with the same masks and the gradients are formed from the same values.
"""

import pytest
import torch

from layerwise.run.fit import train
from layerwise.config.errors import ConfigError
from layerwise.preflight import validate
from strategies.modular_pipeline import build
from strategies.recompute import backward_factor
from strategies.schedule import flop_cost, simulate
from tests.ranks import QUICK, compose_config
from tests.references import consolidated_parameters

STEPS = 2  # the second step replays new dropout masks on updated weights and AdamW moments
# Ids: dp2 two data replicas, pp2 two pipeline stages, q2 a tensor grid of edge 2 (1-D: 2 ranks,
# 2-D: 4, 3-D: 8; the last case is a 2-D grid inside each of 2 pipeline stages).
CASES = {
    "single": ["strategy=single"],
    "ddp_dp2": ["strategy=ddp"],
    "modular_pipeline_pp2_v2_m4": ["strategy=modular_pipeline", "model.layers=4"],
    "zero_layered_dp2_m4": ["strategy=zero_layered"],
    "tp_1d_q2": ["strategy=tp_1d", "strategy.tensor_grid=2"],
    "three_d_q2": ["strategy=three_d", "hardware.devices_per_node=8"],
    "modular_pipeline_pp2_2d_q2": ["strategy=modular_pipeline", "strategy.tensor_parallel=2d",
                                   "hardware.devices_per_node=8", "model.layers=4"],
}


def run(directory, *overrides):
    cfg = compose_config(*QUICK, f"trainer.max_steps={STEPS}", f"trainer.val_check_interval={STEPS}",
                         "model.dropout=0.1", *overrides)
    return train(cfg, directory, validate(cfg))


@pytest.mark.parametrize("case", list(CASES))
def test_full_recompute_is_bit_identical_to_none(case, tmp_path):
    strategy = CASES[case][0].removeprefix("strategy=")
    results = {}
    for mode in ("none", "full"):
        summary = run(tmp_path / mode, *CASES[case], f"strategy.activation_recompute={mode}")
        assert summary["status"] == "completed"
        results[mode] = summary["losses"], consolidated_parameters(tmp_path / mode, strategy)
    (losses, parameters), (recomputed_losses, recomputed_parameters) = results["none"], results["full"]
    assert recomputed_losses == losses
    assert recomputed_parameters.keys() == parameters.keys()
    for name, value in parameters.items():
        assert torch.equal(recomputed_parameters[name], value), name


def test_full_recompute_lowers_the_peak_of_an_eight_block_pipeline(tmp_path):
    """Without recomputation a rank keeps every block's internals for all m micro-batches; with it,
    only the block inputs, plus one block's recomputed internals."""
    peaks = {}
    for mode in ("none", "full"):
        summary = run(tmp_path / mode, "strategy=modular_pipeline", "model.layers=8", "model.hidden=64",
                      "model.heads=4", "data.sequence_length=64", "trainer.measure_every_n_steps=1",
                      f"strategy.activation_recompute={mode}")
        peaks[mode] = summary["peak_compute_bytes"]
    ratio = peaks["full"] / peaks["none"]
    print(f"modular_pipeline, 8 blocks: peak compute bytes full/none = {ratio:.2f} "
          f"({peaks['full']:.0f} / {peaks['none']:.0f})")
    assert ratio <= 0.7


def test_unknown_recompute_mode_names_the_field_and_the_fix():
    for strategy in ("single", "modular_pipeline", "zero_layered"):
        with pytest.raises(ConfigError) as caught:
            validate(compose_config(f"strategy={strategy}", "strategy.activation_recompute=partial"))
        assert "strategy.activation_recompute='partial' is unknown" in str(caught.value)
        assert "Fix: strategy.activation_recompute=none" in str(caught.value)
        assert "selective (rerun only the core attention)" in str(caught.value)


def test_simulator_costs_a_recomputed_backward_as_three_forwards():
    assert (backward_factor("none"), backward_factor("full")) == (2.0, 3.0)
    timelines = {}
    for mode in ("none", "full"):
        cfg = compose_config("strategy=modular_pipeline", "model.layers=4",
                             f"strategy.activation_recompute={mode}")
        strategy = build(cfg, 2)
        timelines[mode] = strategy.simulated_timeline()
        expected = simulate(strategy.plan, flop_cost(1.0, 1.0, backward_factor=backward_factor(mode)))
        assert timelines[mode] == expected
    # Per rank: v·m forwards and as many backwards, each backward one forward longer under `full`.
    busy = {mode: timeline.busy(0) for mode, timeline in timelines.items()}
    assert busy["full"] - busy["none"] == 2 * 4
