"""Plan mode prices what our strategies do, from the config alone (issue 56 item 3): the strategy's
switches become cost.inputs.Workload's fields in one place (layerwise/planning/inputs.py
`communication_of`), and the step and the bytes follow them kind by kind."""

from dataclasses import replace

import pytest

from cost.step_time import exposed_reduction_seconds, receive_seconds, reduction_seconds
from cost.traffic import step_traffic
from layerwise.planning.inputs import device_of, training_plan_of, workload_of
from layerwise.preflight import validate
from tests.ranks import compose_config

# 1F1B p2 × 1-D 2 × data 2 of gpt_small (6 blocks) on 8 A100s, bf16 autocast: every switch acts
LAYOUT = ["mode=plan", "model=gpt_small", "model.heads=8", "hardware=dgx_a100_80g", "hardware.nodes=1",
          "hardware.precision=bf16-mixed", "strategy=one_f_one_b", "strategy.pipeline_degree=2",
          "strategy.layers_per_stage=3", "strategy.tensor_parallel=1d", "strategy.tensor_grid=2",
          "strategy.micro_batches=4", "data.global_batch_size=16"]


def planned(*overrides):
    cfg = compose_config(*LAYOUT, *overrides)
    world = validate(cfg)
    return cfg, workload_of(cfg, world), device_of(cfg, world)


def test_the_defaults_are_megatrons_and_each_switch_turns_its_field_off():
    """Defaults: 16-bit messages, scatter/gather, the reduction under the backward, 16-bit tensor
    collectives (strategy.tensor_collective_dtype=compute), fp32 gradient reductions
    (strategy.reduction_dtype=fp32: Megatron-LM's under --bf16); the switches off give the workload
    of a strategy without them."""
    _, workload, _ = planned()
    assert (workload.message_bytes, workload.tensor_bytes, workload.reduction_bytes) == (2, 2, 4)
    assert workload.scatter_gather and workload.reduction_overlaps_backward
    assert not (workload.sequence_parallel or workload.tensor_overlap or workload.distributed_optimizer
                or workload.recompute_attention or workload.attention_scores)
    _, off, _ = planned("strategy.message_dtype=fp32", "strategy.scatter_gather=false",
                        "strategy.overlap_reduction=false")
    assert off.message_bytes == 4 and not off.scatter_gather and not off.reduction_overlaps_backward
    _, fp32, _ = planned("hardware.precision=32-true")
    assert fp32.message_bytes == 4  # the compute dtype is fp32 there


def test_tensor_collective_and_reduction_dtypes_map_to_their_bytes():
    """tensor_bytes: 2 under bf16-mixed with tensor_collective_dtype=compute on the 1-D grid, else 4
    (fp32 sums; 32-true; the 2-D grid, which keeps fp32 sums); reduction_bytes: 2 with
    reduction_dtype=compute under 16-bit precision, 4 otherwise. A stage's data reduction costs its
    bytes: half the wire seconds in 16 bits (the latency apart)."""
    cases = {(): (2, 4), ("strategy.tensor_collective_dtype=fp32",): (4, 4),
             ("strategy.reduction_dtype=compute",): (2, 2),
             ("hardware.precision=32-true", "strategy.reduction_dtype=compute"): (4, 4),
             ("strategy.tensor_parallel=2d",): (4, 4)}
    for overrides, expected in cases.items():
        workload = planned(*overrides)[1]
        assert (workload.tensor_bytes, workload.reduction_bytes) == expected, overrides
    _, fp32, device = planned()
    _, narrow, _ = planned("strategy.reduction_dtype=compute")
    latency = device.collective_latency_s
    assert reduction_seconds(narrow, device, 0, 2) - latency == pytest.approx(
        (reduction_seconds(fp32, device, 0, 2) - latency) / 2, rel=1e-9)


def test_sequence_parallelism_distributed_optimizer_and_selective_recomputation_map_to_their_fields():
    _, workload, _ = planned("strategy.sequence_parallel=true", "strategy.tensor_overlap=true",
                             "strategy.distributed_optimizer=true", "strategy.activation_recompute=selective",
                             "plan.flash_attention=false")
    assert workload.sequence_parallel and workload.tensor_overlap and workload.distributed_optimizer
    assert workload.recompute_attention and not workload.recompute and workload.attention_scores
    assert not workload.scatter_gather  # the sequence-parallel stream is the 1/t shard already
    assert workload.message_elements == workload.piece == planned()[1].piece / 2  # the piece is the 1/t shard


def test_a_strategy_without_the_switches_gets_what_it_does_without_them():
    """tp_1d has no message_dtype, scatter_gather or overlap_reduction: fp32 whole messages (none at
    p = 1 anyway) and the reduction after the backward, as before issue 56."""
    cfg = compose_config("mode=plan", "model=gpt_small", "model.heads=8", "hardware=dgx_a100_80g",
                         "strategy=tp_1d", "strategy.tensor_grid=4", "data.global_batch_size=16")
    workload = workload_of(cfg, validate(cfg))
    assert workload.message_bytes == 4 and not workload.scatter_gather and not workload.reduction_overlaps_backward


def test_a_message_costs_its_bytes_and_the_bytes_follow_the_switches():
    """16-bit messages halve a receive's bytes and scatter/gather divides them by t (the link's
    latency apart); traffic.py's send bytes likewise, plus each receive's all-gather of the slices:
    (t − 1)/t of the 16-bit piece."""
    cfg, plain, device = planned("strategy.message_dtype=fp32", "strategy.scatter_gather=false")
    _, narrow, _ = planned("strategy.scatter_gather=false")
    _, scattered, _ = planned()
    latency = device.point_to_point_latency_s or device.collective_latency_s
    wire = [receive_seconds(workload, device) - latency for workload in (plain, narrow, scattered)]
    assert wire[1] == pytest.approx(wire[0] / 2, rel=1e-12) and wire[2] == pytest.approx(wire[0] / 4, rel=1e-12)
    plan = training_plan_of(cfg)
    rank, t = 1, 2  # the last rank: it receives as many messages (activations) as it sends (gradients)
    whole = step_traffic(plan, plain.layout, rank, plain.shape, 3, plain.micro_batch_rows)
    sliced = step_traffic(plan, scattered.layout, rank, scattered.shape, 3, scattered.micro_batch_rows, 2, t, True)
    assert sliced["send_recv"] == pytest.approx(whole["send_recv"] / (2 * t), rel=1e-12)
    sends = whole["send_recv"] / (plain.piece * 4)
    assert sliced["all_gather"] - whole["all_gather"] == pytest.approx(sends * (t - 1) / t * plain.piece * 2, rel=1e-12)


def test_the_reduction_is_priced_as_the_switches_say():
    """Overlapped: only what outlasts the stage's last backward is exposed; the distributed
    optimizer reduce-scatters (half an all-reduce's bytes); fp32 gradients either way. A device
    without overlap (a CPU whose ranks use every core) pays it whole."""
    cfg, workload, device = planned("strategy.overlap_reduction=false")
    after = exposed_reduction_seconds(workload, device, 0, 2)
    assert after == reduction_seconds(workload, device, 0, 2) > 0
    overlapped = replace(workload, reduction_overlaps_backward=True)
    assert exposed_reduction_seconds(overlapped, device, 0, 2) < after
    assert exposed_reduction_seconds(overlapped, replace(device, overlaps_communication=False), 0, 2) == after
    sharded = replace(workload, distributed_optimizer=True)
    assert reduction_seconds(sharded, device, 0, 2) == pytest.approx(after / 2, rel=1e-12)
