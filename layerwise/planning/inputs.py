"""A validated config as the cost model reads it: the device, the shape, the workload, the plan `fit` runs.

Every planning module, the dry run, the reports and the claims turn a config into the cost model's
inputs (cost/inputs.py) here, and nowhere else.
"""

from omegaconf import OmegaConf

from cost.context import sharded_shape
from cost.inputs import BYTES, Device, GptShape, Workload
from models import block_of, blocks_of
from layerwise.config.errors import ConfigError
from layerwise.config.schema import PipelineStrategyConfig
from layerwise.config.layout import layout_of
from strategies.registry import planned_as, strategies_planned_as
from strategies.buckets import bucket_bytes
from strategies.modular_pipeline import compute_plan
from strategies.precision import activation_dtype, compute_dtype


# Which strategies plan mode prices, and how, is each one's StrategyEntry.planned_as (strategies/registry.py).
PLANNED = strategies_planned_as("pipeline")  # the plan `fit` runs
TENSOR_ONLY = strategies_planned_as("tensor_grid")  # planned as the one-stage pipeline they equal (as_planned)
WHOLE_MODEL = strategies_planned_as("whole_model")  # likewise: one stage, no grid, one micro-batch, data replicas
ONE_STAGE = TENSOR_ONLY + WHOLE_MODEL


def plan_mode_errors(cfg) -> list:
    """For validate in mode=plan: a strategy plan mode cannot price, or a price it lacks."""
    name = cfg.strategy.name
    if planned_as(name) is None:
        return [f"strategy={name}: mode=plan covers {', '.join(PLANNED + ONE_STAGE)}, pipefisher and l2l, not "
                f"{name} yet. Fix: strategy=zero_layered plans ZeRO-3 sharding (fsdp2's), strategy=ddp data "
                f"parallelism."]
    if planned_as(name) == "relay" and not cfg.hardware.host_device_bandwidth:
        return [f"hardware={cfg.hardware.name} has no hardware.host_device_bandwidth: L2L's relay cannot be "
                f"priced. Fix: hardware.host_device_bandwidth=1.6e10 (PCIe 3 × 16)."]
    return []


def as_planned(cfg):
    """A tensor-parallel strategy (tp_1d, tp_2d, three_d), `single` or `ddp` as the pipeline plan mode
    prices: one stage holding every layer, one micro-batch, the same grid (none for single/ddp) and
    data replicas — a step of the same products and the same collectives (ddp's one bucketed
    all-reduce is the one stage's reduction). Other strategies are returned as they are."""
    strategy = cfg.strategy
    if strategy.name in WHOLE_MODEL:
        return one_stage_pipeline(cfg, "none", 1, None, strategy.activation_recompute)
    if strategy.name not in TENSOR_ONLY:
        return cfg
    return one_stage_pipeline(cfg, strategy.tensor_parallel, strategy.tensor_grid, strategy.data_degree,
                              strategy.activation_recompute)


def one_stage_pipeline(cfg, grid: str, edge: int, data_degree=None, activation_recompute: str = "none"):
    """`cfg` with a modular_pipeline strategy of one stage holding every layer and one micro-batch,
    the tensor grid `grid` of edge `edge` inside it (what a tensor-parallel strategy computes)."""
    planned = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    planned.strategy = OmegaConf.merge(OmegaConf.structured(PipelineStrategyConfig), {
        "name": "modular_pipeline", "pipeline_degree": 1, "data_degree": data_degree,
        "layers_per_stage": cfg.model.layers, "micro_batches": 1, "tensor_parallel": grid,
        "tensor_grid": edge, "activation_recompute": activation_recompute,
        # the switches the strategy has; one it lacks keeps what it does without (the Workload's default)
        "sequence_parallel": cfg.strategy.get("sequence_parallel", False),
        "tensor_overlap": cfg.strategy.get("tensor_overlap", False),
        "overlap_reduction": cfg.strategy.get("overlap_reduction", False),
        "message_dtype": cfg.strategy.get("message_dtype", "fp32"),  # (one stage: nothing crosses a boundary)
        "scatter_gather": cfg.strategy.get("scatter_gather", False),
        "expert_parallel": cfg.strategy.get("expert_parallel", 1),
        "distributed_optimizer": cfg.strategy.get("distributed_optimizer", False),
        "context_parallel": cfg.strategy.get("context_parallel", 1),
        "context_parallel_comm": cfg.strategy.get("context_parallel_comm", "ring")})
    return planned


def workload_of(cfg, world_size: int, vocabulary: int = None) -> Workload:
    """The model, layout and batch of a validated config, as the estimators see them; `vocabulary`
    defaults to the data group's (bytes: 256, token_bin: data.vocab_size; + [MASK] for BERT)."""
    if cfg.strategy.name not in PLANNED + ONE_STAGE:  # l2l: relay_plan_result
        raise ConfigError(plan_mode_errors(cfg))
    through_forward = cfg.strategy.name in ONE_STAGE  # Lightning's closure zeroes gradients after the forward
    cfg = as_planned(cfg)
    layout = layout_of(cfg, world_size)  # the run's own: the cost model prices what the ranks build
    # under context parallelism a rank computes s/c tokens of each sequence (cost/context.py)
    return Workload(sharded_shape(shape_of(cfg, vocabulary), layout.context), cfg.model.layers, cfg.model.heads,
                    layout, cfg.strategy.layers_per_stage,
                    cfg.data.global_batch_size // (layout.data * cfg.strategy.micro_batches),
                    cfg.optimizer.name, cfg.strategy.activation_recompute == "full",
                    compute_bytes(cfg), through_forward, cfg.hardware.process_group_backend == "gloo",
                    expert_imbalance=cfg.plan.expert_load_imbalance, moe_share=moe_share_of(cfg.model),
                    **communication_of(cfg.strategy, cfg.hardware.precision, layout, cfg.plan.flash_attention))


def communication_of(strategy, precision: str, layout, flash_attention: bool = True) -> dict:
    """How our strategies communicate and overlap, from the strategy's switches (issue 56), as the
    `cost.inputs.Workload` fields cost/step_time.py prices: the one place a config becomes them (plan
    mode, the search's Evaluator, the reproductions). `strategy` is the strategy node (or a dict of
    its fields); a strategy whose schema lacks a switch gets what it does without one (the Workload
    default). Each field as our code does it:
    - message_bytes: a stage-boundary message in the compute dtype under strategy.message_dtype=compute
      (bf16/fp16 under mixed precision: 2), else the residual stream's own (fp32 under autocast;
      the narrow dtype under -true) — strategies/stages.py `StageWork.message`;
    - tensor_bytes: the 1-D grid's partial sums in the compute dtype under mixed precision with
      strategy.tensor_collective_dtype=compute (2: strategies/tensor_parallel/collectives.py
      `wire_dtype`), else 4 (fp32 sums; the 2-D/3-D grids always);
    - reduction_bytes: the data-parallel reduction in the compute dtype with
      strategy.reduction_dtype=compute (2 under bf16/fp16: strategies/buckets.py `on_wire`), else
      4 (the fp32 gradients of the fp32 master weights);
    - scatter_gather: strategy.scatter_gather on a 1-D grid between pipeline stages, not under
      sequence parallelism (there the boundary already carries the rank's 1/t sequence shard);
    - reduction_overlaps_backward: strategy.overlap_reduction (buckets posted under the backward);
    - sequence_parallel, tensor_overlap: the switches, on a 1-D grid (tensor_overlap only with
      sequence parallelism: it chunks the sequence-parallel gathers and scatters);
    - distributed_optimizer: the switch (ZeRO-1 over the data ranks);
    - recompute_attention: strategy.activation_recompute=selective (the core attention rerun);
    - attention_scores: plan.flash_attention=false (the math kernel materialises the scores);
    - context_comm: strategy.context_parallel_comm (ring | all_gather; the degree c is the layout's)."""
    one_d = layout.tensor_grid == "1d" and layout.tensor > 1
    sequence_parallel = bool(strategy.get("sequence_parallel", False)) and one_d
    stream = activation_dtype(precision)
    wire = compute_dtype(precision) if strategy.get("message_dtype", "fp32") == "compute" else stream
    mixed = precision.endswith("mixed")  # autocast: the only case the 1-D grid's sums narrow
    narrow_sums = one_d and mixed and strategy.get("tensor_collective_dtype", "fp32") == "compute"
    narrow_gradients = strategy.get("reduction_dtype", "fp32") == "compute"
    return {"message_bytes": wire.itemsize,
            "tensor_bytes": compute_dtype(precision).itemsize if narrow_sums else BYTES,
            "reduction_bytes": compute_dtype(precision).itemsize if narrow_gradients else BYTES,
            "scatter_gather": bool(strategy.get("scatter_gather", False)) and one_d and layout.pipeline > 1
            and not sequence_parallel,
            "reduction_overlaps_backward": bool(strategy.get("overlap_reduction", False)),
            "tensor_overlap": bool(strategy.get("tensor_overlap", False)) and sequence_parallel,
            "attention_scores": not flash_attention, "sequence_parallel": sequence_parallel,
            "distributed_optimizer": bool(strategy.get("distributed_optimizer", False)),
            "recompute_attention": strategy.get("activation_recompute", "none") == "selective",
            "context_comm": strategy.get("context_parallel_comm", "ring"),
            # the pipeline stages' gradient buckets (the strategies with the overlap_reduction switch)
            "gradient_bucket_bytes": bucket_bytes(strategy.get("bucket_mb", 0)) if "overlap_reduction" in strategy else 0}


def moe_share_of(model) -> float:
    """The share of a model's blocks that are MoE blocks (model.moe_layers; 1 for a dense model, whose
    blocks price no experts): cost.inputs.Workload.moe_share."""
    if not model.get("experts"):
        return 1.0
    blocks = blocks_of(model)
    return sum(1 for block in blocks if block.experts) / len(blocks)


def compute_bytes(cfg) -> int:
    """Bytes per element of the compute dtype: 2 under bf16/fp16 autocast, else 4."""
    return 2 if cfg.hardware.precision.endswith("mixed") else 4


def shape_of(cfg, vocabulary: int = None) -> GptShape:
    """The model's widths and lengths; `vocabulary` defaults to the data group's (bytes: 256,
    token_bin: data.vocab_size; + [MASK] for BERT)."""
    if vocabulary is None:
        vocabulary = cfg.data.vocab_size if cfg.data.corpus == "token_bin" else 256
        vocabulary += 1 if cfg.model.architecture == "bert" else 0
    return GptShape(cfg.model.hidden, cfg.model.mlp_ratio, vocabulary, cfg.data.sequence_length,
                    cfg.model.max_sequence_length, block_of(cfg.model), cfg.model.architecture != "llama")


def device_of(cfg, world_size: int = None) -> Device:
    """The hardware profile as the cost model reads it. On a profile with `compute_units_per_node`
    (a CPU: its cores) the ranks of a node share the cores. With fewer ranks than cores a rank's
    threads speed up its matrix products and its large element-wise operators (`core_share`,
    cost.step_time.elementwise_seconds); with more,
    each rank computes at cores ÷ ranks of the one-thread rate while all compute (`core_share`: a
    waiting rank's share goes to the others, cost.step_time.simulated_step), and a pipeline message
    waits for its descheduled peer like a collective does (measured: a 256 KB send took ~3 ms with 4 ranks on 2
    cores, 0.2 ms with 2)."""
    hardware = cfg.hardware
    # fp8-mixed: bf16-mixed whose blocks' linears run at the profile's fp8 rate (linear_flops_per_second);
    # flops_per_second stays the bf16 peak, against which MFU is stated (as torchtitan and Megatron-LM do)
    fp8 = hardware.precision == "fp8-mixed"
    dtype = "bf16" if hardware.precision.startswith(("bf16", "fp8")) else "fp16" \
        if hardware.precision.startswith("16") else "fp32"
    ranks = min(hardware.devices_per_node, world_size or hardware.devices_per_node)
    share = hardware.compute_units_per_node / ranks if hardware.compute_units_per_node else 1.0
    slow = min(share, 1.0)  # time-sharing stretches every compute cost (a lone rank's threads: core_share)
    return Device(hardware.peak_flops.get(dtype, 0.0) * share, efficiency_of(cfg), hardware.device_memory_bytes,
                  hardware.intra_node_bandwidth, hardware.inter_node_bandwidth, hardware.devices_per_node,
                  hardware.matmul_overhead_s / slow, hardware.collective_latency_s, hardware.block_overhead_s / slow,
                  hardware.activation_seconds_per_element / slow, hardware.optimizer_seconds_per_parameter / slow,
                  (hardware.point_to_point_latency_s if share >= 1 else hardware.collective_latency_s) or None,
                  hardware.overlaps_communication, hardware.memory_bandwidth, share,
                  tuple(tuple(row) for row in hardware.collective_seconds_by_bytes or ()),
                  hardware.step_overhead_s / slow, hardware.action_overhead_s / slow,
                  hardware.get("gather_overlap"),
                  linear_flops_per_second=hardware.peak_flops.get("fp8", 0.0) * share if fp8 else 0.0)


def efficiency_of(cfg) -> float:
    """Achieved / peak FLOP/s of the matrix products: the profile's own where it knows it (a calibrated
    profile's peak is the rate mode=calibrate measured: 1), else `plan.efficiency` (assumed, or fitted
    on A100 runs) × the device's measured large-product efficiency relative to the A100's."""
    known = cfg.hardware.get("matmul_efficiency")
    if known is not None:
        return known
    return cfg.plan.efficiency * cfg.hardware.get("relative_matmul_efficiency", 1.0)


def training_plan_of(cfg):
    """The plan `fit` would run (ZeRO's with its gathers and reduce-scatters), built by the very
    `complete_plan` the strategy calls (which validates it)."""
    from strategies.modular_pipeline import ModularPipelineStrategy
    from strategies.zero_layered import ZeroLayeredStrategy
    cfg = as_planned(cfg)
    compute = compute_plan(cfg.strategy, cfg.model.layers)
    owner = ZeroLayeredStrategy if cfg.strategy.name.startswith("zero") else ModularPipelineStrategy
    return owner.complete_plan(compute)
