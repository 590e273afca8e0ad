"""Dry run (prototype, issue 16 item 2): one rank's real setup and step at world 64 in this process.

Each case runs the registry's strategy through a Lightning Trainer against torch's fake process
group, as one rank of 64, and checks what that rank issued: its step's logical bytes per kind equal
strategies/traffic.py's formula for its pipeline position, exactly. No process is forked. Ids:
pp{p} pipeline ranks, dp{n} data replicas, p{t} 1-D tensor ranks, 3d_q{q} a 3-D grid of edge q.
(Against real gloo runs at 8 ranks the same numbers agree per rank: docs/plan.md "Dry run".)
"""

import os

import pytest
import torch.distributed as dist

from layerwise.dry_run import dry_run, formula_bytes
from parallel.comm import KINDS
from tests.harness import QUICK, compose_config

WORLD = 64
CASES = {  # id: (overrides, a rank whose role is not rank 0's)
    "zero_layered_pp2_dp32": (["strategy=zero_layered", "strategy.pipeline_degree=2", "model.layers=4"], 63),
    "one_f_one_b_pp2_p2_dp16": (["strategy=one_f_one_b", "strategy.tensor_parallel=1d", "strategy.tensor_grid=2",
                                 "model.layers=4"], 37),
    "three_d_3d_q2_dp8": (["strategy=three_d", "strategy.tensor_grid=2"], 45),
}


def config(overrides):
    return compose_config(*QUICK, f"data.global_batch_size={4 * WORLD}", "trainer.max_steps=1", *overrides)


@pytest.mark.parametrize("case", list(CASES))
def test_one_rank_at_world_64_issues_the_formulas_bytes(case):
    overrides, rank = CASES[case]
    cfg = config(overrides)
    result = dry_run(cfg, rank, WORLD)
    assert result["steps"] == 1 and result["world_size"] == WORLD
    assert not dist.is_initialized() and "WORLD_SIZE" not in os.environ  # nothing leaks into the caller
    expected = formula_bytes(cfg, WORLD, result["coordinates"]["pipeline"], result["vocabulary"])
    print(f"{case} rank {rank} {result['coordinates']}: {result['bytes_by_kind']} in {result['seconds']:.2f} s")
    assert result["bytes_by_kind"] == {kind: pytest.approx(expected[kind], rel=1e-12, abs=0) for kind in KINDS}
    assert sum(result["bytes_by_kind"].values()) > 0
    step = [c for c in result["collectives"] if c["phase"] == "step"]
    assert sum(c["bytes"] for c in step) == pytest.approx(sum(expected.values()), rel=1e-12)
    assert result["peak_compute_bytes"] > result["setup_peak_bytes"] > 0


def test_fake_tensors_hold_the_same_bytes_and_memory_as_real_ones():
    """FakeTensorMode (no storage allocated) gives the same collectives, step peak and setup peak."""
    cfg = config(["strategy=modular_pipeline", "strategy.pipeline_degree=4", "model.layers=4"])
    real, fake = dry_run(cfg, 5, WORLD), dry_run(cfg, 5, WORLD, fake_tensors=True)
    assert fake["bytes_by_kind"] == real["bytes_by_kind"]
    assert fake["peak_compute_bytes"] == real["peak_compute_bytes"]
    assert fake["setup_peak_bytes"] == real["setup_peak_bytes"]


def test_zero_under_fake_tensors_is_refused_with_the_blocker_named():
    """Fake storages all have address 0; ZeRO's saved-tensor hooks key by address (docs/plan.md)."""
    cfg = config(CASES["zero_layered_pp2_dp32"][0])
    with pytest.raises(NotImplementedError, match="data_ptr"):
        dry_run(cfg, 0, WORLD, fake_tensors=True)
    assert not dist.is_initialized() and "WORLD_SIZE" not in os.environ
