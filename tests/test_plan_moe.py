"""Plan mode prices mixtures of experts (issue 58 item 6; cost/experts.py, layerwise/planning/experts.py):
active against total parameters, expert memory per rank, the all-to-all inside and across nodes,
the load-imbalance assumption, the search over e, and plan.json's `experts`."""

import dataclasses

import pytest

from cost.experts import (block_exchange_seconds, busiest, computed_weights, dispatch_bytes, dispatch_seconds,
                          dispatch_split, rank_imbalance)
from cost.memory import stage_parameters, stage_memory
from cost.inputs import BYTES
from layerwise.planning.experts import expert_degrees, parameter_counts
from layerwise.planning.inputs import device_of, workload_of
from layerwise.planning.result import plan_result
from layerwise.planning.search import layouts
from models import blocks_of
from models.transformer import model_flops_per_token
from tests.ranks import compose_config

MIXTRAL = ("model=mixtral_8x7b", "hardware=dgx_h100", "data=token_bin", "data.vocab_size=32000",
           "data.sequence_length=4096")


def mixtral(*overrides, nodes: int = 8):
    return compose_config("mode=plan", *MIXTRAL, f"hardware.nodes={nodes}", *overrides)


def with_layout(workload, **degrees):
    return dataclasses.replace(workload, layout=dataclasses.replace(workload.layout, **degrees))


def test_mixtral_active_and_total_parameters_are_the_published_ones():
    """Jiang et al. 2024 §2.1: 46.7B parameters, 12.9B used per token (rounded to 0.1B: ±0.05B, so a
    relative tolerance of 0.05/12.9 = 0.4%). MFU's FLOPs count the active weights (6 per weight per
    token), never all eight experts."""
    cfg = mixtral()
    counts = parameter_counts(cfg.model, 32000)
    assert counts["total"] == pytest.approx(46.7e9, rel=0.05 / 46.7)
    assert counts["active"] == pytest.approx(12.9e9, rel=0.05 / 12.9)
    flops = model_flops_per_token(cfg.model.layers, cfg.model.hidden, 4096, 32000, cfg.model.mlp_ratio,
                                  blocks_of(cfg.model)[0], blocks_of(cfg.model))
    attention = 12 * 32 * 32 * 128 * 4096  # PaLM's 12·L·heads·d·s
    weights = 32 * blocks_of(cfg.model)[0].active_matmul_weights() + 4096 * 32000  # blocks + output projection
    assert flops == 6 * weights + attention
    assert 6 * weights == pytest.approx(6 * (counts["active"] - 32000 * 4096 - 32 * 2 * 4096 - 4096), rel=1e-3)


def test_expert_memory_per_rank_against_a_hand_count():
    """A rank of an e-way expert group holds the dense weights and E/e experts of each block; ZeRO
    shards the dense part over d and the local experts over d/e, i.e. 1/d of the whole model."""
    h, v, layers = 4096, 32000, 32
    attention = 2 * h * h + 2 * h * 1024  # q, o and the 8-head k, v
    expert, router, norms = 3 * h * 14336, h * 8, 2 * h
    for e in (1, 2, 4, 8):
        cfg = mixtral("strategy=modular_pipeline", "strategy.pipeline_degree=1", "strategy.layers_per_stage=32",
                      "strategy.micro_batches=8", "data.global_batch_size=64")
        workload = with_layout(workload_of(cfg, 64), expert=e)
        held = stage_parameters(workload, 0, 1)  # one stage: the whole model on the rank
        hand = v * h + layers * (attention + router + norms + 8 // e * expert) + h * v + h
        assert held == hand
        zero = with_layout(workload, zero=True)
        bytes_by_kind = stage_memory(zero, [0], 1, 1)
        whole = v * h + layers * (attention + router + norms + 8 * expert) + h * v + h
        assert bytes_by_kind["parameters"] == pytest.approx(whole * BYTES / 64, rel=1e-12)


def test_imbalance_is_one_at_one_rank_and_the_busiest_expert_at_one_expert_per_rank():
    assert rank_imbalance(8, 1, 1.25) == 1.0
    assert rank_imbalance(8, 8, 1.25) == 1.25
    assert rank_imbalance(128, 8, 1.25) == pytest.approx(1 + 0.25 * 7 / 127)
    cfg = mixtral("strategy=zero_layered", "strategy.micro_batches=4", "data.global_batch_size=256")
    workload = with_layout(workload_of(cfg, 64), expert=8)
    assert workload.expert_imbalance == 1.25  # plan.expert_load_imbalance's default
    block = workload.shape.block
    dense = block.matmul_weights() - 8 * block.expert_weights()
    assert computed_weights(workload) == dense + 2 * block.expert_weights() * 1.25


def test_all_to_all_inside_a_node_and_across_nodes():
    """One dispatch of a rank's T = 4096 tokens × k = 2 rows of h = 4096 bf16 values: (e − 1)/e of
    them leave the rank; the members on its node take theirs over NVLink (450 GB/s), the rest over
    one device's network link (50 GB/s), both at once."""
    cfg = mixtral("strategy=zero_layered", "strategy.micro_batches=4", "data.global_batch_size=256",
                  "plan.expert_load_imbalance=1.0")
    device = device_of(cfg, 64)
    base = workload_of(cfg, 64)
    rows = 4096 * 2 * 4096 * 2  # T·k·h·bytes
    inside_node = with_layout(base, expert=8)  # data ranks 0-7: one node
    assert dispatch_bytes(inside_node) == rows * 7 / 8
    assert dispatch_split(inside_node, device) == (rows * 7 / 8, 0.0)
    assert dispatch_seconds(inside_node, device) == pytest.approx(rows * 7 / 8 / 4.5e11)
    two_nodes = with_layout(base, expert=16)  # 8 members here, 8 on the next node
    inside, across = dispatch_split(two_nodes, device)
    assert (inside, across) == pytest.approx((rows * 15 / 16 * 7 / 15, rows * 15 / 16 * 8 / 15))
    assert dispatch_seconds(two_nodes, device) == pytest.approx(max(inside / 4.5e11, across / 5e10))
    assert dispatch_seconds(two_nodes, device) > 5 * dispatch_seconds(inside_node, device)
    forward, backward = block_exchange_seconds(two_nodes, device)
    assert (forward, backward) == pytest.approx((2 * dispatch_seconds(two_nodes, device),) * 2)


def test_the_busiest_rank_sends_its_share_more():
    cfg = mixtral("strategy=zero_layered", "strategy.micro_batches=4", "data.global_batch_size=256")
    workload = with_layout(workload_of(cfg, 64), expert=8)
    assert busiest(workload) == 1.25
    assert dispatch_bytes(workload) == 4096 * 2 * 4096 * 2 * 7 / 8 * 1.25


def test_the_search_ranges_over_the_expert_degree():
    """Every e dividing both the data degree and E = 8, on every layout the families' checks accept."""
    cfg = compose_config("mode=plan", "plan.search=true", *MIXTRAL, "hardware.nodes=1", "model.layers=4",
                         "data.global_batch_size=16")
    assert expert_degrees(cfg.model, 8) == [1, 2, 4, 8] and expert_degrees(cfg.model, 6) == [1, 2]
    seen, grids = {}, set()
    for point in layouts(cfg, 8):
        seen.setdefault(point.data_degree, set()).add(point.expert_parallel)
        grids.add(point.tensor_parallel)
    assert grids == {"none"}  # strategies/checks.py model_grid_errors: a tensor grid does not shard experts
    assert seen[8] == {1, 2, 4, 8} and seen[4] == {1, 2, 4} and seen[2] == {1, 2}
    dense = compose_config("mode=plan", "plan.search=true", "model=llama_tiny", "hardware.nodes=1")
    assert expert_degrees(dense.model, 8) == [1]


def test_plan_json_has_the_experts():
    cfg = mixtral("strategy=zero_layered", "strategy.micro_batches=4", "data.global_batch_size=256",
                  "strategy.expert_parallel=8", "strategy.activation_recompute=full")
    result = plan_result(cfg, 64)
    experts = result["experts"]
    assert result["layout"]["expert"] == 8
    assert (experts["experts"], experts["experts_per_token"], experts["expert_parallel"], experts["local_experts"]) \
        == (8, 2, 8, 1)
    assert experts["expert_load_imbalance_assumed"] == 1.25 and experts["busiest_rank_load_over_mean"] == 1.25
    assert experts["parameters_active"] < experts["parameters_total"] / 3
    assert experts["expert_group_members_per_node"] == 8 and experts["all_to_all_bytes_inter_node_per_step"] == 0
    # 4 micro-batches × 32 blocks × (2 forward + 2 recomputed + 2 backward) all-to-alls of one dispatch each
    one = 4096 * 2 * 4096 * 2 * 7 / 8 * 1.25
    assert experts["all_to_all_bytes_intra_node_per_step"] == pytest.approx(4 * 32 * 6 * one)
    assert result["comm_bytes_per_step_by_pipeline_rank"][0]["all_to_all"] == pytest.approx(4 * 32 * 6 * one)
    assert experts["expert_parameter_bytes_per_rank"] == 32 * 3 * 4096 * 14336 * BYTES


def test_the_whole_model_count_holds_the_routed_experts():
    """cost/traffic.py model_parameters (the one count) against the parameters an all-MoE model holds;
    plan.json's parameters_total is the same count."""
    from cost.traffic import model_parameters
    from layerwise.planning.inputs import shape_of
    from models import build_model
    cfg = compose_config("model=moe_tiny")
    model = build_model("llama", vocab_size=256, sequence_length=64, layers=2, hidden=64, heads=4, kv_heads=2,
                        ffn_hidden=128, experts=8, experts_per_token=2, moe_ffn_hidden=64)
    held = sum(p.numel() for p in model.parameters())
    assert model_parameters(shape_of(cfg), 2) == held
    assert parameter_counts(cfg.model, 256)["total"] == held


def test_dense_blocks_among_moe_ones_and_the_experts_reduction():
    """moe_small (blocks 1-3 MoE: 8 experts of 256, top 2, one shared expert; block 0 dense) under ddp
    with e = 2 on 4 ranks: the experts' terms count 3 of 4 blocks (Workload.moe_share), the split
    experts' gradients are all-reduced over their d/e = 2 expert-data ranks and the rest over the 4
    data ranks; the all-to-all sends half of each rank's 512 tokens × 2 rows of 128 fp32 values, 4
    times per MoE block, × the busiest rank's 1 + 0.25·(2 − 1)/(8 − 1). (Measured on this run:
    docs/plan.md, "Measured imbalance beside the assumption".)"""
    cfg = compose_config("mode=plan", "model=moe_small", "strategy=ddp", "strategy.expert_parallel=2",
                         "hardware.devices_per_node=4")
    result = plan_result(cfg, 4)
    traffic = result["comm_bytes_per_step_by_pipeline_rank"][0]
    h, attention, router, shared, norms = 128, 2 * 128 * 128 + 2 * 128 * 64, 128 * 8, 3 * 128 * 256, 2 * 128
    dense = 4 * (attention + router + shared + norms) + 256 * h + (h * 256 + h)  # block 0's SwiGLU as router + shared
    experts = 3 * 4 * 3 * 128 * 256  # 3 MoE blocks × E/e = 4 local experts
    assert traffic["all_reduce"] == pytest.approx(1.5 * dense * BYTES + 1.0 * experts * BYTES)
    one = 512 * 2 * 128 * 4 / 2 * (1 + 0.25 / 7)
    assert traffic["all_to_all"] == pytest.approx(3 * 4 * one)
    assert result["experts"]["parameters_total"] == 3117184  # blocks_of: the dense block 0 counted as it is
