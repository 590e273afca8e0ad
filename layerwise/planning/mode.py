"""mode=plan: every pipeline rank's memory and the predicted step at full scale, before anything runs.

    python train.py mode=plan model=gpt3_175b hardware=dgx_a100_80g hardware.nodes=64 \
        strategy=modular_pipeline strategy.pipeline_degree=16 strategy.tensor_parallel=1d \
        strategy.tensor_grid=8 strategy.micro_batches=64 data.global_batch_size=1536 data.sequence_length=2048

The same composition and validation as `fit`, then strategies/estimate.py's analytic model of the
very plan `fit` would run: a table on the terminal, `plan.json`, the predicted step as a Gantt
chart in seconds (`plan.png`) and the memory of each rank role (`plan_memory.png`). The model is
not yet calibrated against this machine (issue 16): the default efficiency is an assumption.
"""

import json
from pathlib import Path

from omegaconf import OmegaConf

from layerwise.validate import ConfigError
from models.transformer import model_flops_per_token
from strategies import strategy_entry
from strategies.estimate import Device, Workload, predict_step
from strategies.estimate_memory import memory
from strategies.modular_pipeline import compute_plan, tensor_parallel
from strategies.schedule import plot_timeline
from strategies.traffic import ComposedLayout, GptShape, all_reduce

PLANNED = ("modular_pipeline", "gpipe", "one_f_one_b", "interleaved_1f1b", "zero_layered", "zero_depth_first")
TENSOR_ONLY = ("tp_1d", "tp_2d", "three_d")  # planned as the one-stage pipeline they equal (as_planned)
WHOLE_MODEL = ("single", "ddp")  # likewise: one stage, no grid, one micro-batch, every rank a data replica
ONE_STAGE = TENSOR_ONLY + WHOLE_MODEL
GIB = 2 ** 30


def plan_problems(cfg) -> list:
    """For validate in mode=plan: a strategy plan mode cannot price, or a price it lacks."""
    name = cfg.strategy.name
    if name not in PLANNED + ONE_STAGE + ("l2l", "pipefisher"):
        return [f"strategy={name}: mode=plan covers {', '.join(PLANNED + ONE_STAGE)}, pipefisher and l2l, not "
                f"{name} yet. Fix: strategy=zero_layered plans ZeRO-3 sharding (fsdp2's), strategy=ddp data "
                f"parallelism."]
    if name == "l2l" and not cfg.hardware.host_device_bandwidth:
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
    from layerwise.config import PipelineStrategyConfig
    planned = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    planned.strategy = OmegaConf.merge(OmegaConf.structured(PipelineStrategyConfig), {
        "name": "modular_pipeline", "pipeline_degree": 1, "data_degree": data_degree,
        "layers_per_stage": cfg.model.layers, "micro_batches": 1, "tensor_parallel": grid,
        "tensor_grid": edge, "activation_recompute": activation_recompute})
    return planned


def workload_of(cfg, world_size: int, vocabulary: int = None) -> Workload:
    """The model, layout and batch of a validated config, as the estimators see them; `vocabulary`
    defaults to the data group's (bytes: 256, token_bin: data.vocab_size; + [MASK] for BERT)."""
    if cfg.strategy.name not in PLANNED + ONE_STAGE:  # l2l: relay_plan_result
        raise ConfigError(plan_problems(cfg))
    through_forward = cfg.strategy.name in ONE_STAGE  # Lightning's closure zeroes gradients after the forward
    cfg = as_planned(cfg)
    degrees = strategy_entry(cfg.strategy.name).degrees(cfg, world_size)
    shape = shape_of(cfg, vocabulary)
    layout = ComposedLayout(degrees.data, degrees.pipeline, tensor_parallel(cfg.strategy),
                            cfg.strategy.tensor_grid, cfg.strategy.name.startswith("zero"))
    return Workload(shape, cfg.model.layers, cfg.model.heads, layout, cfg.strategy.layers_per_stage,
                    cfg.data.global_batch_size // (degrees.data * cfg.strategy.micro_batches),
                    cfg.optimizer.name, cfg.strategy.activation_recompute == "full",
                    compute_bytes(cfg), through_forward, cfg.hardware.process_group_backend == "gloo")


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
                    cfg.model.max_sequence_length)


def device_of(cfg, world_size: int = None) -> Device:
    """The hardware profile as the cost model reads it. On a profile with `compute_units_per_node`
    (a CPU: its cores) the ranks of a node share the cores. With fewer ranks than cores a rank's
    threads speed up its matrix products (small element-wise operators do not split); with more,
    each rank computes at cores ÷ ranks of the one-thread rate, and a pipeline message waits for its
    descheduled peer like a collective does (measured: a 256 KB send took ~3 ms with 4 ranks on 2
    cores, 0.2 ms with 2)."""
    hardware = cfg.hardware
    dtype = "bf16" if hardware.precision.startswith("bf16") else "fp16" if hardware.precision.startswith("16") \
        else "fp32"
    ranks = min(hardware.devices_per_node, world_size or hardware.devices_per_node)
    share = hardware.compute_units_per_node / ranks if hardware.compute_units_per_node else 1.0
    slow = min(share, 1.0)  # time-sharing stretches every compute cost; extra threads help the products only
    return Device(hardware.peak_flops.get(dtype, 0.0) * share, cfg.plan.efficiency, hardware.device_memory_bytes,
                  hardware.intra_node_bandwidth, hardware.inter_node_bandwidth, hardware.devices_per_node,
                  hardware.matmul_overhead_s / slow, hardware.collective_latency_s, hardware.block_overhead_s / slow,
                  hardware.activation_seconds_per_element / slow, hardware.optimizer_seconds_per_parameter / slow,
                  (hardware.point_to_point_latency_s if share >= 1 else hardware.collective_latency_s) or None,
                  hardware.overlaps_communication)


def training_plan_of(cfg):
    """The plan `fit` would run (ZeRO's with its gathers and reduce-scatters), built by the very
    `complete_plan` the strategy calls (which validates it)."""
    from strategies.modular_pipeline import ModularPipelineStrategy
    from strategies.zero_layered import ZeroLayeredStrategy
    cfg = as_planned(cfg)
    compute = compute_plan(cfg.strategy, cfg.model.layers)
    owner = ZeroLayeredStrategy if cfg.strategy.name.startswith("zero") else ModularPipelineStrategy
    return owner.complete_plan(compute)


def roles(per_rank: list) -> list:
    """Pipeline ranks with equal memory merged into one role: (label, ranks, breakdown)."""
    merged = []
    for rank, breakdown in enumerate(per_rank):
        if merged and merged[-1][2] == breakdown:
            merged[-1][1].append(rank)
        else:
            merged.append((None, [rank], breakdown))
    last = len(per_rank) - 1
    return [(_label(ranks, last), ranks, breakdown) for _, ranks, breakdown in merged]


def _label(ranks: list, last: int) -> str:
    parts = (["embedding"] if 0 in ranks else []) + (["head"] if last in ranks else [])
    span = f"pipeline rank {ranks[0]}" if len(ranks) == 1 else f"pipeline ranks {ranks[0]}–{ranks[-1]}"
    return span + (f" ({' + '.join(parts)})" if parts else "")


def plan(cfg, world_size: int, run_directory) -> dict:
    """Compute, print and write the plan; returns what plan.json holds. With plan.search=true,
    rank every valid layout instead (layerwise/search.py)."""
    if cfg.plan.search:
        from layerwise.search import search
        return search(cfg, cfg.hardware.nodes * cfg.hardware.devices_per_node, run_directory)
    result, timeline = plan_result(cfg, world_size, with_timeline=True)
    device = device_of(cfg)
    if cfg.plan.dry_run:  # the second estimator, one dry-run rank per role (layerwise/cross_check.py)
        from layerwise.cross_check import cross_check, describe
        for role, entry in zip(result["roles"], cross_check(cfg, world_size, result)):
            role["dry_run"] = entry
            print(describe(entry))
    _write(result, timeline, Path(run_directory), device.memory_bytes)
    print(table(result, device))
    if "host_bytes" in result:
        print(f"host store per data rank: {sum(result['host_bytes'].values()) / GIB:.2f} GiB of "
              f"{cfg.hardware.host_memory_bytes / GIB:.0f} ({'fits' if result['host_fits'] else 'does NOT fit'})")
    return result


def relay_plan_result(cfg, world_size: int) -> dict:
    """L2L's plan (strategies/estimate.py's relay terms): one device per data replica relays the layers
    from its host store. Not priced: the data replicas' gradient all-reduce and the host's optimizer."""
    from strategies.estimate import relay_host_memory, relay_memory, relay_step
    strategy, margin, device = cfg.strategy, cfg.plan.allocator_margin, device_of(cfg, world_size)
    weight_bytes = compute_bytes(cfg)
    workload = Workload(shape_of(cfg), cfg.model.layers, cfg.model.heads, ComposedLayout(world_size, 1), cfg.model.layers,
                        cfg.data.global_batch_size // (world_size * strategy.micro_batches), cfg.optimizer.name,
                        False, weight_bytes)
    step = relay_step(workload, device, strategy.micro_batches, cfg.hardware.host_device_bandwidth, weight_bytes,
                      strategy.constant_memory, overlap=strategy.prefetch)
    device_bytes = relay_memory(workload, strategy.micro_batches, strategy.constant_memory, weight_bytes,
                                cfg.plan.flash_attention)
    host_bytes = relay_host_memory(workload, strategy.micro_batches, strategy.constant_memory)
    return {**_result_header(cfg, world_size, workload, device, step["step_seconds"]),
            "bubble_fraction": 0.0, "exposed_transfer_seconds": step["exposed_transfer_seconds"],
            "host_bytes": host_bytes, "host_fits": sum(host_bytes.values()) <= cfg.hardware.host_memory_bytes,
            "roles": [_role("every data rank (device)", [0], device_bytes, margin, device)]}


def _result_header(cfg, world_size: int, workload: Workload, device: Device, step_seconds: float) -> dict:
    """What every plan.json starts with: the point, the step, tokens/s and MFU."""
    tokens = cfg.data.global_batch_size * cfg.data.sequence_length
    flops = model_flops_per_token(cfg.model.layers, cfg.model.hidden, cfg.data.sequence_length,
                                  workload.shape.vocabulary, cfg.model.mlp_ratio) * tokens
    return {"strategy": cfg.strategy.name, "model": cfg.model.name, "hardware": cfg.hardware.name,
            "world_size": world_size, "layout": workload.layout.__dict__, "step_seconds": step_seconds,
            "tokens_per_s": tokens / step_seconds, "mfu": flops / (device.flops_per_second * world_size * step_seconds),
            "allocator_margin": cfg.plan.allocator_margin, "efficiency_assumed": device.efficiency}


def _role(label: str, ranks: list, breakdown: dict, margin: float, device: Device) -> dict:
    total = sum(breakdown.values()) * (1 + margin)
    return {"role": label, "pipeline_ranks": ranks, "bytes": breakdown, "total_bytes": total,
            "fits": total <= device.memory_bytes}


def plan_result(cfg, world_size: int, with_timeline: bool = False):
    """What plan.json holds (and the simulated timeline if asked): the full plan path."""
    if cfg.strategy.name == "l2l":
        result = relay_plan_result(cfg, world_size)
        return (result, None) if with_timeline else result
    if cfg.strategy.name == "pipefisher":  # K-FAC in the bubbles: layerwise/plan_pipefisher.py
        from layerwise.plan_pipefisher import pipefisher_plan_result
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
              "bubble_fraction": step["bubble_fraction"], "exposed_data_seconds": step["exposed_data_seconds"],
              "bytes_by_pipeline_rank": step["bytes_by_rank"],
              "roles": [_role(label, ranks, breakdown, margin, device) for label, ranks, breakdown in roles(per_rank)]}
    return (result, step["timeline"]) if with_timeline else result


def table(result: dict, device: Device) -> str:
    lines = [f"plan: {result['strategy']} × {result['model']} × {result['hardware']} on {result['world_size']} "
             f"devices; predicted step {result['step_seconds']:.3f} s, {result['tokens_per_s']:.0f} tokens/s, "
             f"MFU {result['mfu']:.1%}, bubble {result['bubble_fraction']:.1%} (efficiency "
             f"{result['efficiency_assumed']:.0%} assumed, "
             f"{'hardware measured by mode=calibrate' if device.activation_seconds_per_element else 'not calibrated'})",
             f"{'role':40s} {'params':>8s} {'grads':>8s} {'optim':>8s} {'activ':>8s} {'buffers':>8s} "
             + "".join(f"{kind:>8s} " for kind in _extra_kinds(result)) + f"{'total GiB':>10s} {'device':>7s} fits"]
    for role in result["roles"]:
        b = role["bytes"]
        lines.append(f"{role['role']:40s} " + " ".join(f"{b[k] / GIB:8.2f}" for k in
                     ("parameters", "gradients", "optimizer", "activations", "buffers", *_extra_kinds(result)))
                     + f" {role['total_bytes'] / GIB:10.2f} {device.memory_bytes / GIB:7.1f} "
                     f"{'yes' if role['fits'] else 'NO'}")
    if "refresh_interval" in result:  # PipeFisher (layerwise/plan_pipefisher.py)
        lines.append(f"PipeFisher: first-order step {result['step_first_order_seconds']:.3f} s, bubble "
                     f"{result['bubble_first_order']:.1%} → {result['bubble_fraction']:.1%} with K-FAC packed into "
                     f"a {result['refresh_interval']}-step cycle (K-FAC work / bubble {result['kfac_work_per_bubble']:.2f})")
    return "\n".join(lines)


def _extra_kinds(result: dict) -> list:
    """Kinds of bytes beyond the five every plan has (PipeFisher's "kfac"), as the roles list them."""
    return [kind for kind in result["roles"][0]["bytes"]
            if kind not in ("parameters", "gradients", "optimizer", "activations", "buffers")]


def _write(result: dict, timeline, directory: Path, device_memory_bytes: float) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "plan.json").write_text(json.dumps(result, indent=1))
    if timeline is not None:  # L2L's relay is priced in closed form: no simulated timeline
        plot_timeline(timeline, directory / "plan.png", title=f"predicted step: {result['strategy']}", time_unit="s")
    _plot_memory(result, directory / "plan_memory.png", device_memory_bytes)


def _plot_memory(result: dict, path: Path, device_memory_bytes: float) -> None:
    """Stacked bars per rank role, one colour per kind, and the device's memory as a line."""
    from matplotlib.figure import Figure
    figure = Figure(figsize=(9, 1.5 + 0.45 * len(result["roles"])), layout="constrained")
    axes = figure.add_subplot()
    kinds = list(result["roles"][0]["bytes"])
    for colour, kind in enumerate(kinds):
        lefts = [sum(role["bytes"][k] for k in kinds[:colour]) / GIB for role in result["roles"]]
        widths = [role["bytes"][kind] / GIB for role in result["roles"]]
        axes.barh(range(len(widths)), widths, left=lefts, color=f"C{colour}", label=kind)
    axes.axvline(device_memory_bytes / (1 + result["allocator_margin"]) / GIB, color="black", linestyle="--",
                 label="device memory less the allocator margin")
    axes.set_yticks(range(len(result["roles"])), [role["role"] for role in result["roles"]])
    axes.invert_yaxis()
    axes.set_xlabel("GiB per device")
    axes.set_title(f"plan: {result['strategy']} × {result['model']} on {result['world_size']} devices", fontsize=10)
    axes.legend(loc="lower right", fontsize=8)
    figure.savefig(path, dpi=110)


# ----- validation: a layout whose plan does not fit is refused before anything runs

ALTERNATIVES = (("strategy.activation_recompute", "full"), ("strategy.schedule", "one_f_one_b"))


def worst_role(cfg, world_size: int) -> tuple:
    """(label, bytes by kind, total with the allocator margin) of the rank role needing the most."""
    if cfg.strategy.name == "pipefisher":  # the pipeline's bytes + K-FAC's (layerwise/plan_pipefisher.py)
        from layerwise.plan_pipefisher import pipefisher_rank_memory
        per_rank = [breakdown for breakdown, _ in pipefisher_rank_memory(cfg, world_size)[0]]
    else:
        workload, schedule = workload_of(cfg, world_size), training_plan_of(cfg)
        per_rank = [memory(workload, schedule, rank, cfg.plan.flash_attention)
                    for rank in range(schedule.pipeline_degree)]
    label, _, breakdown = max(roles(per_rank), key=lambda role: sum(role[2].values()))
    return label, breakdown, sum(breakdown.values()) * (1 + cfg.plan.allocator_margin)


def memory_problems(cfg, world_size: int) -> list:
    """For validate: refuse a pipeline layout whose plan does not fit hardware.device_memory_bytes,
    naming the role, its breakdown and the single changes that would fit (each planned too)."""
    if cfg.strategy.name not in PLANNED + ("pipefisher",) or not cfg.hardware.device_memory_bytes:
        return []
    label, breakdown, total = worst_role(cfg, world_size)
    if total <= cfg.hardware.device_memory_bytes:
        return []
    parts = ", ".join(f"{kind} {value / GIB:.1f}" for kind, value in breakdown.items())
    fits = [f"{field}={value}" for field, value in ALTERNATIVES if _fits_with(cfg, world_size, field, value)]
    return [f"the plan of this layout does not fit: {label} needs {total / GIB:.1f} GiB ({parts} GiB, + "
            f"{cfg.plan.allocator_margin:.0%} allocator margin) but hardware.device_memory_bytes="
            f"{cfg.hardware.device_memory_bytes:.3g} ({cfg.hardware.device_memory_bytes / GIB:.1f} GiB). Fix: "
            + (" or ".join(fits) + " (planned to fit)" if fits else
               "more pipeline or tensor ranks, more micro-batches, or a smaller data.global_batch_size")
            + "; python train.py mode=plan ... shows every role."]


def _fits_with(cfg, world_size: int, field: str, value) -> bool:
    """Whether the layout fits with one field changed (False if that change is itself invalid)."""
    changed = OmegaConf.merge(cfg, {})  # a writable copy
    try:
        OmegaConf.update(changed, field, value)  # pipefisher has no activation_recompute: not a change
        return worst_role(changed, world_size)[2] <= cfg.hardware.device_memory_bytes
    except Exception:  # noqa: BLE001 - a change the schedule rejects simply does not fit
        return False
