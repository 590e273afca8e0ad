"""What the cost model is asked about: a device, a model shape, a layout and the workload of one plan.

Pure data, shared by the time model (step_time.py), the memory model (memory.py), K-FAC's
costs (kfac.py) and the traffic formulas (traffic.py); nothing here computes a cost.
"""

import math
from dataclasses import dataclass

from models import BlockDescription, describe_block
from parallel.dims import Layout
from strategies.tensor_parallel.grids import grid_of, local_activation_shape


BYTES = 4  # fp32: activations, gradients and the tensor grid's partial sums


@dataclass(frozen=True)
class GptShape:
    """What the formulas need of a model: widths, vocabulary, the two lengths (a position table has
    max_sequence_length rows; a micro-batch has `length` tokens per sequence) and the block as data
    (models.BlockDescription: GPT's by default, Llama's from `describe_block`)."""

    hidden: int
    mlp_ratio: int
    vocabulary: int
    length: int
    max_length: int
    block: BlockDescription = None  # None: the GPT block of `hidden` and `mlp_ratio`
    position_table: bool = True  # GPT/BERT learn one; Llama's rotary positions have none

    def __post_init__(self):
        if self.block is None:
            object.__setattr__(self, "block", describe_block("gpt", hidden=self.hidden, heads=1,
                                                             mlp_ratio=self.mlp_ratio))

    def linears(self):
        """(input, output, position, has bias) of a block's linears."""
        return tuple((linear.fan_in, linear.fan_out, "first" if linear.role == "column" else "second",
                      linear.bias) for linear in self.block.linears)

    @property
    def mlp_width(self) -> int:
        return self.block.mlp_width

    @property
    def table_rows(self) -> int:
        """Rows of the embedding tables: the vocabulary, and the position table if there is one."""
        return self.vocabulary + (self.max_length if self.position_table else 0)

    @property
    def norm_saves(self) -> int:
        """Feature-wide tensors autograd keeps per norm (whole features): LayerNorm's fused kernel
        its input and the output the next product saves (2); RMSNorm, composed of element-wise
        operators, also its normalised input before the weight (3)."""
        return 2 if self.block.norm == "layer" else 3

    def rotary_elements(self) -> int:
        """cos and sin of one micro-batch's positions ([s, d/2] each), kept once per block by RoPE."""
        return self.length * self.block.head_dim if self.block.rotary else 0

    @property
    def norm_vectors(self) -> int:
        """Parameter vectors (and split-feature sums each way) of one norm: LayerNorm 2, RMSNorm 1."""
        return 2 if self.block.norm == "layer" else 1


@dataclass(frozen=True)
class Device:
    """What the time and memory models need of a hardware profile."""

    flops_per_second: float  # dense peak in the compute dtype
    efficiency: float  # achieved / peak for the model's matrix products
    memory_bytes: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    devices_per_node: int
    # Fixed costs mode=calibrate measures (0 in the spec-sheet profiles): a matrix product's launch and
    # ramp, and a collective's or a message's latency — what dominates small models' steps.
    matmul_overhead_s: float = 0.0
    collective_latency_s: float = 0.0
    # A block's non-product work (norms, softmax, GELU, dropout, additions: memory-bound operators, and
    # on a CPU their dispatch) per block forward and per activation element it saves, and the
    # optimizer's step per parameter: also measured by mode=calibrate, 0 in spec-sheet profiles.
    block_overhead_s: float = 0.0
    activation_seconds_per_element: float = 0.0
    optimizer_seconds_per_parameter: float = 0.0
    point_to_point_latency_s: float = None  # a pipeline message's; None = collective_latency_s
    # Whether communication runs beside compute (NCCL on its own stream, copy engines). False on a CPU
    # whose ranks use every core: gloo's copies and sums then take the cores, and nothing overlaps.
    overlaps_communication: bool = True
    # Device memory (HBM) bytes/s from the spec sheet: prices matrix products by the roofline (the slower
    # of FLOPs at the achieved rate and bytes moved) and the memory-bound operators between them. 0: not
    # modelled (a CPU profile's calibrated block terms cover them instead).
    memory_bandwidth: float = 0.0
    # Cores ÷ ranks of a node (a CPU profile; 1 elsewhere). Below 1 every cost above is a rank's
    # while all of them compute (a core's share), and `simulated_step` lets a rank that waits give
    # its share to the others; above 1 a lone rank's threads split its large element-wise operators
    # (`elementwise_seconds`; the products' rate already counts its cores).
    core_share: float = 1.0
    # ((bytes each rank sends, seconds), ...) of one collective, measured (mode=calibrate): interpolated by
    # `cost.step_time.collective_seconds` instead of the latency and bandwidth above; () = not measured.
    collective_table: tuple = ()
    # The framework's own costs (mode=calibrate, tiny runs): per step, and per action a rank's executor
    # runs; like the block terms, a time-shared core stretches them.
    step_overhead_s: float = 0.0
    action_overhead_s: float = 0.0
    # The share of a posted ZeRO gather that compute running behind it hides (cost.step_time.
    # exposed_gather); None: all of it where communication overlaps, none where it does not.
    # mode=calibrate measures it: 0.66-0.89 here (2 ranks on 2 cores: gloo's work needs the rank's core).
    gather_overlap: float = None
    # The dense peak of the blocks' linear products where it differs from the compute dtype's: under
    # fp8-mixed the FP8 rate (torchao's Float8Linear; strategies/float8.py). 0: flops_per_second. MFU
    # stays stated against flops_per_second (the bf16 peak), as torchtitan and Megatron-LM state it.
    linear_flops_per_second: float = 0.0

    @property
    def linear_peak(self) -> float:
        return self.linear_flops_per_second or self.flops_per_second

    @property
    def hidden_gather_fraction(self) -> float:
        return float(self.overlaps_communication) if self.gather_overlap is None else self.gather_overlap


@dataclass(frozen=True)
class Workload:
    """The model, the layout and the batch one plan is for."""

    shape: GptShape
    layers: int
    heads: int
    layout: Layout  # parallel.dims: the run's degrees, its tensor grid and ZeRO
    layers_per_stage: int
    micro_batch_rows: int  # sequences per micro-batch of one data rank
    optimizer: str = "adamw"
    recompute: bool = False
    activation_bytes: int = BYTES  # 2 under bf16/fp16 autocast: matrix-product inputs are kept in it
    # Lightning's own closure (tensor-parallel strategies, single, ddp) zeroes gradients after the
    # forward, not before it as the pipeline strategies do: last step's gradients see the whole stash.
    gradients_through_forward: bool = False
    # gloo's reduce-scatter (the 2-D/3-D grids') makes two full-size temporaries on the calling thread,
    # which the meter counts; NCCL's buffers are not PyTorch's (cost.memory.gloo_temporaries). And
    # a gloo send completes only in wait(), an NCCL one once its receive is posted: the sends held
    # differ (cost.memory.held_sends, docs/strategies/pipeline_memory.md).
    gloo: bool = False
    # How the run's code communicates and overlaps. layerwise/planning/inputs.py `communication_of`
    # sets every field from the strategy's switches (issue 56), so a plan prices what our strategies
    # do; the defaults are a strategy without those switches. A published run's software may differ:
    # layerwise/reproduce/published.py names each difference it prices (MEGATRON_ONLY).
    # Bytes per element on the wire, apart because our code sends each kind in its own dtype:
    # a pipeline message (2: strategy.message_dtype=compute under bf16/fp16, strategies/stages.py
    # `StageWork.message`), a tensor-grid collective (4: our grids add partial sums in fp32,
    # strategies/tensor_parallel/collectives.py `sum_copy`) and a data-parallel gradient (4: the fp32
    # gradients of the fp32 master weights).
    message_bytes: int = BYTES
    tensor_bytes: int = BYTES
    reduction_bytes: int = BYTES
    # The pipeline message split over the 1-D tensor ranks and all-gathered on arrival (Narayanan et
    # al. 2021 §4.1; strategy.scatter_gather); the data-parallel reduction bucketed under the last
    # micro-batch's backward (strategy.overlap_reduction; PyTorch DDP, Li et al. 2020); the tensor
    # collectives overlapped with the products (strategy.tensor_overlap); attention scores
    # materialised (plan.flash_attention=false: the math kernel).
    scatter_gather: bool = False
    reduction_overlaps_backward: bool = False
    tensor_overlap: bool = False
    attention_scores: bool = False
    # Korthikanti et al. 2022 §4.2.2 (strategy.sequence_parallel): norms and dropout sharded along the
    # sequence, each all-reduce an all-gather + reduce-scatter; a boundary carries the 1/t shard.
    sequence_parallel: bool = False
    # ZeRO-1 (Megatron's distributed optimizer, Rajbhandari et al. 2020 stage 1): gradients reduce-
    # scattered (half an all-reduce's bytes), parameters all-gathered beside the next step's forward.
    distributed_optimizer: bool = False
    # The pipeline stages' gradient buckets (strategy.bucket_mb in bytes; strategies/buckets.py
    # GradientBuckets): each bucket's flat buffer is made when the backward first reaches it, up to a
    # bucket ahead of autograd's own gradients, and reduced in place (no flat copy). 0: per tensor.
    gradient_bucket_bytes: int = 0
    # Selective recomputation (Korthikanti et al. 2022 §5; strategy.activation_recompute=selective):
    # only the core attention (Q·Kᵀ, softmax, dropout, scores·V) is recomputed, its forward rerun in
    # the backward; the rest is saved.
    recompute_attention: bool = False
    # Mixtures of experts (cost/experts.py): the busiest expert's routed tokens over the mean
    # (plan.expert_load_imbalance); 1: perfectly balanced. The degree e is layout.expert.
    expert_imbalance: float = 1.0
    # The share of the blocks that are MoE blocks (model.moe_layers; `shape.block` is the MoE one): the
    # experts' terms are priced per block × this share, the dense blocks as the MoE block's linears.
    moe_share: float = 1.0
    # Context parallelism's exchange (strategy.context_parallel_comm; the degree is layout.context):
    # ring (K/V blocks passed around, overlapped with the blockwise attention) or all_gather. Under
    # context parallelism `shape.length` is the c-th of each sequence a rank holds (cost/context.py).
    context_comm: str = "ring"

    @property
    def piece(self) -> int:
        """Elements of the activation piece a rank holds between blocks and a boundary carries (its
        sequence shard under sequence parallelism)."""
        return activation_piece(self.layout, self.micro_batch_rows, self.shape, self.sequence_parallel)

    @property
    def tensor_ranks(self) -> int:
        return self.layout.tensor

    @property
    def message_elements(self) -> float:
        """Elements one rank sends (and posts a receive for) per boundary message: the activation
        piece (under sequence parallelism already the rank's sequence shard, 1/t of the stream), ÷ t
        where each tensor rank sends its 1/t of a piece they all hold (scatter/gather: the receivers
        all-gather the slices over NVLink). In `message_bytes` each; on arrival it is gathered and
        cast back to the stream's dtype."""
        return self.piece / (self.tensor_ranks if self.scatter_gather and not self.sequence_parallel else 1)


OPTIMIZER_STATE = {"adamw": 2, "lamb": 2, "sgd": 1}  # fp32 tensors per parameter (SGD: momentum)


def activation_piece(layout: Layout, rows: int, shape: GptShape, sequence_parallel: bool = False) -> int:
    """Elements of the residual-stream piece one rank holds between blocks, which is what a stage
    boundary carries (grids.local_activation_shape; the whole activation without a grid; the 1-D
    grid's [rows, s/t, h] sequence shard with `sequence_parallel`)."""
    if not layout.tensor_grid:
        return rows * shape.length * shape.hidden
    grid = grid_of(layout.tensor_grid, layout.tensor, 0, sequence_parallel=sequence_parallel)
    return math.prod(local_activation_shape(grid, rows, shape.length, shape.hidden))
