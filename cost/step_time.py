"""The analytic plan of a pipeline-family layout: memory per pipeline rank and a predicted step.

Nothing here builds a model or a process group; it is what plan mode answers at full scale.
  memory    per pipeline rank: cost/memory.py (L2L's relay, memory and time: cost/relay.py);
  time      the one simulator (strategies/schedule/simulate.py) times the plan with F and B from
            FLOPs at the device's dense rate × an efficiency, a fixed cost per product, the blocks'
            non-product work (calibrated per activation element), the tensor grid's collectives
            inside them (latency × count + bytes, or a measured table), and receives from the activation piece over the
            link the pipeline crosses; the data-parallel reduction of the stage finished last is
            exposed, the others overlap the remaining backward (layered accumulation, docs/strategies/modular_pipeline.md),
            unless the device does not overlap communication (a CPU whose ranks use every core); then
            the slowest rank's optimizer step. Where the device's memory bandwidth is known (the GPU
            profiles), products run at their roofline and the memory-bound operators and the loss's
            passes over the logits are charged at that bandwidth; how the run's software sends
            (bytes per element of each kind, scatter/gather, bucketed or sharded reductions, overlapped tensor
            collectives) is the workload's (docs/plan.md, "Against published runs").
Where mode=calibrate measured them, a collective's seconds come from its table
(`collective_seconds`), and the framework's own costs per step and per action are added.
What it leaves out (said in docs/plan.md): allocator fragmentation, collectives' waits for
descheduled peers when ranks outnumber cores beyond the measured table, and any overlap of the
grid's collectives with compute unless the workload says so (`Workload.tensor_overlap`).
"""

import bisect
from collections import Counter
from typing import NamedTuple

from parallel.comm import KINDS
from cost.inputs import Device, Workload
from cost.memory import block_saved_bytes, split_backward_plan, stage_parameters  # the memory half
from strategies.schedule import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action, RECV_ACTIVATION, RECV_GRADIENT, REDUCE_GRADIENT,
                                 SEND_ACTIVATION, SEND_GRADIENT, simulate)
from strategies.schedule.zero import GATHER_FOR, GATHERS, REDUCE_SCATTER, compute_runs
from cost.inputs import BYTES
from cost.experts import (block_exchange_seconds, computed_weights, exchange_bytes, experts_product_seconds,
                          expert_reduction_bytes)
from cost.traffic import all_gather, all_reduce, block_traffic, grid_collectives, head_traffic, step_traffic
from cost.context import data_context_span, exchange_seconds, key_length


PRODUCTS_PER_BLOCK = 6  # per micro-batch forward: QKV, Q·Kᵀ, scores·V, the projection, the MLP's two


# ----- time

def forward_flops(workload: Workload, stage: int, stages: int) -> float:
    """One micro-batch through one stage, on one rank of the tensor grid: 2 FLOPs per weight per
    token for the blocks' matrix products, 4·s·h per token for attention (s the keys a query
    attends: under context parallelism the whole sequence, cost/context.py), plus the head's on the last."""
    shape = workload.shape
    h, tokens = shape.hidden, workload.micro_batch_rows * shape.length
    block = tokens * (2 * computed_weights(workload) + 4 * key_length(workload) * h)
    head = 2 * tokens * h * shape.vocabulary if stage == stages - 1 else 0
    return (workload.layers_per_stage * block + head) / workload.tensor_ranks


def link_bandwidth(device: Device, extent: int, stride: int = 1) -> float:
    """Bytes/s of a group whose members sit `stride` ranks apart across `extent` consecutive ranks
    (ranks fill nodes in order, the tensor axis innermost, so a tensor group has stride 1 and a data
    group stride tensor × pipeline). Inside one node: its links. Across nodes, NCCL runs one ring
    per NIC (its channels), so the r members a group has on each node move their share of the
    traffic over r devices' NICs at once, while the node's other groups use the other NICs: min(the
    node's links, r × a device's network bandwidth). One member per node (a data group over tensor-8
    nodes) gets one device's NIC; a 16-wide tensor group over two 8-GPU nodes gets all 8; a message
    between two ranks (`stride` = `extent`) one device's link."""
    if extent <= device.devices_per_node:
        return device.intra_node_bandwidth
    members = max(1, device.devices_per_node // stride)
    return min(device.intra_node_bandwidth, members * device.inter_node_bandwidth)


def collective_seconds(device: Device, sent_bytes: float, extent: int, count: int = 1, stride: int = 1) -> float:
    """`count` collectives over a group spanning `extent` consecutive ranks, its members `stride`
    apart, whose ranks send `sent_bytes` in all: each its latency plus its bytes over the group's
    link (`link_bandwidth`), or, where mode=calibrate measured a table of
    one collective's seconds against the bytes a rank sends, interpolated in it at the average size
    (linearly between rows; the first row's seconds below it; above it the last row's seconds plus
    the extra bytes over the link: a noisy last segment's slope can be negative, and a quick
    calibration's table ends at 256 KB)."""
    if not count:
        return 0.0
    table = device.collective_table
    if not table:
        return count * device.collective_latency_s + sent_bytes / link_bandwidth(device, extent, stride)
    size = sent_bytes / count
    sizes, seconds = [row[0] for row in table], [row[1] for row in table]
    if size <= sizes[0]:
        return count * seconds[0]
    if size >= sizes[-1]:
        return count * (seconds[-1] + (size - sizes[-1]) / link_bandwidth(device, extent, stride))
    index = bisect.bisect_left(sizes, size)
    low, high = index - 1, index
    slope = (seconds[high] - seconds[low]) / (sizes[high] - sizes[low])
    return count * (seconds[low] + slope * (size - sizes[low]))


def grid_seconds(workload: Workload, device: Device, stage: int, stages: int) -> float:
    """The tensor grid's collectives of one micro-batch's forward and backward through `stage`
    (the tensor axis is innermost, so a grid that fits a node crosses only its links)."""
    layout = workload.layout
    if not layout.tensor_grid:
        return 0.0
    # A 1-D grid's sums move `tensor_bytes` per element, sequence parallelism's gathers the compute
    # dtype (or less: a published run's); 2-D/3-D grids' collectives stay fp32 (cost/traffic.py).
    gathers, sums = min(workload.activation_bytes, workload.tensor_bytes), workload.tensor_bytes
    sequence = workload.sequence_parallel, gathers, sums
    traffic = Counter({k: v * workload.layers_per_stage for k, v in
                       block_traffic(layout.tensor_grid, layout.edge, workload.micro_batch_rows,
                                     workload.shape, *sequence).items()})
    if stage == stages - 1:
        traffic += head_traffic(layout.tensor_grid, layout.edge, workload.micro_batch_rows, workload.shape, *sequence)
    count = grid_collectives(layout.tensor_grid, workload.layers_per_stage, stage == stages - 1, workload.shape,
                             workload.sequence_parallel)
    return collective_seconds(device, sum(traffic.values()), workload.tensor_ranks, count)


def stage_seconds(workload: Workload, device: Device, stage: int, stages: int) -> tuple:
    """(forward, backward) seconds of one micro-batch through `stage`: the products (`products_seconds`:
    FLOPs at the achieved rate, or the roofline where the device's memory bandwidth is known) plus
    each product's fixed cost and the non-product work (`elementwise_seconds`); the blocks' B = 2F
    (3F with recomputation: their forward runs again), the head's 2F (it is not recomputed); the
    grid's collectives half in each, the forward's again in a recomputed backward (Megatron's f and g
    run in the recomputed forward too), hidden behind the products under `tensor_overlap`."""
    blocks, head = products_seconds(workload, device, stage, stages)
    loss_forward, loss_backward = loss_seconds(workload, device) if stage == stages - 1 else (0.0, 0.0)
    per_block = len(workload.shape.linears()) + 2  # the block description's linears, Q·Kᵀ and scores·V
    products = workload.layers_per_stage * per_block + (stage == stages - 1)  # + the head's
    blocks += products * device.matmul_overhead_s  # the backward's 2 (or 3) × F carries 2 (3) × as many
    blocks += elementwise_seconds(workload, device, stage == 0, stage == stages - 1)
    communication = grid_seconds(workload, device, stage, stages) / 2
    factor = 3.0 if workload.recompute else 2.0
    forward, backward = blocks + head + loss_forward, factor * blocks + 2.0 * head + loss_backward
    if workload.recompute_attention and not workload.recompute:
        backward += workload.layers_per_stage * core_attention_seconds(workload, device)
    # an MoE block's all-to-alls (cost/experts.py): dispatch and combine each way, again when recomputed
    exchange_forward, exchange_backward = block_exchange_seconds(workload, device)
    forward += workload.layers_per_stage * exchange_forward
    backward += workload.layers_per_stage * exchange_backward
    forward_sends, backward_sends = communication, communication * (factor - 1.0)
    # context parallelism's K/V exchange (cost/context.py): what the attention does not hide; a
    # recomputed backward runs the forward's again
    exchange = exchange_seconds(workload, device, collective_seconds, core_attention_seconds(workload, device))
    forward += exchange[0]
    backward += exchange[1] + (exchange[0] if workload.recompute else 0.0)
    if workload.tensor_overlap:  # Megatron-Core's userbuffers: each collective hides behind a product
        return max(forward, forward_sends), max(backward, backward_sends)
    return forward + forward_sends, backward + backward_sends


def products_seconds(workload: Workload, device: Device, stage: int, stages: int) -> tuple:
    """(blocks, head) seconds of one micro-batch's forward products through `stage` on one grid rank.
    Without the device's memory bandwidth: FLOPs (`forward_flops`) at peak × efficiency. With it, on
    no grid or Megatron's 1-D grid, each product at its roofline (Williams et al. 2009): the slower
    of 2·M·K·N FLOPs at peak × efficiency (the large-product rate) and its operands and result
    (M·K + K·N + M·N elements) over the memory bandwidth: skinny products under tensor parallelism
    and attention's per-head products (K = h/a) fall below the large-product rate."""
    shape, grid = workload.shape, workload.layout.tensor_grid
    if not device.memory_bandwidth or grid not in (None, "1d"):
        flops = forward_flops(workload, stage, stages)
        head = 2 * workload.micro_batch_rows * shape.length * shape.hidden * shape.vocabulary \
            / workload.tensor_ranks if stage == stages - 1 else 0
        rate = device.flops_per_second * device.efficiency
        # the blocks' linears at their own peak (FP8 under fp8-mixed), the rest at the compute dtype's
        linears = workload.layers_per_stage * 2 * workload.micro_batch_rows * shape.length * sum(
            fan_in * fan_out for fan_in, fan_out, _, _ in shape.linears()) / workload.tensor_ranks \
            if device.linear_peak != device.flops_per_second else 0
        return ((flops - head - linears) / rate + linears / (device.linear_peak * device.efficiency),
                head / rate)
    t, tokens, h = workload.tensor_ranks, workload.micro_batch_rows * shape.length, shape.hidden
    # the block description's linears, each cut as Megatron's 1-D grid cuts it (column: its outputs,
    # row: its inputs), and attention's two per-head products
    block = sum(roofline(workload, device, tokens, fan_in // (t if place == "second" else 1),
                         fan_out // (t if place == "first" else 1), peak=device.linear_peak)
                for fan_in, fan_out, place, _ in shape.linears())
    block += attention_products_seconds(workload, device)
    block += experts_product_seconds(workload, device, roofline)  # an MoE block's routed experts (cost/experts.py)
    head = roofline(workload, device, tokens, h, shape.vocabulary // t) if stage == stages - 1 else 0.0
    return workload.layers_per_stage * block, head


def roofline(workload: Workload, device: Device, m: int, k: int, n: int, count: int = 1,
             peak: float = None) -> float:
    """`count` M×K by K×N products: the slower of their FLOPs at the large-product rate (`peak`:
    the device's compute-dtype peak unless given, e.g. the blocks' linears under FP8) and their
    operands and results over the memory bandwidth (Williams et al. 2009)."""
    compute = 2 * m * k * n * count / ((peak or device.flops_per_second) * device.efficiency)
    moved = (m * k + k * n + m * n) * count * workload.activation_bytes
    return max(compute, moved / device.memory_bandwidth)


def attention_products_seconds(workload: Workload, device: Device) -> float:
    """A block's Q·Kᵀ and scores·V on one 1-D grid rank: per sequence and local head an s × d by
    d × s product and an s × s by s × d one (d = h/a), at their roofline; under context parallelism
    the rank's s/c queries against the sequence's s keys."""
    b, s, keys = workload.micro_batch_rows, workload.shape.length, key_length(workload)
    heads, width = workload.heads // workload.tensor_ranks, workload.shape.hidden // workload.heads
    return roofline(workload, device, s, width, keys, b * heads) + roofline(workload, device, s, keys, width, b * heads)


def core_attention_seconds(workload: Workload, device: Device) -> float:
    """What selective recomputation reruns per block (Korthikanti et al. 2022 §5): the core attention's
    forward, its two per-head products and its scores' memory-bound passes (softmax, dropout: the
    scores' bytes of `memory_bound_bytes_per_token`, written and read once). Without the device's
    memory bandwidth, the two products' FLOPs at the large-product rate. The sequence-parallel input
    the linears gather again in the backward is hidden under the input-gradient product (Megatron's
    LinearWithGradAccumulationAndAsyncCommunication issues it asynchronously before that product)."""
    b, s, h = workload.micro_batch_rows, workload.shape.length, workload.shape.hidden
    if not device.memory_bandwidth:
        return 4 * b * s * key_length(workload) * h / workload.tensor_ranks / (device.flops_per_second * device.efficiency)
    scores = memory_bound_bytes_per_token(workload.shape, workload.heads, key_length(workload))[2] / workload.tensor_ranks
    passes = 2 * b * s * scores / device.memory_bandwidth if workload.attention_scores else 0.0  # flash: inside the kernel
    return attention_products_seconds(workload, device) + passes


# Bytes per logit the loss moves on a GPU (Megatron's vocab-parallel cross-entropy,
# megatron/core/tensor_parallel/cross_entropy.py, in fp32 after `.float()`): forward — the 16-bit
# logits read and written in fp32 (2 + 4), max (4), subtract (4 + 4), exp (4 + 4), sum (4), the
# softmax's division (4 + 4); backward — softmax − one-hot scaled by the incoming gradient (4 + 4),
# and the cast back to 16 bits (4 + 2).
LOSS_FORWARD_BYTES, LOSS_BACKWARD_BYTES = 38, 14


def loss_seconds(workload: Workload, device: Device) -> tuple:
    """(forward, backward) seconds of the head's loss over one micro-batch's logits on one grid rank:
    memory-bound passes over tokens × V/T logits (LOSS_*_BYTES) at the device's memory bandwidth;
    0 without it (a CPU profile charges the head's elements in `elementwise_seconds`)."""
    if not device.memory_bandwidth:
        return 0.0, 0.0
    logits = workload.micro_batch_rows * workload.shape.length * workload.shape.vocabulary / workload.tensor_ranks
    return (logits * LOSS_FORWARD_BYTES / device.memory_bandwidth, logits * LOSS_BACKWARD_BYTES / device.memory_bandwidth)


def elementwise_seconds(workload: Workload, device: Device, embedding: bool = False, head: bool = False) -> float:
    """A stage's forward work besides its products, on one grid rank: per block a fixed cost plus a
    cost per activation element it saves (`block_saved_bytes`' count: the norms, softmax, GELU,
    dropout and additions between products touch those tensors, whole or split by the grid as the
    block keeps them); the embedding (lookup, position add, dropout: 2 elements per token and hidden
    unit) and the head (its norm, 2h, and the logits' softmax and loss, 2 per vocabulary entry, split
    by the grid) are charged alike. The backward carries 2× like the products (mode=calibrate fits the
    two constants on the model's own blocks, forward and backward together). A lone rank's threads
    (`Device.core_share` > 1) split the per-element part of operators above torch's grain size."""
    tokens, shape = workload.micro_batch_rows * workload.shape.length, workload.shape
    elements = workload.layers_per_stage * block_saved_bytes(workload, tokens, flash=True) / workload.activation_bytes
    elements += embedding * 2 * tokens * shape.hidden + head * tokens * (2 * shape.hidden + 2 * shape.vocabulary
                                                                       / workload.tensor_ranks)
    operators = workload.layers_per_stage + embedding + head
    threads = device.core_share if device.core_share > 1 and tokens * shape.hidden >= GRAIN_SIZE else 1.0
    seconds = operators * device.block_overhead_s + elements * device.activation_seconds_per_element / threads
    return seconds + workload.layers_per_stage * memory_bound_block_seconds(workload, device)


# torch splits an element-wise operator over its threads above this many elements (at::internal::GRAIN_SIZE,
# aten/src/ATen/Parallel.h). Measured on gpt_tiny, 8 blocks, 16 × 128 tokens (2 · 10^5 elements per tensor):
# one process's step 0.46 s on 1 thread, 0.245 s on 2, a 1.9× speed-up, not the products' alone (issue 31).
GRAIN_SIZE = 32768


def memory_bound_block_seconds(workload: Workload, device: Device) -> float:
    """A block's forward operators between products on a GPU (norms, softmax, the MLP's activation,
    dropout, RoPE, residual additions): memory-bound, so bytes ÷ the memory bandwidth. Bytes:
    `memory_bound_bytes_per_token` of the block description (Korthikanti et al. 2022 §4.1's
    34 + 5·a·s/h per token and hidden unit for GPT's block in 16-bit training; on a 1-D grid the
    residual stream's part stays whole, all split with sequence parallelism or a 2-D/3-D grid; the
    scores only where they are materialised), each written once and read once in the forward.
    0 without the device's memory bandwidth (a CPU profile calibrates these operators instead)."""
    if not device.memory_bandwidth:
        return 0.0
    t, tokens = workload.tensor_ranks, workload.micro_batch_rows * workload.shape.length
    split_stream = workload.sequence_parallel or workload.layout.tensor_grid not in (None, "1d")  # 2-D/3-D split it
    whole, split, scores = memory_bound_bytes_per_token(workload.shape, workload.heads, key_length(workload))
    per_token = whole / (t if split_stream else 1) + split / t + (scores / t if workload.attention_scores else 0)
    return 2 * tokens * per_token / device.memory_bandwidth


def memory_bound_bytes_per_token(shape, heads: int, keys: int = None) -> tuple:
    """(residual stream, split by a tensor grid, attention scores) bytes a block's forward saves per
    token in 16-bit training, from the block description (Korthikanti et al. 2022 §4.1 counts GPT's:
    10h + 24h + 5·a·s, which this reproduces):
    - residual stream: each norm's input and output, the next product's input (2 · 2h per norm), and
      one 1-byte dropout mask per sub-layer where the block trains with dropout — GPT's LayerNorm
      blocks do; Llama's recipe (RMSNorm, Touvron et al. 2023; Megatron's Llama examples set
      --attention-dropout 0 --hidden-dropout 0) has none;
    - split: q, k, v as the attention keeps them (heads·d + 2·kv_heads·d under grouped-query
      attention), the context (h), the MLP's wide tensors — GELU's input and output (2·ffn), SwiGLU's
      gate, up and their product (3·ffn: Megatron's fused bias_swiglu keeps no silu(gate)) — and
      RoPE's pass over q and k (rotated from the product's output: (heads + kv_heads)·d more),
      2 bytes each;
    - scores: per head s softmax outputs (2 bytes), with dropout its mask and output (1 + 2); s the
      `keys` a query attends (default the shape's length; the whole sequence under context parallelism)."""
    block, h = shape.block, shape.hidden
    dropout = block.norm == "layer"  # GPT/BERT blocks train with dropout, Llama's without (above)
    width = h / heads
    kv_heads = heads if block.kv_heads == block.heads else block.kv_heads  # GPT's default description: heads=1
    whole = len(block.norms) * 2 * 2 * h + (2 * h if dropout else 0)
    split = 2 * ((heads + 2 * kv_heads) * width + h + (3 if block.gated else 2) * shape.mlp_width)
    if block.rotary:
        split += 2 * (heads + kv_heads) * width
    scores = heads * (keys or shape.length) * (5 if dropout else 2)
    return whole, split, scores


def optimizer_seconds(workload: Workload, device: Device, stages: list, total_stages: int) -> float:
    """The optimizer step of a rank holding `stages`: its local parameters (ZeRO: its 1/n shard)
    × the calibrated seconds per parameter (0 in spec-sheet profiles)."""
    held = sum(stage_parameters(workload, stage, total_stages) for stage in stages)
    return (held / workload.layout.data_context if workload.layout.zero else held) * device.optimizer_seconds_per_parameter


def receive_seconds(workload: Workload, device: Device) -> float:
    """One boundary receive: the message (`Workload.message_elements`: the activation piece or its
    gradient, the same size, ÷ t where each tensor rank sends its slice) in `message_bytes` over the
    link pipeline neighbours cross (a tensor block apart; inside a node only if the whole pipeline
    is). The receivers' all-gather of the slices over NVLink is left out (t − 1 slices at NVLink's
    rate against one slice over InfiniBand), as Narayanan et al. 2021 §4.1 do."""
    latency = device.collective_latency_s if device.point_to_point_latency_s is None else device.point_to_point_latency_s
    extent = workload.tensor_ranks * workload.layout.pipeline  # one sender, one receiver: one device's link
    return latency + workload.message_elements * workload.message_bytes / link_bandwidth(device, extent, stride=extent)


def gather_seconds(workload: Workload, device: Device, stage: int, stages: int) -> float:
    """One ZeRO gather of a stage's shards over the data group (× the context shards: n ranks, (n − 1)/n
    of the stage's local parameters; the flat shards' padding to a multiple of n is left out)."""
    layout = workload.layout
    if not layout.zero or layout.data_context == 1:
        return 0.0
    held = stage_parameters(workload, stage, stages)
    extent, stride = data_context_span(workload, device)
    return collective_seconds(device, all_gather(held, layout.data_context), extent, stride=stride)


def step_cost(workload: Workload, device: Device, plan):
    """The simulator's cost of each action in seconds: F, B = (2 or 3)·F (a split backward's I and W
    half of B each), receive waits, and the
    part of each ZeRO gather its prefetch does not hide (`exposed_gathers`). Without overlap
    (`Device.overlaps_communication`), gathers are whole, every reduction is paid where it is issued
    and a send costs its sender the copy."""
    receive, overlap = receive_seconds(workload, device), device.overlaps_communication
    timings = {}

    def compute(action) -> float:
        if action.stage not in timings:
            timings[action.stage] = stage_seconds(workload, device, action.stage, plan.stages)
        forward, backward = timings[action.stage]
        if action.kind in (BACKWARD_INPUT, BACKWARD_WEIGHT):  # a split backward: each half of B (equal FLOPs)
            return backward / 2
        return backward if action.kind == BACKWARD else forward
    gathers = exposed_gathers(plan, compute, lambda stage: gather_seconds(workload, device, stage, plan.stages),
                              device.hidden_gather_fraction)
    send = 0.0 if overlap else receive  # gloo's send writes the message on the sender's core

    def cost(action) -> float:
        return own_cost(action) + device.action_overhead_s  # the executor's own cost of running it

    def own_cost(action) -> float:
        if action.kind in (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT):
            return compute(action)
        if action.kind in GATHERS:
            return gathers[action]
        if action.kind in (REDUCE_GRADIENT, REDUCE_SCATTER) and not overlap:
            return reduction_seconds(workload, device, action.stage, plan.stages)
        if action.kind in (SEND_ACTIVATION, SEND_GRADIENT):
            return send
        return receive if action.kind in (RECV_ACTIVATION, RECV_GRADIENT) else 0.0
    return cost


def exposed_gathers(plan, compute, gather, hidden: float) -> dict:
    """ZeRO posts each run's gather one run ahead (strategies/schedule/zero.py, double buffering):
    it overlaps the previous run's compute and only what that does not hide is exposed
    (`exposed_gather`); the first run's is whole. Reduce-scatters overlap the backward that follows
    (the last one is `reduction_seconds`)."""
    exposed = {}
    for row in plan.ranks:
        previous = 0.0
        for run in compute_runs(row):
            first = run[0][1]
            exposed[Action(GATHER_FOR[first.kind], first.stage, first.micro_batch)] = \
                exposed_gather(gather(first.stage), previous, hidden)
            previous = sum(compute(action) for _, action in run)
    return exposed


def exposed_gather(gather: float, behind: float, hidden: float) -> float:
    """The part of a posted gather of `gather` seconds that `behind` seconds of compute leave exposed:
    compute hides `hidden` of each second they overlap, gather − hidden · min(behind, gather).
    hidden = 1: NCCL's own stream, max(0, gather − behind); 0: paid whole. On a CPU gloo's thread
    needs the core the rank computes on, so only part hides: `Device.gather_overlap`, which
    mode=calibrate measures (layerwise/tools/calibrate.py, `measure_gather_overlap`)."""
    return gather - hidden * min(behind, gather)


def rank_traffic(workload: Workload, plan, pipeline_rank: int) -> Counter:
    """cost/traffic.py's bytes by kind for a rank at `pipeline_rank` of this workload."""
    split = round(workload.piece / workload.message_elements)  # t where each tensor rank sends its slice
    return step_traffic(plan, workload.layout, pipeline_rank, workload.shape, workload.layers_per_stage,
                        workload.micro_batch_rows, workload.message_bytes, split, split > 1,
                        workload.distributed_optimizer, workload.sequence_parallel, workload.activation_bytes,
                        workload.gradient_bucket_bytes // BYTES, workload.tensor_bytes, workload.reduction_bytes,
                        workload.context_comm, workload.recompute)


def predict_step(workload: Workload, device: Device, plan) -> dict:
    """Predicted step: makespan of the simulated plan + the exposed data-parallel reduction + the
    slowest rank's optimizer step, bubble fraction, and each pipeline rank's bytes by kind
    (cost/traffic.py)."""
    step = simulated_step(workload, device, plan)
    traffic = [rank_traffic(workload, plan, rank) for rank in range(plan.pipeline_degree)]
    for rank, counted in enumerate(traffic):  # an MoE block's all-to-alls (cost/experts.py)
        counted["all_to_all"] += exchange_bytes(workload, plan, rank)
        counted["all_reduce"] += expert_reduction_bytes(workload, plan, rank)  # split experts, over d/e
    return {**step, "bytes_by_rank": [{kind: traffic_rank[kind] for kind in KINDS} for traffic_rank in traffic]}


def simulated_step(workload: Workload, device: Device, plan) -> dict:
    """`predict_step` without the bytes by rank (what the search needs of a plan it simulates)."""
    cost, share = step_cost(workload, device, plan), device.core_share
    if share < 1:  # ranks outnumber the cores: compute at a core's rate, the cores shared in the simulation
        timeline = simulate(plan, lambda action: cost(action) * (share if action.info.is_compute else 1), share)
    else:
        timeline = simulate(plan, cost)
    exposed = max(_last_reduction_seconds(workload, device, plan, rank) for rank in range(plan.pipeline_degree)) \
        if device.overlaps_communication else 0.0  # else inside the timeline, where each reduction is issued
    update = max(optimizer_seconds(workload, device, sorted({a.stage for a in row if a is not None and a.kind == FORWARD}),
                                   plan.stages) for row in plan.ranks)
    return {"step_seconds": timeline.makespan + exposed + update + device.step_overhead_s,
            "compute_seconds": timeline.makespan, "exposed_data_seconds": exposed, "optimizer_seconds": update,
            "bubble_fraction": timeline.bubble_fraction, "timeline": timeline}


def _last_reduction_seconds(workload: Workload, device: Device, plan, rank: int) -> float:
    """The data-parallel reduction of the stage a rank reduces last; earlier stages' reductions
    overlap the remaining backward (layered accumulation), this one only the optimizer's wait."""
    reductions = [a for a in plan.ranks[rank] if a is not None and a.kind in (REDUCE_GRADIENT, REDUCE_SCATTER)]
    return exposed_reduction_seconds(workload, device, reductions[-1].stage, plan.stages) if reductions else 0.0


def reduction_seconds(workload: Workload, device: Device, stage: int, stages: int) -> float:
    """One stage's gradient over the data-parallel group: all-reduce, or under ZeRO the all-gather-
    sized reduce-scatter; over the link the whole group crosses (data ranks are the outermost axis;
    with context shards the group is data × context, Layout.data_context)."""
    layout = workload.layout
    n = layout.data_context
    if n == 1:
        return 0.0
    held = stage_parameters(workload, stage, stages)
    sharded = layout.zero or workload.distributed_optimizer  # a reduce-scatter: all_gather's bytes
    volume = all_gather(held, n) if sharded else all_reduce(held, n)
    volume *= workload.reduction_bytes / BYTES  # 4: our fp32 master gradients; 2: a run reducing fp16/bf16 ones
    extent, stride = data_context_span(workload, device)
    return collective_seconds(device, volume, extent, stride=stride)


def exposed_reduction_seconds(workload: Workload, device: Device, stage: int, stages: int) -> float:
    """The part of the stage's data-parallel reduction nothing hides: all of it, or with
    `reduction_overlaps_backward` (PyTorch DDP's buckets, Li et al. 2020 §3.2.3, reduce while the
    last micro-batch's backward still runs) what outlasts that backward."""
    reduction = reduction_seconds(workload, device, stage, stages)
    if not workload.reduction_overlaps_backward or not device.overlaps_communication:  # a CPU pays it where issued
        return reduction
    return max(0.0, reduction - stage_seconds(workload, device, stage, stages)[1])


class RankGathers(NamedTuple):
    """One rank's exposed ZeRO gathers per breadth-first group (`rank_gathers`), in seconds."""

    first_start: float  # the first group's stall as it starts: its first gather whole, and the second
    later_first: float  # a later group's first gather, posted as the previous group's backward L₀ begins
    second: float  # a group's second gather, posted with its first
    rest: float  # the group's other gathers, but the turnaround's
    turnaround: float  # the gather posted as the group's backwards begin (`zero_pipeline_gathers`)


def rank_gathers(workload: Workload, device: Device, rank: int, loops: int, breadth_first: int) -> RankGathers:
    """`exposed_gathers` of one rank of a looped ZeRO plan in closed form. Its runs per breadth-first
    group: bf forwards of each local stage L₀ … L_{v−1}, then bf backwards of L_{v−1} … L₀; a run's
    gather hides behind the run before it: forward L_j behind forward L_{j−1}, backward L_{v−1}
    behind its own forwards, backward L_j behind backward L_{j+1}, and a group's first forward behind
    the previous group's last backward (nothing, for the first group). A group's first two gathers
    are posted together as it starts: on ranks r > 0 after the first receive (the receive's post
    sits between it and the compute, so zero.py's `_run_start` leaves the gathers behind it), so
    those stalls add up along the pipeline at every group's fill. The turnaround's gather is the
    one posted as the backwards begin: backward L_{v−2}'s, at v = 1 the next group's first."""
    p, stages = workload.layout.pipeline, loops * workload.layout.pipeline
    held = [rank + loop * p for loop in range(loops)]
    timing = {stage: stage_seconds(workload, device, stage, stages) for stage in {held[0], held[-1], held[min(1, loops - 1)]}}
    cost = {stage: timing.get(stage, timing[held[min(1, loops - 1)]]) for stage in held}  # middle stages are equal
    gathered = {stage: gather_seconds(workload, device, stage, stages) for stage in timing}
    gather = {stage: gathered.get(stage, gathered[held[min(1, loops - 1)]]) for stage in held}
    forward, backward = (lambda stage: breadth_first * cost[stage][0]), (lambda stage: breadth_first * cost[stage][1])

    def exposed(stage: int, behind: float) -> float:  # the stage's gather behind `behind` seconds of compute
        return exposed_gather(gather[stage], behind, device.hidden_gather_fraction)
    second = exposed(held[1 % loops], forward(held[0]))  # forward L₁, or at v = 1 backward L₀
    rest = sum(exposed(held[j], forward(held[j - 1])) for j in range(2, loops))
    rest += exposed(held[-1], forward(held[-1])) if loops > 1 else 0.0  # at v = 1 that is `second`
    rest += sum(exposed(held[j], backward(held[j + 1])) for j in range(loops - 2))
    later_first = exposed(held[0], backward(held[0]))
    turnaround = exposed(held[-2], backward(held[-1])) if loops > 1 else later_first
    return RankGathers(gather[held[0]] + second, later_first, second, rest, turnaround)


def turnaround_before_receive(rank: int, pipeline: int, loops: int, breadth_first: int) -> bool:
    """Whether a looped ZeRO plan posts a rank's turnaround gather (`rank_gathers`) right before the
    gradient receive that feeds its first backward: zero.py's `_run_start` moves it there unless a
    receive post stands between the two (strategies/schedule/point_to_point.py posts each receive
    right after the rank's previous operation in one order of all the plan's messages). So on
    ranks 0 < r < p − 1, and on rank 0 at v > 1 and bf = p; not on the last rank (it receives no
    gradient there), nor on rank 0 at v = 1 (it sends no gradient, so its next gradients' receives
    are posted right after its first one) or at bf > p (its first gradient goes to rank p − 1, which
    takes it only after its own bf backwards: rank 1's next gradient comes first in the order, and
    its post falls between). tests/test_zero_turnaround.py checks this against built plans."""
    if not 0 <= rank < pipeline - 1:
        return False
    return rank > 0 or (loops > 1 and breadth_first == pipeline)


def zero_pipeline_gathers(workload: Workload, device: Device, loops: int, breadth_first: int, groups: int,
                          middle: tuple, last: tuple, receive: float) -> tuple:
    """What a looped ZeRO plan's exposed gathers add to its step in closed form, as (the groups'
    start stalls, summed along the pipeline; the slowest rank's rest): `rank_gathers` per rank
    (ranks 1 … p − 2 hold equal stages); the later gathers overlap across ranks in the lockstep loop.

    Where the turnaround's gather stands right before the gradient receive that feeds the rank's
    first backward (`turnaround_before_receive`), it also hides behind that receive's wait: the rank
    starts its backwards at the later of the gather's exposed part and the gradient (a wait leaves
    its core idle, so the gather runs whole-speed, as in the simulator). In the lockstep fill and
    drain, rank r's wait is the group-start stalls of the ranks after it, r + 1 … p − 1 (each delays
    their forwards, so the first gradient, by its own length), the last forward's hops to the last
    rank, (p − 1 − r)(F + R), the last stage's backward and the gradient's way back,
    (p − 2 − r)·B + (p − 1 − r)·R (F, B: a middle stage's micro-batch; R: a receive; the head's
    slower forwards only lengthen it: left out). At v = 1 the turnaround's gather is the next
    group's first, so what the wait hides comes off that group's start stall."""
    p = workload.layout.pipeline
    if not workload.layout.zero or workload.layout.data_context == 1:
        return 0.0, 0.0
    pieces = {rank: rank_gathers(workload, device, rank, loops, breadth_first) for rank in {0, min(1, p - 1), p - 1}}
    of = [pieces.get(rank, pieces[min(1, p - 1)]) for rank in range(p)]
    hides = [turnaround_before_receive(rank, p, loops, breadth_first) for rank in range(p)]
    drain = [(p - 1 - rank) * (middle[0] + 2 * receive) + last[1] + (p - 2 - rank) * middle[1] for rank in range(p)]
    starts, rests = 0.0, [0.0] * p
    hidden = [0.0] * p  # at v = 1: the part of each rank's next first gather its turnaround's wait hid
    previous = steps = None
    for group in range(groups):
        stalls = [piece.first_start if group == 0 else piece.later_first - hidden[rank] + piece.second
                  for rank, piece in enumerate(of)]
        if stalls == previous:  # the lockstep is periodic from here: every later group repeats this one
            starts += (groups - group) * sum(stalls)
            rests = [rest + (groups - group) * step for rest, step in zip(rests, steps)]
            break
        starts, previous, after, steps = starts + sum(stalls), stalls, 0.0, [0.0] * p
        for rank in reversed(range(p)):  # each rank's turnaround wait: the stalls of the ranks after it, the drain
            piece = of[rank]
            waited = min(piece.turnaround, drain[rank] + after) if hides[rank] else 0.0
            if loops > 1:
                steps[rank] = piece.rest + piece.turnaround - waited
            else:  # the turnaround's gather is the next group's first (none after the last group)
                hidden[rank] = waited
            after += stalls[rank]
        rests = [rest + step for rest, step in zip(rests, steps)]
    return starts, max(rests)


SIMULATED = ("zbv", "zero_bubble_h2")  # no closed form for their list schedules: the (cached) plan is simulated


def closed_form_step(workload: Workload, device: Device, schedule: str, micro_batches: int,
                     breadth_first: int = None) -> dict:
    """The simulator's step without the plan, for the search (tests/test_plan_search.py holds the
    two within 1% on every schedule family, with and without a tensor grid and a heavy head; ZeRO ×
    pipeline within 15%). Per breadth-first group, a pipeline of p ranks and v loops fills and drains once: (p − 1) hops of a stage's F + B and its two receives, plus bf
    micro-batches through the busiest rank's stages (every loop of a looped schedule; the last
    rank's includes the head): bubble (p − 1)/(v·bf + p − 1) on equal stages (docs/strategies/modular_pipeline.md;
    Narayanan et al. 2021 for the interleaved schedule). Depth-first groups run one after another.
    The exposed reduction is the slowest rank's last-reduced stage: stage r on rank r for every
    schedule here (contiguous: its one stage; looping: backwards visit local stages in reverse)."""
    p, stages = workload.layout.pipeline, workload.layers // workload.layers_per_stage
    loops, breadth_first = stages // p, breadth_first or micro_batches
    if schedule in SIMULATED:
        return simulated_step(workload, device, split_backward_plan(schedule, p, breadth_first, micro_batches))
    receive = receive_seconds(workload, device) if p > 1 else 0.0
    middle = stage_seconds(workload, device, 0, stages)  # stage 0's compute equals a middle stage's
    last = stage_seconds(workload, device, stages - 1, stages)
    per_micro_batch = []
    for rank in {0, min(1, p - 1), p - 1}:  # every rank's stages cost `middle` but the last rank's last stage
        held = [rank + loop * p for loop in range(loops)]
        receives = sum((stage > 0) + (stage < stages - 1) for stage in held) * receive
        per_micro_batch.append(sum(sum(last if stage == stages - 1 else middle) for stage in held) + receives)
    group = (p - 1) * (sum(middle) + 2 * receive) + breadth_first * max(per_micro_batch)
    if schedule == "zero_bubble_h1":  # rank 0, a middle rank, the last: (its micro-batch, its W)
        ranks = [(per_micro_batch[0], middle[1] / 2)] if p == 1 else \
            [(cost, (last if rank == p - 1 else middle)[1] / 2) for rank, cost in zip({0, min(1, p - 1), p - 1}, per_micro_batch)]
        group = zero_bubble_h1_group(middle, receive, p, breadth_first, ranks)
    groups = micro_batches // breadth_first
    # ZeRO: the stalls of each group's first gathers add up along the pipeline; the later ones overlap
    # across ranks in the lockstep loop, so the slowest rank's (`zero_pipeline_gathers`).
    starts, rest = zero_pipeline_gathers(workload, device, loops, breadth_first, groups, middle, last, receive)
    compute = groups * group + starts + rest
    exposed = max(exposed_reduction_seconds(workload, device, rank, stages) for rank in {0, 1 % p, p - 1})
    update = max(optimizer_seconds(workload, device, [rank + loop * p for loop in range(loops)], stages)
                 for rank in {0, 1 % p, p - 1})
    # The simulator's bubble: idle compute time over makespan × ranks; every stage runs m F and m B.
    busy = micro_batches * ((stages - 1) * sum(middle) + sum(last))
    return {"step_seconds": compute + exposed + update, "compute_seconds": compute, "exposed_data_seconds": exposed,
            "optimizer_seconds": update,
            "bubble_fraction": 1 - busy / (compute * p) if compute else 0.0}


def step_lower_bound(workload: Workload, device: Device, placement: tuple, micro_batches: int) -> float:
    """No plan of this placement steps faster (what the training-time scan prunes simulations with).
    A rank runs its actions one at a time, so the makespan is at least the busiest rank's m forwards,
    backwards (a split backward's I + W = B), receive waits and (without overlap) sends and stage
    reductions, as `step_cost` prices them; with overlap, some rank still exposes what outlasts the
    backward of the stage it reduces last, at least the least of its stages'; the slowest rank's
    optimizer step follows."""
    stages, overlap = len(placement), device.overlaps_communication
    receive = receive_seconds(workload, device)
    send = 0.0 if overlap else receive
    busy, exposed, update = 0.0, 0.0, 0.0
    for rank in range(max(placement) + 1):
        held = [stage for stage in range(stages) if placement[stage] == rank]
        messages = [(stage > 0 and placement[stage - 1] != rank) + (stage < stages - 1 and placement[stage + 1] != rank)
                    for stage in held]  # receives in (activation, gradient), and as many sends out
        compute = sum(sum(stage_seconds(workload, device, stage, stages)) for stage in held)
        reductions = [exposed_reduction_seconds(workload, device, stage, stages) for stage in held]
        busy = max(busy, micro_batches * (compute + sum(messages) * (receive + send))
                   + (0.0 if overlap else sum(reduction_seconds(workload, device, stage, stages) for stage in held)))
        exposed = max(exposed, min(reductions) if overlap else 0.0)
        update = max(update, optimizer_seconds(workload, device, held, stages))
    return busy + exposed + update


def zero_bubble_h1_group(middle: tuple, receive: float, p: int, breadth_first: int, ranks: list) -> float:
    """One breadth-first group of ZB-H1 (Qi et al. 2023 §3.1) in closed form, on a middle stage's F
    and B = I + W (I = W = B/2, step_cost), a receive R, and per rank (its micro-batch's F + I + W +
    receives, its W): the first forward reaches the last rank after (p − 1)(F + R) − R; the busiest
    rank then runs its bf micro-batches back to back, but for the min(bf, p) Ws it defers past its
    last I; that I returns to rank 0 through (p − 1)(I + R), whose last W ends the group. Bubble
    (p − 1)(F + 2R) − R + I − W + … : (p − 1)·T_F at T_I = T_W, R = 0 — the paper's
    (p − 1)(T_F + T_B − T_W), a third of 1F1B's (p − 1)(T_F + T_B + T_W)."""
    forward, backward = middle
    half = backward / 2  # I and W of a middle stage
    deferred, back = min(breadth_first, p), (p - 1) * (half + receive) + half
    return (p - 1) * (forward + receive) - receive * (p > 1) + max(
        breadth_first * cost - deferred * weight + max(back, deferred * weight) for cost, weight in ranks)


def model_flops_utilization(flops_per_step: float, step_time_s, peak_flops_per_second: float,
                            devices: int):
    """torchtitan's MFU: the model's training FLOPs of a step over what `devices` devices could do
    at their peak in that time (None where the hardware profile gives no peak for the precision)."""
    if not peak_flops_per_second or not step_time_s:
        return None
    return flops_per_step / (peak_flops_per_second * devices * step_time_s)
