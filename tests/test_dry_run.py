"""Dry run (issue 16 item 2): plan mode's second estimator, one rank per role at world 64, in this process.

Each case plans a layout analytically (layerwise/planning/mode.py), then layerwise/tools/cross_check.py runs one
rank of every role through the registry's strategy and a Lightning Trainer against torch's fake
process group, measures its second step (parallel/memory.py's meter, parallel/comm.py's counts)
and compares: peak within 5% of the role's analytic bytes, collective bytes per kind equal to the
plan's: every role of every case (cost/step_time.py `stage_memory` counts what the code
allocates at its peak moment: autocast's weight copies, fp32 norm inputs, the head's softmax per
micro-batch in flight, sends held until proven received, posted receives, gradients growing in the
first backward; docs/plan.md "Dry run").
No process is forked. Ids: pp{p} pipeline ranks, dp{n} data replicas, p{t} 1-D tensor ranks,
3d_q{q} a 3-D grid of edge q.
"""

import os

import pytest
import torch.distributed as dist

from layerwise.tools.cross_check import MEMORY_TOLERANCE, cross_check, describe
from layerwise.tools.dry_run import dry_run
from layerwise.planning.inputs import training_plan_of
from layerwise.planning.result import plan_result
from parallel.comm import KINDS
from strategies.schedule import most_sends_held
from tests.ranks import QUICK, compose_config

WORLD = 64
A100 = ["hardware=dgx_a100_80g", "hardware.nodes=8"]  # 8 nodes × 8: world 64
CASES = {  # id: (overrides, a rank whose role is not rank 0's)
    "modular_pipeline_pp2_dp32": (["strategy=modular_pipeline", "strategy.pipeline_degree=2"], 1),
    "one_f_one_b_pp2_p2_dp16": (["strategy=one_f_one_b", "strategy.tensor_parallel=1d", "strategy.tensor_grid=2",
                                 "model.layers=4"], 37),
    "zero_layered_pp2_dp32": (["strategy=zero_layered", "strategy.pipeline_degree=2", "model.layers=4"], 63),
    # a split backward under ZeRO: V placement starts backward runs at a W (their gathers are "Aw")
    "zero_layered_zbv_pp2_dp32": (["strategy=zero_layered", "strategy.pipeline_degree=2", "model.layers=4",
                                   "strategy.schedule=zbv", "strategy.layers_per_stage=1"], 63),
    "three_d_3d_q2_dp8": (["strategy=three_d", "strategy.tensor_grid=2"], 45),
    "tp_1d_p2_dp32": (["strategy=tp_1d", "strategy.tensor_grid=2"], 33),
    "one_f_one_b_pp2_dp32_bf16": (["strategy=one_f_one_b", "strategy.pipeline_degree=2", "model.layers=4",
                                   "hardware.precision=bf16-mixed"], 32),
    # GPU profiles (NCCL): the dry run's sends complete when the plan's peer has posted the receive
    "modular_pipeline_pp2_v2_dp32_a100": ([*A100, "strategy=modular_pipeline", "strategy.pipeline_degree=2",
                                           "model.layers=4"], 33),
    "zero_layered_pp2_dp32_a100": ([*A100, "strategy=zero_layered", "strategy.pipeline_degree=2",
                                    "model.layers=4"], 63),
    "gpipe_pp4_m8_dp16_a100": ([*A100, "strategy=gpipe", "strategy.pipeline_degree=4", "model.layers=4",
                                "strategy.layers_per_stage=1", "strategy.micro_batches=8"], 17),
}
GPU_CASES = [case for case in CASES if case.endswith("_a100")]
# Cases whose bytes agree but memory not yet: id -> why (xfail; the test fails once they agree).
# (Issue 32's ZBV under ZeRO, 5.3% under before, left it once the plan counted the split backward's
# recorded gradients: rank 1 ratio 0.968; with the table order and pending Ws priced at the moments
# they coexist with the stash and its own outputs in flight, cost.memory.pending_moments: 0.969; 0.948
# before those outputs were per moment, under the 5% in the full suite.)
MEMORY_GAPS = {}
NCCL_TOLERANCE = 0.015  # docs/plan.md: every role agrees within 1.5% (the test above holds them to 5%)


def config(overrides):
    return compose_config(*QUICK, f"data.global_batch_size={4 * WORLD}", "mode=plan", *overrides)


@pytest.mark.parametrize("case", list(CASES))
def test_every_roles_dry_run_agrees_with_the_analytic_plan(case):
    cfg = config(CASES[case][0])
    result = plan_result(cfg, WORLD)
    entries = cross_check(cfg, WORLD, result)
    assert len(entries) == len(result["roles"]) >= 1
    assert not dist.is_initialized() and "WORLD_SIZE" not in os.environ  # nothing leaks into the caller
    for entry in entries:
        print(case, describe(entry))
        assert sum(entry["dry_run_comm_bytes_per_step"].values()) > 0
        # Tensor-parallel strategies included: their loss's two scalars summed over data are in the plan.
        assert entry["collective_bytes_equal"] and entry["kinds_differing"] == []
    agree = [entry["memory_agrees"] and abs(entry["ratio"] - 1) <= MEMORY_TOLERANCE for entry in entries]
    if case in MEMORY_GAPS:
        assert not all(agree), f"{case}: every role's memory agrees now: take it out of MEMORY_GAPS"
        pytest.xfail(MEMORY_GAPS[case])
    assert all(agree), [entry["ratio"] for entry in entries]


@pytest.mark.parametrize("case", list(CASES))
def test_another_rank_of_the_role_issues_the_formulas_bytes(case):
    """A rank other than the role's first (other data and tensor indices) issues the same bytes
    per kind as cost/traffic.py's formula for its pipeline position, exactly; and leaves this
    process's rank-zero guard as it found it (Lightning sets it to the strategy's rank: left at
    rank 3, every later rank_zero_* log in the process was silent, a TensorBoard logger wrote nothing)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only
    overrides, rank = CASES[case]
    cfg = config(overrides)
    before = getattr(rank_zero_only, "rank", None)
    result = dry_run(cfg, rank, WORLD)
    assert rank != 0 and getattr(rank_zero_only, "rank", None) == before
    assert result["steps"] == 2 and result["world_size"] == WORLD
    expected = formula_bytes(cfg, WORLD, result["coordinates"]["pipeline"], result["vocabulary"])
    assert result["bytes_by_kind"] == {kind: pytest.approx(expected[kind], rel=1e-12, abs=0) for kind in KINDS}
    step = [c for c in result["collectives"] if c["phase"] == "step"]
    assert sum(c["bytes"] for c in step) == pytest.approx(sum(expected.values()), rel=1e-12)
    assert result["peak_compute_bytes"] > result["setup_peak_bytes"] > 0


@pytest.mark.parametrize("case", ["modular_pipeline_pp2_dp32", "zero_layered_pp2_dp32"])
def test_fake_tensors_hold_the_same_bytes_and_memory_as_real_ones(case):
    """FakeTensorMode (no storage allocated) gives the same collectives, step peak and setup peak;
    ZeRO too, now that its saved-tensor hooks key gathered buffers by storage, not address."""
    cfg = config(CASES[case][0])
    for rank in (0, CASES[case][1]):
        real, fake = dry_run(cfg, rank, WORLD), dry_run(cfg, rank, WORLD, fake_tensors=True)
        assert fake["bytes_by_kind"] == real["bytes_by_kind"]
        assert fake["peak_compute_bytes"] == real["peak_compute_bytes"]
        assert fake["setup_peak_bytes"] == real["setup_peak_bytes"]


def test_a_rank_on_the_last_of_64_nodes_issues_the_formulas_bytes():
    """The multi-node path at world 512 (64 nodes × 8): the last data replica's rank of a middle
    pipeline stage (node 63, its own NODE_RANK and LOCAL_RANK) issues the formula's bytes exactly."""
    world = 512
    cfg = compose_config(*QUICK, f"data.global_batch_size={2 * world}", "hardware.nodes=64", "hardware.devices_per_node=8",
                         "strategy=one_f_one_b", "strategy.pipeline_degree=4", "strategy.tensor_parallel=1d",
                         "strategy.tensor_grid=2", "model.layers=4", "strategy.layers_per_stage=1")
    result = dry_run(cfg, 509, world)
    assert result["coordinates"] == {"data": 63, "pipeline": 2, "tensor": 1}
    expected = formula_bytes(cfg, world, 2, result["vocabulary"])
    assert result["bytes_by_kind"] == {kind: pytest.approx(expected[kind], rel=1e-12, abs=0) for kind in KINDS}
    assert result["bytes_by_kind"]["all_reduce"] > 0 and result["bytes_by_kind"]["send_recv"] > 0


# ----- the analytic side: cost/traffic.py's formula for the same rank

TENSOR_FAMILIES = {"three_d": "3d", "tp_1d": "1d", "tp_2d": "2d"}


def formula_bytes(cfg, world_size: int, pipeline_rank: int, vocabulary: int) -> dict:
    """cost/traffic.py's bytes per kind for one rank at `pipeline_rank`, for the pipeline
    strategies (plain, composed with a tensor grid, ZeRO-layered) and the tensor-parallel ones (one
    stage holding every layer, one micro-batch of the rank's rows, one gradient reduction)."""
    from layerwise.planning.inputs import PLANNED, training_plan_of, workload_of
    from cost.step_time import rank_traffic
    from strategies.schedule import add_communication, add_gradient_reductions, build_plan
    from cost.inputs import GptShape
    from layerwise.config.layout import layout_of
    from parallel.dims import Layout
    from cost.traffic import all_reduce, step_traffic
    strategy, name = cfg.strategy, cfg.strategy.name
    degrees = layout_of(cfg, world_size)
    if name in PLANNED:  # the pipelines: the very workload and plan plan mode uses
        traffic = rank_traffic(workload_of(cfg, world_size, vocabulary), training_plan_of(cfg), pipeline_rank)
        return {kind: float(traffic.get(kind, 0.0)) for kind in KINDS}
    if name not in TENSOR_FAMILIES:
        raise ValueError(f"formula_bytes covers the planned pipelines and {sorted(TENSOR_FAMILIES)}, not {name!r}")
    shape = GptShape(cfg.model.hidden, cfg.model.mlp_ratio, vocabulary, cfg.data.sequence_length,
                     cfg.model.max_sequence_length)
    layout = Layout(degrees.data, 1, TENSOR_FAMILIES[name], strategy.tensor_grid)
    plan = add_gradient_reductions(add_communication(build_plan("gpipe", pipeline_degree=1, stages=1,
                                                                micro_batches=1)))
    traffic = step_traffic(plan, layout, pipeline_rank, shape, cfg.model.layers,
                           cfg.data.global_batch_size // degrees.data)
    # Not in traffic.py (its head_traffic is the pipelines' loss, normalised per data rank):
    # the tensor-parallel strategies normalise over the whole batch (parallelize's
    # loss_over_data=True), so the loss's valid-token count and total are summed over data too.
    traffic["all_reduce"] += 2 * all_reduce(1, degrees.data)
    return {kind: float(traffic.get(kind, 0.0)) for kind in KINDS}
@pytest.mark.parametrize("case", GPU_CASES)
def test_a_gpu_profiles_dry_run_holds_the_sends_nccl_would(case):
    """On a GPU profile the plan counts NCCL's releases (a send complete once the peer has posted its
    receive, docs/strategies/pipeline_memory.md) and the dry run emulates them: each role's first
    rank holds at most the plan's count of sends at once — equal — fewer than gloo's rule would keep,
    and its peak agrees with the plan within 1.5%."""
    cfg = config(CASES[case][0])
    plan = training_plan_of(cfg)
    entries = cross_check(cfg, WORLD, plan_result(cfg, WORLD))
    for entry in entries:
        rank = entry["pipeline_rank"]
        print(case, describe(entry), "sends held", entry["most_sends_held"])
        assert entry["emulated"]["pipeline send completes when received (NCCL)"] > 0
        assert entry["most_sends_held"] == most_sends_held(plan, rank, completes_when_received=True)
        assert entry["most_sends_held"] < most_sends_held(plan, rank)
        assert abs(entry["ratio"] - 1) <= NCCL_TOLERANCE, entry["ratio"]
