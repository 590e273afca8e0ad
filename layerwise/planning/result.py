"""What plan.json holds for any planned strategy: the pipeline family's simulated plan, PipeFisher's
(planning/pipefisher.py) and L2L's relay in closed form."""

from cost.inputs import Workload
from layerwise.planning.context import context_plan
from layerwise.planning.experts import experts_plan
from cost.memory import memory
from cost.relay import relay_host_memory, relay_memory, relay_step
from cost.step_time import predict_step
from cost.traffic import all_reduce
from layerwise.planning.inputs import (TENSOR_ONLY, compute_bytes, device_of, shape_of, training_plan_of,
                                       workload_of)
from layerwise.planning.pipefisher import pipefisher_plan_result
from layerwise.planning.roles import _result_header, _role, roles
from parallel.dims import Layout
from strategies.buckets import bucket_bytes
from strategies.registry import planned_as


def relay_plan_result(cfg, world_size: int) -> dict:
    """L2L's plan (cost/relay.py): one device per data replica relays the layers
    from its host store, and the data replicas all-reduce each stage's host gradient (`relay_step`)."""
    strategy, margin, device = cfg.strategy, cfg.plan.allocator_margin, device_of(cfg, world_size)
    weight_bytes = compute_bytes(cfg)
    workload = Workload(shape_of(cfg), cfg.model.layers, cfg.model.heads, Layout(world_size, 1), cfg.model.layers,
                        cfg.data.global_batch_size // (world_size * strategy.micro_batches), cfg.optimizer.name,
                        False, weight_bytes)
    step = relay_step(workload, device, strategy.micro_batches, cfg.hardware.host_device_bandwidth, weight_bytes,
                      strategy.constant_memory, overlap=strategy.prefetch,
                      bucket_bytes=bucket_bytes(strategy.bucket_mb))
    device_bytes = relay_memory(workload, strategy.micro_batches, strategy.constant_memory, weight_bytes,
                                cfg.plan.flash_attention)
    host_bytes = relay_host_memory(workload, strategy.micro_batches, strategy.constant_memory)
    return {**_result_header(cfg, world_size, workload, device, step["step_seconds"]),
            "bubble_fraction": 0.0, "exposed_transfer_s": step["exposed_transfer_seconds"],
            "host_bytes": host_bytes, "host_fits": sum(host_bytes.values()) <= cfg.hardware.host_memory_bytes,
            "roles": [_role("every data rank (device)", [0], device_bytes, margin, device)]}


def plan_result(cfg, world_size: int, with_timeline: bool = False):
    """What plan.json holds (and the simulated timeline if asked): the full plan path."""
    if planned_as(cfg.strategy.name) == "relay":
        result = relay_plan_result(cfg, world_size)
        return (result, None) if with_timeline else result
    if planned_as(cfg.strategy.name) == "pipefisher":  # K-FAC in the bubbles: layerwise/planning/pipefisher.py
        result, timeline = pipefisher_plan_result(cfg, world_size)
        return (result, timeline) if with_timeline else result
    workload, device, schedule = workload_of(cfg, world_size), device_of(cfg, world_size), training_plan_of(cfg)
    step = predict_step(workload, device, schedule)
    if cfg.strategy.name in TENSOR_ONLY:  # their loss also sums its token count and total over data
        for traffic in step["bytes_by_rank"]:  # (parallelize's loss_over_data): two scalars all-reduced
            traffic["all_reduce"] += 2 * all_reduce(1, workload.layout.data)
    per_rank = [memory(workload, schedule, rank, cfg.plan.flash_attention) for rank in range(schedule.pipeline_degree)]
    margin = cfg.plan.allocator_margin
    result = {**_result_header(cfg, world_size, workload, device, step["step_seconds"]),
              "bubble_fraction": step["bubble_fraction"], "exposed_data_s": step["exposed_data_seconds"],
              "comm_bytes_per_step_by_pipeline_rank": step["bytes_by_rank"],
              "roles": [_role(label, ranks, breakdown, margin, device) for label, ranks, breakdown in roles(per_rank, schedule.placement[-1])]}
    if workload.layout.context > 1:
        result["context"] = context_plan(workload, device)
    if workload.shape.block.experts:  # a mixture of experts (layerwise/planning/experts.py)
        result["experts"] = experts_plan(cfg, workload, device)
    return (result, step["timeline"]) if with_timeline else result
