"""Mixtures of experts in plan mode: what a MoE block costs one rank (issue 58 item 6).

A MoE block (models.BlockDescription with `experts` E > 0) holds attention, a router, `shared_experts`
every token passes through and E routed SwiGLU experts of `expert_width` w, each token sent to
`experts_per_token` k of them. Under expert parallelism (`layout.expert` = e, e data ranks sharing
each block's experts) a rank keeps E/e experts and every other weight whole; its tokens travel to the
ranks holding their experts and back by all-to-all (strategies/expert_parallel.py). The block's
other formulas (attention, norms, the residual stream) are the dense block's; what differs is priced
here, and cost/step_time.py and cost/memory.py call it where they price a block:

  compute     a token multiplies the dense weights (attention, router, shared experts) and k experts'
              (`computed_weights`; MFU counts the same active weights, models' `active_matmul_weights`);
              the busiest rank's expert work is `rank_imbalance` × the mean (below);
  memory      per block a rank holds the dense weights and E/e experts (`held_elements`), their
              gradients and optimizer state; ZeRO shards the dense weights over the d data ranks and
              the E/e local experts over the d/e expert-data ranks holding the same ones, so a rank's
              shard is 1/d of the whole block either way (`zero_shard_elements`), while a stage it
              gathers holds only its E/e experts;
  all-to-all  per MoE block and micro-batch, a dispatch and a combine forward and the same two in
              the backward (again in a recomputed forward): each carries k·T rows of h values for the
              rank's T tokens, of which the rows for the e − 1 other members leave the rank
              (cost/traffic.py `expert_dispatch_traffic`, uniform routing) and the busiest rank sends
              and receives `rank_imbalance` × that. The expert group is e consecutive data indices,
              which sit tensor × context × pipeline ranks apart (parallel/layout.py's rank order), so
              a node holds m = min(e, max(1, devices_per_node ÷ that stride)) members: the share
              (m − 1)/(e − 1) of the rows leaving the rank stays on NVLink, the rest crosses the
              network at one device's NIC (`dispatch_seconds`). NCCL posts an all-to-all's sends to all
              peers at once, so the two links run side by side: the slower of the two, plus one
              collective latency.

Load imbalance (`Workload.expert_imbalance`, plan.expert_load_imbalance: the busiest expert's routed
tokens over the mean, a planning input). Default 1.25: the capacity factor Switch Transformer
provisions every expert with (Fedus et al. 2022, §2.1 and table 1: 1.0-1.25 beside an auxiliary
loss), i.e. the most over the mean a balanced router is planned to send one expert; issue 58 item 7's
metrics.csv measures it (tokens per expert, max/mean; docs/plan.md "Mixtures of experts"). A rank
holding E/e experts sees less than its busiest expert: with one hot expert and the others equally
below the mean, the busiest rank's load over the mean is 1 + (I − 1)(e − 1)/(E − 1) — exactly 1 at
e = 1 (a rank holding every expert computes all its k·T rows however they split) and I at e = E.
It scales the busiest rank's expert products and its all-to-all bytes (the others wait for it).

Not priced (docs/plan.md): grouped-product efficiency beyond the roofline of each expert's rows; a
dropping capacity factor (plan mode prices dropless routing); the time of the expert gradients'
reduction over the d/e expert-data ranks (priced over d with every weight; their bytes are counted over
d/e, `expert_reduction_bytes`). Where only some blocks are MoE blocks (model.moe_layers), every term of
the experts is priced per block × `Workload.moe_share`, the share of MoE blocks, and the dense blocks'
own MLP as the MoE block's router and shared experts (`shape.block`'s linears).
"""

from cost.inputs import BYTES, Device, Workload
from cost.traffic import all_reduce, expert_dispatch_traffic
from strategies.schedule import FORWARD, REDUCE_GRADIENT


def is_moe(block) -> bool:
    return block.experts > 0


def dense_weights(block) -> int:
    """A block's weights every token multiplies: its `linears` (attention, the router, the shared
    experts; all of a dense block's). The routed experts are not among them (models/moe.py)."""
    return block.matmul_weights() - block.experts * block.expert_weights()


def rank_imbalance(experts: int, expert_parallel: int, imbalance: float) -> float:
    """The busiest expert-parallel rank's routed rows over the mean rank's, from the busiest
    expert's load over the mean (`imbalance`, I): one hot expert, the others equally below the
    mean, so a rank holding E/e experts with the hot one carries 1 + (I − 1)(e − 1)/(E − 1) of the
    mean (1 at e = 1, I at e = E)."""
    if experts <= 1 or expert_parallel <= 1:
        return 1.0
    return 1.0 + (imbalance - 1.0) * (expert_parallel - 1) / (experts - 1)


def busiest(workload: Workload) -> float:
    """`rank_imbalance` of the workload's block and layout."""
    block = workload.shape.block
    return rank_imbalance(block.experts, workload.layout.expert, workload.expert_imbalance) if is_moe(block) else 1.0


def computed_weights(workload: Workload) -> float:
    """Weights one token's forward multiplies per block on the busiest rank: the dense weights and
    k experts', these × `busiest` (a dense block: its matmul weights; an MoE block's `matmul_weights`
    counts all E experts, which no token multiplies)."""
    block = workload.shape.block
    if not is_moe(block):
        return block.matmul_weights()
    routed = block.experts_per_token * block.expert_weights() * busiest(workload)
    return dense_weights(block) + routed * workload.moe_share


def local_experts(workload: Workload) -> int:
    """Routed experts of one MoE block a rank holds: E/e."""
    return workload.shape.block.experts // workload.layout.expert


def expert_rows(workload: Workload) -> float:
    """Rows one local expert multiplies per micro-batch on the busiest rank: the k·T routed rows of
    the e members' T tokens each spread over E experts (k·T·e/E per expert), × `busiest`."""
    block, tokens = workload.shape.block, workload.micro_batch_rows * workload.shape.length
    return block.experts_per_token * tokens * workload.layout.expert / block.experts * busiest(workload)


def experts_product_seconds(workload: Workload, device: Device, roofline) -> float:
    """One MoE block's routed-expert products of one micro-batch's forward on the busiest rank, each
    local expert's gate and up (rows × h by h × w) and down (rows × w by w × h) at `roofline`
    (cost/step_time.py's, the grouped product priced as its E/e experts' products)."""
    block = workload.shape.block
    if not is_moe(block):
        return 0.0
    rows, local = expert_rows(workload), local_experts(workload)
    products = (roofline(workload, device, rows, block.hidden, block.expert_width, 2 * local, peak=device.linear_peak)
                + roofline(workload, device, rows, block.expert_width, block.hidden, local, peak=device.linear_peak))
    return products * workload.moe_share


def local_expert_elements(workload: Workload) -> float:
    """Per MoE block: the weights of the E/e routed experts a rank keeps (the tensor grid does not
    cut them: they are not among the block's `linears`)."""
    block = workload.shape.block
    return local_experts(workload) * block.expert_weights() * workload.moe_share if is_moe(block) else 0.0


def remote_expert_elements(workload: Workload) -> float:
    """Per MoE block: the routed experts' weights the other e − 1 members of the expert group keep."""
    block = workload.shape.block
    remote = (block.experts - local_experts(workload)) * block.expert_weights()
    return remote * workload.moe_share if is_moe(block) else 0.0


def zero_extra_shard(workload: Workload, blocks: int) -> float:
    """Elements a ZeRO rank's shard holds beyond 1/d of what the rank holds (`local_expert_elements`
    counted in): the E/e local experts are sharded over the d/e expert-data ranks holding the same
    ones, not over d, so the shard is the whole block's (all E experts) over d — the remote experts'
    share more than the rank's holding over d."""
    return blocks * remote_expert_elements(workload) / workload.layout.data if workload.layout.zero else 0.0


def extra_saved_elements(workload: Workload) -> float:
    """Per token of the rank, what an MoE block saves for its backward beyond the dense block's MLP
    (cost/memory.py `_mlp_saved`, one SwiGLU of `mlp_width` = w): the k·busiest routed rows' and the
    shared experts' SwiGLU activations (4w each, one already counted), the dispatched input rows and
    the expert outputs before the weighted combine (h each per routed row), and the router's logits
    and probabilities (2E)."""
    block = workload.shape.block
    if not is_moe(block):
        return 0.0
    routed = block.experts_per_token * busiest(workload)
    experts = (routed - 1 + block.shared_experts) * 4 * block.expert_width
    return (experts + 2 * routed * block.hidden + 2 * block.experts) * workload.moe_share


# ----- the all-to-all

def expert_group_on_node(workload: Workload, device: Device) -> int:
    """Members of a rank's expert group on its node: e consecutive data indices sit
    tensor × context × pipeline ranks apart, and ranks fill nodes in order."""
    layout = workload.layout
    stride = layout.tensor * layout.context * layout.pipeline
    return min(layout.expert, max(1, device.devices_per_node // stride))


def dispatch_bytes(workload: Workload) -> float:
    """Bytes the busiest rank sends to the other members in ONE all-to-all (a dispatch or a
    combine) of one MoE block on one micro-batch: cost/traffic.py's uniform expectation in the
    activation dtype × `busiest`."""
    tokens = workload.micro_batch_rows * workload.shape.length
    block = workload.shape.block
    uniform = expert_dispatch_traffic(tokens, block.hidden, block.experts_per_token, workload.layout.expert,
                                      workload.activation_bytes)
    return uniform * busiest(workload)


def dispatch_split(workload: Workload, device: Device) -> tuple:
    """(bytes inside the node, bytes across nodes) of one all-to-all (`dispatch_bytes`): the rows for
    the m − 1 other members on the node over NVLink, those for the e − m elsewhere over the network."""
    e = workload.layout.expert
    if e <= 1:
        return 0.0, 0.0
    sent, local = dispatch_bytes(workload), expert_group_on_node(workload, device)
    inside = sent * (local - 1) / (e - 1)
    return inside, sent - inside


def dispatch_seconds(workload: Workload, device: Device) -> float:
    """One all-to-all of one MoE block on one micro-batch: the slower of its NVLink and its network
    share (NCCL posts the sends to every peer at once), plus a collective's latency."""
    if workload.layout.expert <= 1 or not is_moe(workload.shape.block):
        return 0.0
    inside, across = dispatch_split(workload, device)
    return device.collective_latency_s + max(inside / device.intra_node_bandwidth,
                                             across / device.inter_node_bandwidth if across else 0.0)


ALL_TO_ALLS_FORWARD = 2  # dispatch and combine; the backward runs the same two with the splits swapped


def all_to_alls_per_block(workload: Workload) -> int:
    """All-to-alls one MoE block runs per micro-batch: dispatch and combine in the forward, the
    backward and a recomputed forward."""
    return ALL_TO_ALLS_FORWARD * (2 + (1 if workload.recompute else 0))


def block_exchange_seconds(workload: Workload, device: Device) -> tuple:
    """(forward, backward) seconds of one MoE block's all-to-alls on one micro-batch: two each way,
    two more in a backward that recomputes the forward."""
    one = dispatch_seconds(workload, device) * workload.moe_share  # per block: the MoE blocks' share
    backward = ALL_TO_ALLS_FORWARD * one * (2 if workload.recompute else 1)
    return ALL_TO_ALLS_FORWARD * one, backward


def step_exchange(workload: Workload, device: Device, micro_batches: int, blocks: int) -> dict:
    """A rank's all-to-all traffic over one step of `micro_batches` through `blocks` MoE blocks:
    bytes inside and across nodes, and seconds (plan.json's `experts`)."""
    count = all_to_alls_per_block(workload) * micro_batches * blocks * workload.moe_share
    inside, across = dispatch_split(workload, device)
    return {"all_to_all_bytes_intra_node": count * inside, "all_to_all_bytes_inter_node": count * across,
            "all_to_all_s": count * dispatch_seconds(workload, device)}


def exchange_bytes(workload: Workload, plan, pipeline_rank: int) -> float:
    """all_to_all bytes one rank at `pipeline_rank` sends over a step of `plan`: each forward it runs
    passes its stage's blocks' dispatch and combine, its backward the same two, and a recomputed
    forward two more (what parallel.comm counts: the rows sent to the other members)."""
    if workload.layout.expert <= 1 or not is_moe(workload.shape.block):
        return 0.0
    forwards = sum(action is not None and action.kind == FORWARD for action in plan.ranks[pipeline_rank])
    return (forwards * workload.layers_per_stage * workload.moe_share * all_to_alls_per_block(workload)
            * dispatch_bytes(workload))


def expert_reduction_bytes(workload: Workload, plan, pipeline_rank: int) -> float:
    """all_reduce bytes one rank at `pipeline_rank` sends over a step to sum its local experts'
    gradients over the d/e expert-data ranks holding the same experts (strategies/expert_parallel.py:
    ddp in one flat buffer, the pipelines in their stage's buckets, in `reduction_bytes` per element),
    once per stage reduction it runs; the rest of the stage is all-reduced over d (cost/traffic.py,
    whose count leaves the routed experts out). ZeRO's expert shards: not counted here."""
    layout = workload.layout
    group = layout.data // layout.expert
    if layout.zero or layout.expert <= 1 or group <= 1 or not is_moe(workload.shape.block):
        return 0.0
    reductions = sum(action is not None and action.kind == REDUCE_GRADIENT for action in plan.ranks[pipeline_rank])
    experts = workload.layers_per_stage * local_expert_elements(workload)
    return reductions * all_reduce(experts, group) * workload.reduction_bytes / BYTES
