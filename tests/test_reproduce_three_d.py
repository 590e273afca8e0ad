"""Bian et al. 2021's reproduction (layerwise/reproduce/three_d.py): the paper-scale arithmetic against
hand-computed oracles (docs/strategies/three_d.md's per-rank volumes, FLOPs at the device's rate) and the small-scale
comparison on tiny inputs. Nothing here trains; the small-scale runs are
`python train.py experiment=repro_three_d_small`.
"""

import math

import pytest

from layerwise.reproduce import three_d
from parallel.comm import KINDS
from tests.ranks import compose_config

PAPER = ["experiment=repro_three_d"]


@pytest.fixture(scope="module")
def cfg():
    return compose_config(*PAPER)


def test_edges_of_the_paper_grids():
    assert [three_d.edge(grid, 64) for grid in ("1d", "2d", "3d")] == [64, 8, 4]
    assert three_d.edge("3d", 8) == 2 and three_d.edge("2d", 4) == 2
    with pytest.raises(ValueError, match="3d grid"):
        three_d.edge("3d", 32)


def test_one_d_on_64_gpus_is_the_hand_formula(cfg):
    """Megatron: 4 all-reduces of T·h per block and 1 for the head's input, 2(P−1)/P each, in the
    compute dtype (2 bytes: strategy.tensor_collective_dtype=compute, Megatron's own), plus the
    vocabulary-parallel loss's 3 per-token all-reduces in fp32; all between 16 nodes, the ring's 4
    members per node crossing on 4 GPUs' share of the network at once (NCCL's ring per NIC: 4 × 6.25
    = 25 GB/s, below NVLink's 32); compute = F + 2F, F = T·(24h² + 4sh)·L + 2ThV over P GPUs at peak
    × efficiency."""
    h, layers, s, batch, vocabulary, P = 4096, 4, 512, 32, 256, 64
    tokens = batch * s
    ring = 2 * (P - 1) / P
    expected_bytes = ring * (2 * (4 * layers + 1) * tokens * h + 4 * 3 * tokens)
    row = three_d.plan_point(cfg, "1d", P, batch)
    assert row["GB_per_GPU_per_step"] * 1e9 == pytest.approx(expected_bytes, rel=1e-9)
    assert row["communication_s"] == pytest.approx(expected_bytes / (4 * 6.25e9), rel=1e-9)
    forward = (tokens * (24 * h * h + 4 * s * h) * layers + 2 * tokens * h * vocabulary) / P
    assert row["compute_s"] == pytest.approx(3 * forward / (1.25e14 * 0.5), rel=1e-6)


def test_three_d_gathers_are_the_papers_volume(cfg):
    """3-D on 64 GPUs (q=4): every linear gathers (q−1)/q³·(N_X + N_W + N_Y) elements (X over input,
    W over weight, dY over output), and reduce-scatters as much; the head is one more linear."""
    h, layers, tokens, vocabulary, q = 4096, 4, 32 * 512, 256, 4
    linears = [(h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)] * layers + [(h, vocabulary)]
    expected = sum((q - 1) / q ** 3 * (tokens * i + i * o + tokens * o) * 4 for i, o in linears)
    moved = three_d.predicted_bytes(cfg, "3d", 64, 32)
    assert moved["all_gather"] == pytest.approx(expected, rel=1e-9)
    assert moved["reduce_scatter"] == pytest.approx(expected, rel=1e-9)


def test_speedups_and_verdicts():
    rows = [{"grid": "1-D", "GPUs": 64, "step_s": 4.0}, {"grid": "2-D", "GPUs": 64, "step_s": 3.0},
            {"grid": "3-D", "GPUs": 64, "step_s": 2.0}, {"grid": "1-D", "GPUs": 8, "step_s": 100.0}]
    assert three_d.speedups(rows) == {"1d": 2.0, "2d": 1.5}
    assert three_d.verdict_of(2.0, 2.32)[0] == "reproduced"  # 14% below
    assert three_d.verdict_of(3.0, 2.32)[0] == "partly"  # 29% above
    assert three_d.verdict_of(0.9, 1.57)[0] == "refuted"


def test_weak_scaling_grows_the_batch_with_the_gpus(cfg):
    """Weak scaling: batch = 32 × P / 8; 1-D's bytes per GPU grow with it (activations replicated)."""
    small, large = (three_d.plan_point(cfg, "1d", P, 32 * P // 8) for P in (8, 16))
    assert (small["batch"], large["batch"]) == (32, 64)
    ring = {P: 2 * (P - 1) / P for P in (8, 16)}
    assert large["GB_per_GPU_per_step"] / small["GB_per_GPU_per_step"] == pytest.approx(2 * ring[16] / ring[8])


def test_a_shape_the_grid_cannot_split_is_refused(cfg):
    from omegaconf import OmegaConf
    odd = OmegaConf.merge(cfg, {"model": {"heads": 48}})
    with pytest.raises(ValueError, match="model.heads=48"):
        three_d.planned_config(odd, "1d", 64, 32)


def test_compare_measured_with_predicted():
    predicted = dict.fromkeys(KINDS, 0.0) | {"all_gather": 100.0, "reduce_scatter": 100.0, "all_reduce": 20.0}
    measured = {"all_gather": 100, "reduce_scatter": 100, "all_reduce": 30, "send_recv": 0}
    rows = three_d.compare("3d", 8, measured, predicted)
    by_kind = {row["kind"]: row for row in rows}
    assert set(by_kind) == {"all_gather", "reduce_scatter", "all_reduce", "total"}
    assert by_kind["all_reduce"]["measured/predicted"] == pytest.approx(1.5)
    assert by_kind["total"]["measured_bytes"] == 230
    assert by_kind["total"]["measured/predicted"] == pytest.approx(230 / 220)
    assert math.isnan(three_d.compare("1d", 8, {"broadcast": 4}, dict.fromkeys(KINDS, 0.0))[-1]["measured/predicted"])


def test_small_verdicts_read_the_totals():
    def total(grid, measured, predicted):
        return {"grid": grid, "ranks": 8, "kind": "total", "measured_bytes": measured, "predicted_bytes": predicted,
                "measured/predicted": measured / predicted}
    rows = [total("1-D", 100.0, 100.0), total("2-D", 60.0, 60.0), total("3-D", 66.0, 60.0)]
    less, formula = three_d.small_verdicts(rows)
    assert less.verdict == "reproduced" and "0.660 measured" in less.measurement and "0.600" in less.prediction
    assert formula.verdict == "partly" and "10.0%" in formula.reason  # 3-D measured 10% above
    rows[-1] = total("3-D", 120.0, 60.0)
    assert three_d.small_verdicts(rows)[0].verdict == "refuted"
