"""The analytic plan of a pipeline-family layout: memory per pipeline rank and a predicted step.

Nothing here builds a model or a process group; it is what plan mode answers at full scale.
  memory    per pipeline rank: parameters, gradients and optimizer state of the parts it holds
            (strategies/traffic.py's local_parameters: tensor-grid shards, ZeRO's 1/n), the
            activation stash — the most (stage, micro-batch) forwards alive at once in its plan row,
            times the blocks' saved bytes — a working set (one block's backward, the head's logits),
            and communication buffers;
  time      the one simulator (strategies/schedule/simulate.py) times the plan with F and B from
            FLOPs at the device's dense rate × an efficiency, plus the tensor grid's collectives
            inside them, and receives from the activation piece over the link the pipeline
            crosses; the data-parallel reduction of the stage finished last is exposed, the others
            overlap the remaining backward (layered accumulation, TECHNIQUES §1).
What it leaves out (said in docs/plan.md): allocator fragmentation, the optimizer step's time,
kernel launch latency, the embedding's gather, and any overlap of the grid's collectives with compute.
"""

from collections import Counter
from dataclasses import dataclass

from parallel.comm import KINDS
from strategies.schedule import BACKWARD, FORWARD, RECV_ACTIVATION, RECV_GRADIENT, REDUCE_GRADIENT, simulate
from strategies.schedule.zero import REDUCE_SCATTER
from strategies.traffic import (BYTES, ComposedLayout, GptShape, activation_piece, all_gather, all_reduce,
                                block_traffic, head_traffic, local_parameters, step_traffic)
from strategies.tensor_parallel.grids import DIMENSION

OPTIMIZER_STATE = {"adamw": 2, "lamb": 2, "sgd": 1}  # fp32 tensors per parameter (SGD: momentum)


@dataclass(frozen=True)
class Device:
    """What the time and memory models need of a hardware profile."""

    flops_per_second: float  # dense peak in the compute dtype
    efficiency: float  # achieved / peak for the model's matrix products
    memory_bytes: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    devices_per_node: int


@dataclass(frozen=True)
class Workload:
    """The model, the layout and the batch one plan is for."""

    shape: GptShape
    layers: int
    heads: int
    layout: ComposedLayout
    layers_per_stage: int
    micro_batch_rows: int  # sequences per micro-batch of one data rank
    optimizer: str = "adamw"
    recompute: bool = False
    activation_bytes: int = BYTES  # 2 under bf16/fp16 autocast: matrix-product inputs are kept in it

    @property
    def piece(self) -> int:
        """Elements of the activation piece a rank holds between blocks and a boundary carries."""
        return activation_piece(self.layout, self.micro_batch_rows, self.shape)

    @property
    def tensor_ranks(self) -> int:
        grid = self.layout.tensor_grid
        return self.layout.edge ** DIMENSION[grid] if grid else 1


# ----- memory

def block_saved_bytes(workload: "Workload", tokens: float, flash: bool) -> float:
    """Bytes a block keeps for its backward, per micro-batch, as autograd saves them: on the
    residual stream the two norms' inputs and outputs (x, LN₁(x), x₂, LN₂(x₂): 4h per token; the
    sub-layers' outputs feed only additions, which save nothing), split by the grid q/k/v, the
    attention context and the MLP's two wide activations (4h + 2rh), and with the math attention
    kernel the softmax probabilities (heads × s per token). A 1-D grid keeps the residual stream
    whole on every rank; 2-D/3-D grids split everything. (Dropout masks, 1 byte each, are left out.)"""
    shape, ranks = workload.shape, workload.tensor_ranks
    h, r = shape.hidden, shape.mlp_ratio
    scores = 0 if flash else workload.heads * shape.length
    if workload.layout.tensor_grid in ("2d", "3d"):
        return grid_block_saved_elements(workload, tokens, scores) * workload.activation_bytes
    residual = 4 * h / (1 if workload.layout.tensor_grid == "1d" else ranks)
    split = (4 * h + 2 * r * h + scores) / ranks
    return (residual + split) * tokens * workload.activation_bytes


def grid_block_saved_elements(workload: "Workload", tokens: float, scores: float) -> float:
    """A 2-D/3-D block: each GridLinear saves the *gathered* X and W its product used
    (collectives.GatherMatmulScatter: X gathered over q ranks to tokens·in/q (2-D) or tokens·in/q²
    (3-D), W to in·out/q or in·out/q²), per micro-batch; the split LayerNorms save their centred and
    normalised pieces (2 each), attention its q, k, v and output pieces, GELU its input piece.
    A piece is 1/(grid ranks) of the full activation."""
    shape, q, ranks = workload.shape, workload.layout.edge, workload.tensor_ranks
    h, r = shape.hidden, shape.mlp_ratio
    gather = q if workload.layout.tensor_grid == "2d" else q * q
    linears = sum(tokens * fan_in / gather + fan_in * fan_out / gather for fan_in, fan_out, _, _ in shape.linears())
    pieces = tokens * (2 * 2 * h + 3 * h + h + r * h + scores) / ranks
    return linears + pieces


def in_flight(row, stages=None) -> int:
    """Most forwards (of `stages`, default all) alive at once in a plan row: run, backward not yet.
    Counted over time on the whole row, since different stages' peaks need not coincide
    (interleaved 1F1B)."""
    alive = peak = 0
    for action in row:
        if action is None or (stages is not None and action.stage not in stages):
            continue
        alive += action.kind == FORWARD
        alive -= action.kind == BACKWARD
        peak = max(peak, alive)
    return peak


def memory(workload: Workload, plan, pipeline_rank: int, flash: bool = True) -> dict:
    """Bytes by kind on one rank of pipeline position `pipeline_rank` (the parts it holds)."""
    row = [action for action in plan.ranks[pipeline_rank] if action is not None]
    stages = sorted({action.stage for action in row if action.kind == FORWARD})
    layout, shape, per_stage = workload.layout, workload.shape, workload.layers_per_stage
    held = sum(local_parameters(layout.tensor_grid, layout.edge, shape, stage == 0, per_stage,
                                stage == plan.stages - 1)["all"] for stage in stages)
    sharded = held / layout.data if layout.zero else held
    tokens = workload.micro_batch_rows * shape.length
    block = block_saved_bytes(workload, tokens, flash)
    kept = workload.piece * BYTES if workload.recompute else per_stage * block  # recompute: stage inputs
    stash = in_flight(row) * kept  # every stage holds layers_per_stage blocks
    # Working set on top of the stash: a block's backward materialises gradients about the size of
    # what it saved (with recomputation, also the block's recomputed internals); the last stage also
    # holds the logits and their gradient (fp32, split by vocabulary).
    logits = 2 * tokens * shape.vocabulary * BYTES / workload.tensor_ranks if plan.stages - 1 in stages else 0
    working = block * (2 if workload.recompute else 1) + logits
    largest_stage = held / max(1, len(stages))
    return {"parameters": sharded * BYTES,
            "gradients": sharded * BYTES + (largest_stage * BYTES if layout.zero else 0),
            "optimizer": OPTIMIZER_STATE.get(workload.optimizer, 2) * sharded * BYTES,
            "activations": stash + working,
            "buffers": (2 * largest_stage * BYTES if layout.zero else 0) + 2 * workload.piece * BYTES}


# ----- time

def forward_flops(workload: Workload, stage: int, stages: int) -> float:
    """One micro-batch through one stage, on one rank of the tensor grid: 2 FLOPs per weight per
    token for the blocks' matrix products, 4·s·h per token for attention, plus the head's on the last."""
    shape = workload.shape
    h, r, tokens = shape.hidden, shape.mlp_ratio, workload.micro_batch_rows * shape.length
    block = tokens * (2 * (4 + 2 * r) * h * h + 4 * shape.length * h)
    head = 2 * tokens * h * shape.vocabulary if stage == stages - 1 else 0
    return (workload.layers_per_stage * block + head) / workload.tensor_ranks


def link_bandwidth(device: Device, span: int) -> float:
    """Ranks `span` apart in rank order share a node when the span is inside one node."""
    return device.intra_node_bandwidth if span < device.devices_per_node else device.inter_node_bandwidth


def grid_seconds(workload: Workload, device: Device, stage: int, stages: int) -> float:
    """The tensor grid's collectives of one micro-batch's forward and backward through `stage`
    (the tensor axis is innermost, so a grid that fits a node crosses only its links)."""
    layout = workload.layout
    if not layout.tensor_grid:
        return 0.0
    traffic = Counter({k: v * workload.layers_per_stage for k, v in
                       block_traffic(layout.tensor_grid, layout.edge, workload.micro_batch_rows,
                                     workload.shape).items()})
    if stage == stages - 1:
        traffic += head_traffic(layout.tensor_grid, layout.edge, workload.micro_batch_rows, workload.shape)
    return sum(traffic.values()) / link_bandwidth(device, workload.tensor_ranks)


def step_cost(workload: Workload, device: Device, stages: int):
    """The simulator's cost of each action in seconds: F, B = (2 or 3)·F, and receive waits."""
    rate = device.flops_per_second * device.efficiency
    pipeline_link = link_bandwidth(device, workload.tensor_ranks * 2)
    receive = workload.piece * BYTES / pipeline_link
    backward_factor = 3.0 if workload.recompute else 2.0

    def cost(action) -> float:
        if action.kind in (FORWARD, BACKWARD):
            compute = forward_flops(workload, action.stage, stages) / rate
            communication = grid_seconds(workload, device, action.stage, stages)  # half each way
            factor = 1.0 if action.kind == FORWARD else backward_factor
            return factor * compute + communication / 2
        return receive if action.kind in (RECV_ACTIVATION, RECV_GRADIENT) else 0.0
    return cost


def rank_traffic(workload: Workload, plan, pipeline_rank: int) -> Counter:
    """strategies/traffic.py's bytes by kind for a rank at `pipeline_rank` of this workload."""
    return step_traffic(plan, workload.layout, pipeline_rank, workload.shape, workload.layers_per_stage,
                        workload.micro_batch_rows)


def predict_step(workload: Workload, device: Device, plan) -> dict:
    """Predicted step: makespan of the simulated plan + the exposed data-parallel reduction, bubble
    fraction, and each pipeline rank's bytes by kind (strategies/traffic.py)."""
    timeline = simulate(plan, step_cost(workload, device, plan.stages))
    traffic = [rank_traffic(workload, plan, rank) for rank in range(plan.pipeline_degree)]
    data_span = workload.tensor_ranks * workload.layout.pipeline
    data_link = link_bandwidth(device, data_span) if workload.layout.data > 1 else float("inf")
    exposed = max(_last_reduction_bytes(workload, plan, rank) for rank in range(plan.pipeline_degree))
    return {"step_seconds": timeline.makespan + exposed / data_link,
            "compute_seconds": timeline.makespan, "exposed_data_seconds": exposed / data_link,
            "bubble_fraction": timeline.bubble_fraction, "timeline": timeline,
            "bytes_by_rank": [{kind: traffic_rank[kind] for kind in KINDS} for traffic_rank in traffic]}


def _last_reduction_bytes(workload: Workload, plan, rank: int) -> float:
    """The data-parallel bytes of the stage a rank reduces last; earlier stages' reductions overlap
    the remaining backward (layered accumulation), this one only the optimizer's wait."""
    layout = workload.layout
    reductions = [a for a in plan.ranks[rank] if a is not None and a.kind in (REDUCE_GRADIENT, REDUCE_SCATTER)]
    if layout.data == 1 or not reductions:
        return 0.0
    stage = reductions[-1].stage
    held = local_parameters(layout.tensor_grid, layout.edge, workload.shape, stage == 0,
                            workload.layers_per_stage, stage == plan.stages - 1)["all"]
    return all_gather(held, layout.data) if layout.zero else all_reduce(held, layout.data)
