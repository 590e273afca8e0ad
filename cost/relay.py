"""L2L's relay in closed form (docs/strategies/l2l.md, Pudipeddi et al. 2020): one device relays the
layers from the host store, so its memory is a stage or two and the stash, the host holds the
fp32 state, and a step is the two sweeps with the weights' copies beside the compute.

  relay_stage_parameters  elements of each stage as strategies/l2l.py moves them;
  relay_memory            the device's peak bytes (a stage's backward);
  relay_host_memory       the host store's bytes;
  relay_step              the step: compute per stage from cost/step_time.py's stage_seconds,
                          the copies, the exposed update and reductions, the framework's costs.
"""

from dataclasses import replace

from cost.inputs import BYTES, OPTIMIZER_STATE, Device, Workload
from cost.memory import block_saved_bytes
from cost.step_time import collective_seconds, stage_seconds
from cost.traffic import all_reduce, local_parameters
from strategies.schedule.offload import relay_plan


def relay_stage_parameters(workload: Workload) -> list:
    """Elements of each relay stage as strategies/l2l.py moves them: embed, the L blocks, the head
    (traffic.local_parameters' head: BERT's extra transform, h² + 5h, is left out)."""
    shape = workload.shape
    embed = local_parameters(None, 1, shape, True, 0, False)["all"]
    block = local_parameters(None, 1, shape, False, 1, False)["all"]
    head = local_parameters(None, 1, shape, False, 0, True)["all"]
    return [embed] + [block] * workload.layers + [head]


def relay_memory(workload: Workload, micro_batches: int, constant_memory: bool, weight_bytes: int,
                 flash: bool = True) -> dict:
    """Device bytes at the relay's peak, the backward of some stage s (its recompute with autograd):
    s's weights and the prefetched s − 1's (two layers in flight) and s's gradient buffer, in the
    compute dtype (cross mixed precision: fp32 masters and optimizer stay on the host); one
    micro-batch's working set (a recomputed block's saved tensors and their gradients, 2 ×
    block_saved_bytes; at the head its logits and their gradient); the stash — standard: the stage
    inputs of every micro-batch still needed, at most (L + 1)·m pieces; constant variant: on the
    host, so only the micro-batch's x, dy and dx pieces are on the device. Only the standard stash
    grows with L or m."""
    stages, last = relay_stage_parameters(workload), workload.layers + 1
    piece = workload.piece * workload.activation_bytes
    tokens = workload.micro_batch_rows * workload.shape.length
    working = {"block": 2 * block_saved_bytes(workload, tokens, flash),
               "head": 2 * tokens * workload.shape.vocabulary * BYTES, "embed": 0}
    peaks = []
    for stage in range(last + 1):
        stash = 0 if constant_memory else min(stage + 1, last) * micro_batches * piece
        in_flight_weights = stages[stage] + (stages[stage - 1] if stage > 0 else 0)
        part = "embed" if stage == 0 else "head" if stage == last else "block"
        peaks.append({"parameters": in_flight_weights * weight_bytes, "gradients": stages[stage] * weight_bytes,
                      "optimizer": 0, "activations": stash + working[part],
                      "buffers": 3 * piece if constant_memory else 0})
    return max(peaks, key=lambda peak: sum(peak.values()))


def relay_host_memory(workload: Workload, micro_batches: int, constant_memory: bool) -> dict:
    """Host (eager parameter server) bytes as strategies/l2l.py keeps them: fp32 master weights, fp32
    gradients of every stage (accumulated into param.grad), the optimizer state (OPTIMIZER_STATE fp32
    tensors per parameter), and in the constant variant the stash: the L + 1 stage inputs of every
    micro-batch, plus one stage's input gradients on the way back."""
    parameters = sum(relay_stage_parameters(workload))
    stash = (workload.layers + 2) * micro_batches * workload.piece * workload.activation_bytes
    return {"parameters": parameters * BYTES, "gradients": parameters * BYTES,
            "optimizer": OPTIMIZER_STATE.get(workload.optimizer, 2) * parameters * BYTES,
            "activations": stash if constant_memory else 0, "buffers": 0}


def relay_step(workload: Workload, device: Device, micro_batches: int, host_device_bandwidth: float,
               weight_bytes: int, constant_memory: bool, overlap: bool = True, bucket_bytes: float = 0) -> dict:
    """Predicted relay step. Compute per stage and micro-batch: F from FLOPs (forward_flops; the
    embedding lookup is free), and in the backward the recompute plus the backward, 3F — 4F a step
    against plain training's 3F. Copies over the host link, in the compute dtype: each stage's
    weights twice and its gradient once (3·bytes·P, independent of m); the constant variant adds
    its stash, per micro-batch and stage boundary x out and in (forward), x in, dy in, dx out
    (backward). With `overlap` (a copy stream prefetching the next stage: the paper's) each stage
    costs the longer of its compute and the copies issued beside it; without, they add up (the
    bound offload.transfer_cost gives the simulator). The host's eager update of the last stage
    reached (the embedding) is the only update exposed: the worker thread updates every other stage
    while the device runs the earlier ones (on a CPU device every update runs in place). Data
    replicas (the layout's data axis) all-reduce each stage's fp32 host gradient before its update,
    in buckets of at most `bucket_bytes` (strategies/l2l.py HostStore; 0, one per tensor, is priced
    as one per stage), exposed as the updates are. The framework's costs: one per step and one per
    action of the relay's plan."""
    stages = relay_stage_parameters(workload)
    block = stage_seconds(replace(workload, layers_per_stage=1, recompute=False), device, 0, 2)[0]
    head = stage_seconds(replace(workload, layers_per_stage=0, recompute=False), device, 1, 2)[0]
    forward = [0.0] + [block] * workload.layers + [head]
    piece = workload.piece * workload.activation_bytes * micro_batches / host_device_bandwidth
    copy = [parameters * weight_bytes / host_device_bandwidth for parameters in stages]
    overlap = overlap and device.overlaps_communication  # a CPU's copies take the cores the compute uses
    last, combine = len(stages) - 1, (max if overlap else lambda a, b: a + b)
    seconds = copy[0]  # the first stage's weights: nothing to hide behind
    for stage in range(last + 1):  # forward sweep: next stage's weights; constant: x in, y out
        stash = ((stage > 0) + (stage < last)) * piece if constant_memory else 0.0
        seconds += combine(micro_batches * forward[stage], (copy[stage + 1] if stage < last else 0.0) + stash)
    seconds += copy[last]  # the backward turns at the head: its weights again
    for stage in range(last, -1, -1):  # backward sweep: previous weights, this gradient; x in, dy in, dx out
        stash = (2 * (stage > 0) + (stage < last)) * piece if constant_memory else 0.0
        seconds += combine(3 * micro_batches * forward[stage], (copy[stage - 1] if stage > 0 else 0.0)
                           + copy[stage] + stash)
    compute = 4 * micro_batches * sum(forward)
    transfer = 3 * sum(copy) + (5 * last * piece if constant_memory else 0.0)
    # the embedding's eager update comes last; on a CPU device (no overlap) the host store updates every
    # stage in place (strategies/l2l.py HostStore), so every update adds
    seconds += (stages[0] if overlap else sum(stages)) * device.optimizer_seconds_per_parameter
    data = workload.layout.data
    if data > 1:
        reductions = [collective_seconds(device, all_reduce(parameters, data), data,
                                         count=-(-parameters * BYTES // bucket_bytes) if bucket_bytes else 1)
                      for parameters in stages]
        seconds += reductions[0] if overlap else sum(reductions)
    actions = sum(action is not None for action in relay_plan(len(stages), micro_batches, reduce=data > 1).ranks[0])
    seconds += device.step_overhead_s + actions * device.action_overhead_s
    return {"step_seconds": seconds, "compute_seconds": compute, "transfer_seconds": transfer,
            "exposed_transfer_seconds": seconds - compute}
