"""Typed schemas behind every Hydra config group.

Each group file in `conf/<group>/` extends one of these dataclasses (its defaults list names
`/schema_<group>_<schema>@_here_`), so a misspelt key or a string where a number belongs fails at
composition, before any process starts. Cross-group rules live in `layerwise/config/validate.py`.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING


@dataclass
class ModelConfig:
    """A transformer shape; `models.build_model` turns it into a plain nn.Module."""

    name: str = MISSING  # config name, written into summary.json
    architecture: str = "gpt"  # gpt (causal LM) | bert (encoder, masked LM) | llama (causal LM)
    layers: int = 2  # transformer blocks L
    hidden: int = 64  # model width h
    heads: int = 4  # attention heads; hidden % heads == 0
    mlp_ratio: int = 4  # MLP width = mlp_ratio × hidden
    max_sequence_length: int = 256  # positional-embedding size; data.sequence_length must fit
    dropout: float = 0.0  # dropout probability in embeddings and blocks
    tie_embeddings: bool = False  # share the token embedding with the output projection
    # llama only (models/llama.py): grouped-query attention, SwiGLU width, RMSNorm, rotary positions
    kv_heads: Optional[int] = None  # key/value heads; null = heads; must divide heads
    ffn_hidden: Optional[int] = None  # SwiGLU width; null = mlp_ratio × hidden
    norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base θ (Llama 3: 500000)
    rope_scaling: Optional[Dict[str, float]] = None  # Llama 3.1 long-context frequency scaling
    qkv_bias: bool = False  # biases on q/k/v (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head's q and k before RoPE (Qwen3)
    head_dim: Optional[int] = None  # each attention head's width; null = hidden / heads (Qwen3: 128 at any width)
    # mixture of experts (models/moe.py; llama only): experts > 0 makes the blocks in moe_layers MoE blocks
    experts: int = 0  # E routed experts per MoE block; 0 = dense
    experts_per_token: int = 2  # k: experts each token is routed to
    shared_experts: int = 0  # experts every token passes through (DeepSeek, Qwen2-MoE)
    moe_ffn_hidden: Optional[int] = None  # one expert's SwiGLU width; null = ffn_hidden
    moe_layers: Optional[List[int]] = None  # indices of the MoE blocks; null = every block
    router: str = "softmax_topk"  # softmax_topk (Mixtral, Qwen3-MoE) | sigmoid_bias (DeepSeek-V3)
    router_normalize: bool = True  # renormalise the k chosen weights to sum to 1
    aux_loss_coefficient: float = 0.01  # load-balancing loss weight α; 0 = off
    bias_update_rate: float = 0.001  # sigmoid_bias: u, each step bias_i += u·sign(mean load - load_i)
    capacity_factor: Optional[float] = None  # null = dropless; else tokens per expert ≤ cf·tokens·k/E
    # model=hf: a Hugging Face model directory (config.json + *.safetensors); its config.json sets the
    # fields above (layerwise/run/rules.py fill_hf_model) and its weights replace the seeded init
    path: Optional[str] = None
    vocab_size: Optional[int] = None  # the model's vocabulary; null = the corpus's (model=hf: config.json's)
    planning_only: bool = False  # too large to build on this machine: composed for planning only


@dataclass
class DataConfig:
    """Where tokens come from and how many make one optimizer step."""

    name: str = MISSING
    corpus: str = "stdlib"  # stdlib | text_files | token_bin | text
    path: Optional[str] = None  # directory for text_files / token_bin; file or directory for text
    tokenizer: Optional[str] = None  # text only: a Hugging Face tokenizer directory (tokenizer.json)
    cache_dir: Optional[str] = None  # text only: token cache; null = $LAYERWISE_CACHE/tokens or ~/.cache/layerwise/tokens
    # text and text_files: the files' encoding (latin-1 for Latin-1 corpora); a binary file, or one not valid in it,
    # is skipped and counted in the printed summary (layerwise/run/text.py's rule), never decoded into U+FFFD
    encoding: str = "utf-8"
    vocab_size: int = 256  # token_bin only: the tokenizer's vocabulary (bytes give 256)
    max_bytes: int = 16 * 2**20  # cap on the bytes read from stdlib / text_files
    validation_fraction: float = 0.05  # share of files held out for validation
    global_batch_size: int = 16  # sequences per optimizer step, the same under every strategy
    sequence_length: int = 64  # tokens per sequence
    # Packed documents (docs/packing.md): attention block-causal per EOS-ended document, positions restarting at
    # each; data.corpus=text (its documents end in the tokenizer's EOS), causal models, single/ddp/pipelines
    packing: bool = False


@dataclass
class HardwareConfig:
    """A machine profile: sets the Trainer now, prices schedules in the planner later."""

    name: str = MISSING
    accelerator: str = "cpu"  # cpu | gpu
    devices_per_node: int = 2  # GPUs per node; on cpu the number of local processes
    nodes: int = 1  # nodes in the job
    precision: str = "32-true"  # Lightning precision: 32-true | bf16-mixed | 16-mixed | fp8-mixed (ours: below)
    # fp8-mixed = bf16-mixed with the blocks' linears in FP8 through torchao (strategies/float8.py; Hopper
    # GPUs: the profile's peak_flops has an fp8 rate). The scaling recipe: rowwise | tensorwise; fp8_emulate:
    # torchao's emulation (FP8 rounding, products in high precision), which runs on CPU, for tests.
    fp8_recipe: str = "rowwise"
    fp8_emulate: bool = False
    process_group_backend: str = "gloo"  # gloo | nccl
    peak_flops: Dict[str, float] = field(default_factory=dict)  # dense FLOP/s per dtype
    device_memory_bytes: float = 0.0  # memory of one device (on cpu: the share of one process)
    host_memory_bytes: float = 0.0  # host memory of one node
    intra_node_bandwidth: float = 0.0  # bytes/s per device inside a node (NVLink, shared memory)
    inter_node_bandwidth: float = 0.0  # bytes/s per device between nodes (InfiniBand, Ethernet)
    host_device_bandwidth: float = 0.0  # bytes/s host <-> device (PCIe)
    matmul_overhead_s: float = 0.0  # fixed cost of one matrix product (launch, ramp): mode=calibrate measures it
    # default of trainer.collective_timeout_s on this hardware; every process group's own timeout follows from it
    # (layerwise/run/timeouts.py TimeoutChain: 300 s gives 3366 s; docs/faults.md, "The chain of timeouts")
    collective_timeout_s: float = 300.0
    nccl_trace_buffer_size: int = 0  # NCCL flight recorder entries (TORCH_NCCL_TRACE_BUFFER_SIZE); 0 = off
    collective_latency_s: float = 0.0  # fixed cost of one collective or message: mode=calibrate measures it
    # [[bytes each rank sends, seconds], ...] of one collective, measured by mode=calibrate: the cost model
    # interpolates between them instead of latency + bytes / bandwidth (gloo's cost steps up between
    # 256 KB and 1 MB, which no fixed + rate fit follows); empty in the spec-sheet profiles.
    collective_seconds_by_bytes: List[List[float]] = field(default_factory=list)
    # A block's work besides its matrix products (norms, softmax, GELU, dropout, additions): a fixed cost
    # per block forward plus a cost per activation element it saves; and the optimizer's step per
    # parameter. mode=calibrate measures them on the model's own block; 0 in the spec-sheet profiles.
    block_overhead_s: float = 0.0
    activation_seconds_per_element: float = 0.0
    optimizer_seconds_per_parameter: float = 0.0
    point_to_point_latency_s: float = 0.0  # fixed cost of one pipeline message; 0 = collective_latency_s
    # The framework's own costs, measured by mode=calibrate on tiny runs where they are all there is: one
    # per step (Lightning's loop, callbacks, the loss exchange) and one per action a rank's executor runs
    # (its handler's Python, hooks, the flight record). 0 in the spec-sheet profiles.
    step_overhead_s: float = 0.0
    action_overhead_s: float = 0.0
    overlaps_communication: bool = True  # communication beside compute (GPUs); false: CPU ranks use every core
    # The share of a posted ZeRO gather that compute behind it hides (mode=calibrate measures it);
    # null = 1 where communication overlaps, 0 where it does not.
    gather_overlap: Optional[float] = None
    compute_units_per_node: int = 0  # cores the node's ranks share (calibrated CPU profiles); 0 = one device each
    memory_bandwidth: float = 0.0  # device memory bytes/s (HBM, spec sheet): roofline products, memory-bound operators; 0 = off
    # Achieved / peak FLOP/s of the matrix products known for this profile: mode=calibrate writes 1 (its
    # peak_flops is the rate it measured); null = plan.efficiency (an assumption, for spec-sheet peaks).
    matmul_efficiency: Optional[float] = None
    # A spec-sheet profile's large-product efficiency (largest measured matmul rate ÷ peak) over the
    # A100 SXM's, from one table (stas00/ml-engineering, compute/accelerator/README.md, "Maximum
    # Achievable Matmul FLOPS"). plan.efficiency is fitted on A100 runs (benchmarks/plan_vs_published.py),
    # so another device computes at peak × plan.efficiency × this. 1 = not measured (the A100's assumed).
    relative_matmul_efficiency: float = 1.0


@dataclass
class StrategyConfig:
    """The parallelism technique. Every strategy schema extends this one with only the knobs its
    strategy reads, so a knob it would ignore fails at composition (`single` and `ddp` read none)."""

    name: str = MISSING  # single | ddp | modular_pipeline | gpipe | one_f_one_b | ...


@dataclass
class ContextParallelConfig:
    """Mixin of the strategies that can split each sequence over ranks (strategies/context_parallel.py)."""

    context_parallel: int = 1  # c: ranks each sequence is split over (head and tail chunks each)
    context_parallel_comm: str = "ring"  # ring (K/V passed around, overlapped) | all_gather


@dataclass
class ExpertParallelConfig:
    """Mixin of the strategies that can split a MoE block's experts over data ranks (strategies/expert_parallel.py)."""

    expert_parallel: int = 1  # e: data-parallel ranks each MoE block's experts are split over


@dataclass
class ActivationRecomputeConfig:
    """Mixin of the strategies that keep block activations between forward and backward."""

    # none | selective (only the core attention reruns in the backward, Korthikanti et al. 2022 §5)
    # | full (each block keeps only its input; recomputed in backward)
    activation_recompute: str = "none"


@dataclass
class BucketedReductionConfig:
    """Mixin of the strategies whose data-parallel gradient reduction is one collective per bucket."""

    bucket_mb: float = 25.0  # gradients all-reduced in flat buckets of at most this many MiB; 0 = one per tensor


@dataclass
class DynamicDepthConfig:
    """Mixin of the strategies that may run a different set of blocks each step (single, ddp, l2l):
    LayerDrop (Fan et al. 2019) and progressive stacking (Gong et al. 2019); docs/strategies/l2l.md."""

    layer_drop: float = 0.0  # p: each step drops each block (not the first or last) with probability p
    grow_at: List[int] = field(default_factory=list)  # steps at which the model gains grow_by blocks
    grow_by: int = 1  # k: blocks added at each grow_at step, copies of the bottom k; 0 = double (stack all)


@dataclass
class PlainStrategyConfig(StrategyConfig, ActivationRecomputeConfig, DynamicDepthConfig):
    """`single`: the whole model in one process; its only knob is activation recomputation."""


@dataclass
class DataParallelStrategyConfig(PlainStrategyConfig, BucketedReductionConfig, ContextParallelConfig,
                                 ExpertParallelConfig):
    """`ddp`: replicas whose gradients DDP all-reduces in buckets (its bucket_cap_mb)."""


@dataclass
class MicroBatchedStrategyConfig(StrategyConfig):
    """A strategy that splits each rank's batch into micro-batches within one optimizer step."""

    micro_batches: int = 1  # micro-batches per optimizer step


@dataclass
class StagedStrategyConfig(MicroBatchedStrategyConfig):
    """A schedule from strategies/schedule run over pipeline (and data-parallel) ranks.

    Stage placement is not a knob: the schedule decides it (gpipe and one_f_one_b contiguous,
    looped_breadth_first and interleaved_one_f_one_b looping)."""

    schedule: str = "looped_breadth_first"  # gpipe | one_f_one_b | looped_breadth_first | ... | zero_bubble_h1 | zero_bubble_h2 | zbv
    pipeline_degree: int = 1  # pipeline ranks
    data_degree: Optional[int] = None  # data-parallel replicas; null = world / pipeline_degree
    layers_per_stage: int = 1  # k consecutive blocks per stage; stages = layers / k
    breadth_first_micro_batches: Optional[int] = None  # null = all micro-batches breadth-first
    # Each stage's blocks split over a tensor grid (innermost axis: a tensor group stays in a node);
    # world = data × pipeline_degree × tensor ranks (1d: q, 2d: q², 3d: q³).
    tensor_parallel: str = "none"  # none | 1d (Megatron) | 2d (SUMMA) | 3d (Bian et al. 2021)
    tensor_grid: int = 2  # q, the grid's edge (read only when tensor_parallel is not none)
    # What a stage boundary carries: `compute` = the compute dtype (bf16/fp16 under mixed precision,
    # as Megatron-LM sends its pipeline messages), `fp32` = the residual stream's own fp32.
    message_dtype: str = "compute"  # compute | fp32
    # 1-D grid: each tensor rank sends 1/t of a boundary message, the receivers all-gather it over
    # the tensor group (Narayanan et al. 2021 §4.1); off: every tensor rank sends the whole message.
    scatter_gather: bool = True
    # 1-D grid: norms and dropout sharded along the sequence, all-gather + reduce-scatter in place of
    # each all-reduce (Korthikanti et al. 2022 §4.2.2).
    sequence_parallel: bool = False
    # Sequence-parallel gathers and scatters chunked and overlapped with the neighbouring products.
    tensor_overlap: bool = False
    # 1-D grid: the all-reduces of partial sums (and, with sequence_parallel, the reduce-scatters) in
    # `compute` = the compute dtype under mixed precision (bf16/fp16: half the bytes, one rounding per
    # reduction), as Megatron-LM reduces its row-parallel outputs in the params dtype
    # (megatron/core/tensor_parallel/mappings.py `_reduce`), or `fp32` (one rounding in all, as the
    # unsharded product). 32-true: fp32 either way. The 2-D/3-D grids ignore it: their reduce-scatters
    # sum partial products inside a SUMMA/3-D linear that no published run times against ours, and
    # plan mode prices their sums at 4 bytes.
    tensor_collective_dtype: str = "compute"  # compute | fp32


@dataclass
class OverlappedReductionConfig(BucketedReductionConfig):
    """Mixin of the pipeline strategies whose data-parallel reduction may run under the backward."""

    # Each bucket's reduction posted as soon as its gradients are final (with layered accumulation:
    # after the stage's last micro-batch), overlapped with the rest of the backward; off: at the
    # stage's REDUCE_GRADIENT action.
    overlap_reduction: bool = True
    # The data-parallel gradient reduction (bucket all-reduce; reduce-scatter under the distributed
    # optimizer) in `fp32` (the master gradients as they are: Megatron-LM's bf16 runs, whose
    # accumulate_allreduce_grads_in_fp32 --bf16 forces on) or `compute` (cast to bf16/fp16, reduced,
    # cast back before the division: half the bytes, as Megatron-LM's fp16 runs reduce them).
    reduction_dtype: str = "fp32"  # fp32 | compute


@dataclass
class PipelineStrategyConfig(StagedStrategyConfig, ActivationRecomputeConfig, OverlappedReductionConfig,
                             ContextParallelConfig, ExpertParallelConfig):
    """modular_pipeline, gpipe, one_f_one_b, interleaved_1f1b: stage replicas all-reduce their gradients."""

    # ZeRO-1 (Megatron's distributed optimizer): gradients reduce-scattered over the data ranks,
    # optimizer state sharded over them, parameters all-gathered before the next forward.
    distributed_optimizer: bool = False


@dataclass
class ZeroLayeredStrategyConfig(StagedStrategyConfig, ActivationRecomputeConfig, ContextParallelConfig,
                                ExpertParallelConfig):
    """zero_layered, zero_depth_first: gradients are reduce-scattered per flat shard, already one
    collective per (stage, kind), so no bucket size."""


@dataclass
class TensorParallelStrategyConfig(StrategyConfig, ActivationRecomputeConfig, ContextParallelConfig):
    """Tensor parallelism on a grid of edge q (1-D: q ranks, 2-D: q², 3-D: q³) × data replicas."""

    data_degree: Optional[int] = None  # data-parallel replicas; null = world / tensor ranks
    tensor_grid: int = 2  # q, the grid's edge; the tensor-parallel group has q^dimension ranks
    tensor_parallel: str = "3d"  # 1d (Megatron) | 2d (SUMMA) | 3d (Bian et al. 2021); fixed by the name
    sequence_parallel: bool = False  # 1-D only: as StagedStrategyConfig.sequence_parallel
    tensor_overlap: bool = False  # 1-D with sequence_parallel: chunked gathers/scatters under the products
    tensor_collective_dtype: str = "compute"  # compute | fp32; 1-D only: as StagedStrategyConfig's


@dataclass
class L2LStrategyConfig(MicroBatchedStrategyConfig, BucketedReductionConfig, DynamicDepthConfig):
    """L2L relay with an eager host parameter server (docs/strategies/l2l.md); one device per data rank."""

    constant_memory: bool = False  # stash activations on the host: compute memory flat in depth and m
    prefetch: bool = True  # copy the next layer's weights while this one computes (two in flight)
    tensor_parallel: str = "none"  # only none: one device per data replica (validation says why)


@dataclass
class KFACStrategyConfig(MicroBatchedStrategyConfig):
    """K-FAC on one process (the PipeFisher oracle): block Linears preconditioned, the rest first-order."""

    damping: float = 1e-3  # Tikhonov λ, split as λ_A = √λ·π, λ_B = √λ/π (docs/strategies/pipefisher.md)
    refresh_interval: int = 1  # k: curvature captured every k steps, inverses used from the cycle's last step
    factor_blocks: int = 1  # T > 1: factors block-diagonal as a 1-D grid of T holds them (pipefisher × 1d's oracle)


@dataclass
class PipeFisherStrategyConfig(StagedStrategyConfig, OverlappedReductionConfig):
    """A pipeline whose bubbles run K-FAC's curvature, factor sync and inversion (Osawa et al. 2023).
    No activation recomputation: its curvature capture would see every recomputed forward twice."""

    damping: float = 1e-3  # Tikhonov λ, split as λ_A = √λ·π, λ_B = √λ/π (docs/strategies/pipefisher.md)
    refresh_interval: Optional[int] = None  # k; null = the steps the bubble packing needs
    bubble_margin: float = 0.05  # a unit is placed in a bubble only if it fits with this margin


@dataclass
class Fsdp2StrategyConfig(MicroBatchedStrategyConfig):
    """PyTorch's FSDP2 (fully_shard) through Lightning's ModelParallelStrategy: the ZeRO-3 baseline."""

    sync_every_micro_batch: bool = True  # false = no-sync accumulation: one reduce-scatter per step


@dataclass
class OptimizerConfig:
    """The first-order optimizer and its learning-rate schedule."""

    name: str = "adamw"  # adamw | lamb | sgd
    lr: float = 1e-3  # peak learning rate
    weight_decay: float = 0.0  # decoupled weight decay on matrices
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9  # sgd only
    warmup_steps: int = 10  # linear warm-up
    lr_schedule: str = "cosine"  # cosine | constant (after warm-up)
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of lr


@dataclass
class LoggerConfig:
    """Where metrics go besides metrics.csv and summary.json (always written)."""

    name: str = "wandb"  # wandb | csv | tensorboard | none
    mode: str = "offline"  # wandb: offline | online | disabled
    project: str = "layerwise"  # wandb project
    entity: Optional[str] = None  # wandb entity (team)
    group: Optional[str] = None  # wandb group; null = the sweep's name in a multirun


@dataclass
class TrainerConfig:
    """Loop lengths and cadences (Lightning Trainer arguments we expose)."""

    max_steps: int = 200  # optimizer steps
    val_check_interval: int = 50  # steps between validations
    limit_val_batches: int = 4  # validation batches per evaluation
    log_every_n_steps: int = 1  # rows in metrics.csv are per step regardless
    checkpoint_every_n_steps: int = 50  # the `last` checkpoint is rewritten this often
    gradient_clip_val: float = 0.0  # global gradient-norm clip; 0 = off
    progress: str = "auto"  # auto (bar on a terminal, lines otherwise) | bar | lines | none
    check_point_to_point_order: bool = False  # each step, compare rank pairs' p2p issue order (NCCL); tests: true
    measure_every_n_steps: int = 50  # compute-memory meter and pipeline timelines: first 2 steps, every n, last; pipelines also time the step after each, unmetered (its bubble is reported)
    skip_nonfinite_steps: bool = False  # NaN/inf loss: skip the step's update (counted in summary.json skipped_steps) instead of stopping
    # a rank waiting this long in one collective or point-to-point operation writes hang/rank-<k>.json
    # and the run stops, naming the stuck rank (docs/faults.md); null = hardware.collective_timeout_s, 0 = off.
    # Every process group (NCCL's own watchdog) times out at (long_timeout_factor + 1) × this + about 64 s,
    # after our diagnosis (layerwise/run/timeouts.py TimeoutChain: 60 s -> 726 s, 600 s -> 6666 s)
    collective_timeout_s: Optional[float] = None
    long_timeout_factor: float = 10.0  # the first step, validation and checkpoints wait this many times as long
    charts: bool = True  # PNG charts at the run's end (plan*.png, schedule_*.png); plan.json, schedule.json either way
    straggler_window: int = 20  # a rank whose compute time stays > 1.5x the median this many steps is flagged; 0 = off
    # torch.compile each transformer block once, regionally (strategies/compile.py); strategies whose blocks
    # cannot compile run them eager and say why (printed, and summary.json compile.eager). summary.json's `compile` holds graphs, recompilations, seconds
    compile: bool = False
    # steps (1-based optimizer steps) to profile: a Chrome/Perfetto trace per rank and a memory record in
    # <run>/profile/ (layerwise/run/profile.py), linked from summary.json's `profile`
    profile_steps: List[int] = field(default_factory=list)


@dataclass
class CalibrateConfig:
    """mode=calibrate: measure this machine and write a hardware profile (layerwise/tools/calibrate.py)."""

    name: str = "calibrated"  # the profile's name: hardware=<name> afterwards
    directory: str = "conf/hardware"  # where <name>.yaml and <name>.calibration.json are written
    world_sizes: List[int] = field(default_factory=lambda: [2])  # gloo ranks the collectives are timed between
    repeats: int = 5  # timed calls per size (the median is kept), at least 3
    quick: bool = False  # small sizes only (tests): a rough profile in seconds
    silent: bool = False  # no progress lines


@dataclass
class ReproduceConfig:
    """mode=reproduce: one paper's headline claim at its scale or ours (layerwise/reproduce/)."""

    claim: str = "training_time"  # training_time | pipefisher | l2l | three_d (one module each)
    scale: str = "paper"  # paper: plan mode at the paper's scale | small: trains here, prediction vs measurement
    # the PipeFisher claim's convergence runs (benchmarks/pipefisher_convergence.py writes it)
    convergence_report: str = "docs/results/pipefisher_convergence.json"


@dataclass
class PlanConfig:
    """mode=plan: the analytic plan of this layout at full scale (layerwise/planning/mode.py)."""

    efficiency: float = 0.5  # achieved / peak FLOP/s of the matrix products (assumed until calibrated)
    flash_attention: bool = True  # attention keeps no s × s scores (GPU kernels); false: the math kernel
    allocator_margin: float = 0.1  # device memory the allocator's fragmentation and caches take beyond tensors
    # mixtures of experts: the busiest expert's routed tokens over the mean, assumed (cost/experts.py; 1.25:
    # Switch Transformer's capacity factor, Fedus et al. 2022 §2.1); scales the busiest rank's expert work and all-to-all
    expert_load_imbalance: float = 1.25
    # plan.search=true: rank every valid layout for this model, hardware and batch (layerwise/planning/search.py);
    # the strategy group's own fields are then ignored
    search: bool = False
    search_top: int = 10  # layouts printed, fastest first
    search_replan: int = 3  # of those, re-planned through the full plan path (simulated plan) side by side
    search_max_tensor_ranks: int = 0  # largest tensor block searched; 0 = hardware.devices_per_node (one node)
    # largest context-parallel degree c searched (powers of two dividing the world, 2c dividing
    # data.sequence_length; the families whose strategy accepts it): 1 = no context parallelism
    search_max_context: int = 1
    # plan.dry_run=true: also dry-run one rank of each role with the real code under a fake process group
    # and compare its step's peak memory and collective bytes with the analytic plan (layerwise/tools/cross_check.py)
    dry_run: bool = False


@dataclass
class Config:
    """The whole experiment: one strategy, model, hardware, data, optimizer and logger."""

    strategy: Any = MISSING
    model: Any = MISSING
    hardware: Any = MISSING
    data: Any = MISSING
    optimizer: Any = MISSING
    logger: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    calibrate: CalibrateConfig = field(default_factory=CalibrateConfig)
    reproduce: ReproduceConfig = field(default_factory=ReproduceConfig)
    seed: int = 1234  # one seed for weights, data order and dropout
    # fit | check (compose and validate only) | plan (predict memory and step time, run nothing)
    # | calibrate (time this machine) | reproduce (a paper's claim: experiment=repro_<claim>)
    mode: str = "fit"
    run_name: str = "default"  # the run directory's name
    resume: bool = True  # continue from the run directory's `last` checkpoint if present
    resume_from: Optional[str] = None  # a portable checkpoint (any strategy, layout, world size): runs/<name>/checkpoints/last


SCHEMAS = {
    "model": {"model": ModelConfig},
    "data": {"data": DataConfig},
    "hardware": {"hardware": HardwareConfig},
    "strategy": {"strategy": StrategyConfig, "plain": PlainStrategyConfig,
                 "data_parallel": DataParallelStrategyConfig, "pipeline": PipelineStrategyConfig,
                 "zero_layered": ZeroLayeredStrategyConfig, "l2l": L2LStrategyConfig,
                 "tensor_parallel": TensorParallelStrategyConfig,
                 "kfac": KFACStrategyConfig, "pipefisher": PipeFisherStrategyConfig,
                 "fsdp2": Fsdp2StrategyConfig},
    "optimizer": {"optimizer": OptimizerConfig},
    "logger": {"logger": LoggerConfig},
}


