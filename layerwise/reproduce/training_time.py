"""Lamy-Poirier 2021: the shortest training time of dense GPT models, and what shortens it.

    python train.py experiment=repro_training_time          plan mode, 1B–1T parameters (a few minutes)
    python train.py experiment=repro_training_time_small    2 CPU ranks: predicted vs measured step ratios

The paper's analysis (seed 000; its equations were not at hand: docs/results/training_time.md gives the
reconstruction used here, and each choice below says where it departs):
1. the scaling laws of Kaplan et al. 2020 give each model its converged loss, its critical batch
   B_crit (the batch beyond which more data parallelism buys no fewer steps) and the steps to train;
2. the batch bounds the GPU count: B = data × micro-batches × rows, GPUs = data × pipeline × tensor;
   for each configuration and GPU count, plan mode's closed forms (layerwise/planning/search.py's Evaluator,
   cost/step_time.py) give the fastest step whose largest rank fits the device;
3. shortest training time = steps × the fastest step over every GPU count (powers of two up to
   MAXIMUM_GPUS) among the layouts that keep the GPUs busy (UTILISATION_FLOOR, our choice):
   contiguous 1F1B (depth-first accumulation) against the looping pipeline with layered
   accumulation, each with and without ZeRO, on A100 and H100 InfiniBand and A100 Ethernet.
At small scale (training_time_small.py): 1F1B, modular_pipeline and zero_layered train on
hardware.devices_per_node CPU ranks (train.py as a user runs it); plan mode's predicted ratio of
their step times is set against the measured one.
"""

import math
import time
from dataclasses import replace
from pathlib import Path

from omegaconf import OmegaConf

from layerwise.config.schema import HardwareConfig
from layerwise.reproduce import Finding, Verdict
from layerwise.reproduce.training_time_small import at_small_scale  # noqa: F401 (the claim's small scale)
from layerwise.planning.inputs import efficiency_of
from layerwise.planning.search import FAMILIES, Evaluator, layouts, point_of, role_bytes
from cost.step_time import SIMULATED, link_bandwidth, receive_seconds, stage_seconds
from cost.traffic import all_gather, all_reduce, local_parameters

ROOT = Path(__file__).resolve().parents[2]
GIB = 2 ** 30

# ----- 1. the scaling laws (Kaplan et al. 2020, eqs. 1.1, 5.1–5.6; the constants as docs/results/training_time.md quotes them)

CRITICAL_BATCH_TOKENS = 2.0e8  # B*
CRITICAL_BATCH_EXPONENT = 0.21  # α_B: B_crit(L) = B* / L^(1/α_B)
PARAMETER_SCALE = 8.8e13  # N_c (non-embedding parameters)
PARAMETER_EXPONENT = 0.076  # α_N: L(N) = (N_c / N)^α_N
STEP_SCALE = 2.1e3  # S_c
STEP_EXPONENT = 0.76  # α_S: L(N, S_min) = (N_c / N)^α_N + (S_c / S_min)^α_S
SEQUENCE_LENGTH = 2048  # GPT-3's context
BATCH_DIGITS = 4  # the batch in sequences is rounded down to 4 significant binary digits (8…15 × 2^k,
# less than 12.5% below B_crit) so that many data-parallel degrees 2^j divide it


def non_embedding_parameters(layers: int, hidden: int, mlp_ratio: int = 4) -> float:
    """Kaplan's N: the blocks' weights, (4 + 2r)·h² per layer (12·L·h² at r = 4)."""
    return layers * (4 + 2 * mlp_ratio) * hidden ** 2


def converged_loss(parameters: float) -> float:
    """L(N) in nats per token: the loss a model of N parameters reaches with unlimited data."""
    return (PARAMETER_SCALE / parameters) ** PARAMETER_EXPONENT


def critical_batch_tokens(loss: float) -> float:
    """B_crit(L): training at it costs 2·S_min steps and 2·E_min tokens (Kaplan eq. 5.4)."""
    return CRITICAL_BATCH_TOKENS / loss ** (1 / CRITICAL_BATCH_EXPONENT)


def minimum_steps(parameters: float) -> float:
    """S_min at the compute-efficient stopping point (Kaplan §6.1: the step term of L(N, S_min) is
    α_N/α_S of the parameter term, i.e. training stops 10% above the converged loss). Our choice:
    the paper's own step budget was not at hand."""
    gap = PARAMETER_EXPONENT / STEP_EXPONENT * converged_loss(parameters)
    return STEP_SCALE / gap ** (1 / STEP_EXPONENT)


def round_batch(sequences: int) -> int:
    """Down to BATCH_DIGITS significant binary digits: 19 500 → 18 432 = 9 × 2^11."""
    unit = 2 ** max(0, sequences.bit_length() - BATCH_DIGITS)
    return sequences // unit * unit


def training_budget(parameters: float) -> dict:
    """The batch (B_crit at the converged loss, Kaplan et al. 2020), rounded to whole sequences, and the
    tokens of training at it, 2·E_min = 2·S_min·B_crit; steps = tokens / the rounded batch."""
    loss = converged_loss(parameters)
    batch_tokens = critical_batch_tokens(loss)
    sequences = round_batch(int(batch_tokens / SEQUENCE_LENGTH))
    tokens = 2 * minimum_steps(parameters) * batch_tokens
    return {"loss": loss, "critical_batch_tokens": batch_tokens, "batch_sequences": sequences,
            "tokens": tokens, "steps": tokens / (sequences * SEQUENCE_LENGTH)}


# ----- 2. the models, the hardware and the four configurations

# name → (layers, hidden, heads): GPT-3 (Brown et al. 2020, table 2.1) and Narayanan et al. 2021
# (table 1); gpt3_175b and gpt_1t are conf/model's own.
SHAPES = {"gpt_1.3b": (24, 2048, 16), "gpt_6.7b": (32, 4096, 32), "gpt_13b": (40, 5120, 40),
          "gpt_39b": (48, 8192, 64), "gpt3_175b": "conf/model/gpt3_175b.yaml", "gpt_310b": (96, 16384, 128),
          "gpt_1t": "conf/model/gpt_1t.yaml"}
HARDWARE = ("dgx_a100_80g", "dgx_h100", "a100_ethernet")
VOCABULARY = 51200  # GPT-2's 50 257 tokens padded (Megatron-LM)
MAXIMUM_GPUS = 2 ** 17  # the GPU counts scanned: 8, 16, …, 131 072 ("tens of thousands", and beyond)
PATIENCE = 2  # halvings of the GPU count without a faster step before a configuration's scan stops
# The batch "allows" a GPU count when some layout still uses at least this share of the compute rate
# plan mode assumes (MFU ≥ floor × plan.efficiency × the device's relative matmul efficiency).
# Without a floor the cost model, whose efficiency does not fall with smaller micro-batches, keeps
# shortening the step down to one sequence per replica at ever lower utilisation; the paper's
# analysis asks for the GPUs the batch keeps busy.
UTILISATION_FLOOR = 0.5
TENSOR_GRIDS = ("none", "1d")  # Megatron's tensor parallelism inside a node, as the paper considered

# configuration → (search family, label): (a) contiguous stages with depth-first accumulation,
# (b) looping stages with layered accumulation, each plain and with ZeRO-3 data parallelism.
# interleaved_1f1b (looping, depth-first; Narayanan et al. 2021) is shown for reference only.
CONFIGURATIONS = {
    "depth_first": ("one_f_one_b", "contiguous 1F1B, depth-first"),
    "depth_first_zero": ("zero_depth_first", "contiguous, depth-first + ZeRO"),
    "layered": ("modular_pipeline", "modular pipeline, layered"),
    "layered_zero": ("zero_layered", "modular pipeline, layered + ZeRO"),
    "interleaved": ("interleaved_1f1b", "interleaved 1F1B (reference)"),
    # split backward (Qi et al. 2023, issue 32): contiguous ZB-H1 and the V, depth-first, no recomputation
    "zero_bubble_h1": ("zero_bubble_h1", "ZB-H1, split backward"),
    "zbv": ("zbv", "ZBV, split backward"),
}
BASELINES, IMPROVED = ("depth_first", "depth_first_zero"), ("layered", "layered_zero")
ZERO_BUBBLE = ("zero_bubble_h1", "zbv")


def configuration_of(layout, layers: int):
    """The configuration a searched layout belongs to, or None: ZeRO depth-first only with
    contiguous stages (one stage per rank), tensor grids only Megatron's."""
    if layout.tensor_parallel not in TENSOR_GRIDS:
        return None
    if layout.family == "zero_depth_first" and layout.layers_per_stage * layout.pipeline_degree != layers:
        return None
    for name, (family, _) in CONFIGURATIONS.items():
        if family == layout.family:
            return name
    return None


def model_fields(name: str) -> dict:
    """The model node of a ladder shape (conf/model's yaml, or the SHAPES row)."""
    shape = SHAPES[name]
    if isinstance(shape, str):
        fields = OmegaConf.to_container(OmegaConf.load(ROOT / shape))
        fields.pop("defaults", None)
        return fields
    layers, hidden, heads = shape
    return {"name": name, "architecture": "gpt", "layers": layers, "hidden": hidden, "heads": heads,
            "max_sequence_length": SEQUENCE_LENGTH, "planning_only": True}


def hardware_fields(name: str) -> dict:
    fields = OmegaConf.to_container(OmegaConf.load(ROOT / f"conf/hardware/{name}.yaml"))
    fields.pop("defaults", None)
    return fields


def point_config(cfg, model: str, hardware: str, batch_sequences: int):
    """An untyped copy of `cfg` with the model, hardware and batch replaced (what the Evaluator reads)."""
    container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    container["model"] = {**container["model"], "tie_embeddings": False, "mlp_ratio": 4, **model_fields(model)}
    # the profile over the schema's defaults: a field the profile leaves out must not come from the
    # base config's hardware (a cpu base's compute_units_per_node = 2 slowed every GPU 4×)
    container["hardware"] = {**OmegaConf.to_container(OmegaConf.structured(HardwareConfig)), **hardware_fields(hardware)}
    container["data"] = {**container["data"], "corpus": "token_bin", "vocab_size": VOCABULARY,
                         "global_batch_size": batch_sequences, "sequence_length": SEQUENCE_LENGTH}
    return OmegaConf.create(container)


# ----- 3. the fastest step of each configuration at each GPU count

def evaluated(evaluate: Evaluator, layout) -> dict:
    """The Evaluator's row, crediting contiguous 1F1B with what DDP's gradient buckets overlap where
    its workload does not already: the closed form without `reduction_overlaps_backward` exposes a
    1F1B stage's whole all-reduce (one stage per rank), but depth-first accumulation still overlaps
    it with the last micro-batch's backward (docs/strategies/modular_pipeline.md), which at m = 1 is
    the whole backward, as under layered accumulation. Since issue 56 the pipeline families reduce in
    buckets under the backward themselves (strategy.overlap_reduction, on by default), which the
    workload prices: no credit then."""
    row = evaluate(layout)
    if layout.family != "one_f_one_b" or layout.data_degree == 1 \
            or evaluate.workload(layout).reduction_overlaps_backward:
        return {**row, "overlap_credit_s": 0.0}
    stages = evaluate.cfg.model.layers // layout.layers_per_stage
    backward = stage_seconds(evaluate.workload(layout), evaluate.device, 0, stages)[1]
    credit = min(row["exposed_data_s"], backward)
    step = row["step_time_s"] - credit
    return {**row, "step_time_s": step, "tokens_per_s": row["tokens_per_s"] * row["step_time_s"] / step,
            "mfu": row["mfu"] * row["step_time_s"] / step, "overlap_credit_s": credit}


def efficient(point, row: dict) -> bool:
    """Whether a layout uses at least UTILISATION_FLOOR of the compute rate plan mode assumes: MFU /
    the device's efficiency (bubble, exposed communication and recomputation are what it loses)."""
    return row["mfu"] >= UTILISATION_FLOOR * efficiency_of(point)


def fastest_per_configuration(point, gpus: int, configurations) -> dict:
    """configuration → (fastest efficient row that fits, fastest efficient row ignoring memory)
    among `configurations` at this GPU count. A schedule priced by simulating its plan (ZBV) is
    visited by its step's lower bound, lowest first, and not simulated where that bound cannot beat
    the rows kept (at 175B one GPU count has 140 ZBV layouts of up to thousands of micro-batches)."""
    evaluate, best = Evaluator(point, gpus), {}
    chosen = [(layout, name) for layout in layouts(point, gpus)
              if (name := configuration_of(layout, point.model.layers)) in configurations]
    bounds = {layout: evaluate.step_lower_bound(layout) if layout.schedule in SIMULATED else 0.0 for layout, _ in chosen}
    for layout, name in sorted(chosen, key=lambda pair: bounds[pair[0]]):
        if not worth_evaluating(point, evaluate, layout, bounds[layout], *best.get(name, (None, None))):
            continue
        row = evaluated(evaluate, layout)
        if not efficient(point, row):
            continue
        fitting, unconstrained = best.get(name, (None, None))
        if row["fits"] and (fitting is None or row["step_time_s"] < fitting["step_time_s"]):
            fitting = row
        if unconstrained is None or row["step_time_s"] < unconstrained["step_time_s"]:
            unconstrained = row
        best[name] = (fitting, unconstrained)
    return best


def worth_evaluating(point, evaluate: Evaluator, layout, bound: float, fitting, unconstrained) -> bool:
    """Whether a layout whose step is at least `bound` can replace a kept row: not if even that step
    misses the utilisation floor, nor if it is no faster than the fastest that fits; nor, if it does
    not fit, than the fastest ignoring memory."""
    if bound and not efficient(point, {"mfu": evaluate.mfu(bound)}):
        return False
    if fitting is not None and bound >= fitting["step_time_s"]:
        return False
    if unconstrained is not None and bound >= unconstrained["step_time_s"]:
        return evaluate.largest_role(layout)[1] <= evaluate.device.memory_bytes
    return True


def fewest_gpus(point) -> int:
    """No layout fits on fewer GPUs than hold the fp32 weights, gradients and two Adam moments
    (16 bytes per parameter) sharded over all of them (ZeRO-3 over the whole world)."""
    parameters = non_embedding_parameters(point.model.layers, point.model.hidden)
    return math.ceil(16 * parameters / point.hardware.device_memory_bytes)


def scan(point) -> dict:
    """GPU counts from MAXIMUM_GPUS down by halves: each configuration's fastest efficient layout that
    fits, and the fastest efficient one ignoring memory. Past the largest count the batch allows
    efficiently, fewer GPUs only take longer: a configuration stops PATIENCE halvings after its
    fastest. (Going down is also cheap first: many data ranks leave few micro-batch choices.)
    Returns configuration → {"fitting", "unconstrained", "curve": [(gpus, step or nan)]}."""
    found = {name: {"fitting": None, "unconstrained": None, "curve": [], "stale": 0} for name in CONFIGURATIONS}
    gpus = MAXIMUM_GPUS
    while gpus >= max(point.hardware.devices_per_node, fewest_gpus(point)):
        active = [name for name, entry in found.items() if entry["stale"] < PATIENCE]
        if not active:
            break
        best = fastest_per_configuration(point, gpus, active)
        for name in active:
            entry, (fitting, unconstrained) = found[name], best.get(name, (None, None))
            entry["curve"].append((gpus, fitting["step_time_s"] if fitting else math.nan))
            if unconstrained and (entry["unconstrained"] is None
                                  or unconstrained["step_time_s"] < entry["unconstrained"]["step_time_s"]):
                entry["unconstrained"] = {**unconstrained, "gpus": gpus}
            if fitting and (entry["fitting"] is None or fitting["step_time_s"] < entry["fitting"]["step_time_s"]):
                entry["fitting"], entry["stale"] = {**fitting, "gpus": gpus}, 0
            elif entry["fitting"] is not None:
                entry["stale"] += 1
        gpus //= 2
    return found


# ----- 4. what the fastest layout needs: memory, network

def memory_breakdown(point, row: dict) -> dict:
    """The largest pipeline rank's bytes by kind (ranks 0, 1, p − 1 bound every role, as in the search)."""
    evaluate, layout = Evaluator(point, row["gpus"]), point_of(row)
    workload, p = evaluate.workload(layout), layout.pipeline_degree
    stages = point.model.layers // layout.layers_per_stage
    breadth_first = layout.breadth_first_micro_batches or layout.micro_batches
    return max((role_bytes(workload, layout, rank, stages, breadth_first, point.plan.flash_attention)
                for rank in {0, min(1, p - 1), p - 1}), key=lambda breakdown: sum(breakdown.values()))


def bandwidth_needed(point, row: dict) -> float:
    """Bytes per second per GPU the data-parallel traffic of pipeline rank 0 needs to hide behind the
    compute it can overlap (docs/strategies/modular_pipeline.md, "Network"): layered accumulation reduces each stage once,
    during the backward of all micro-batches (with ZeRO: 2 gathers + 1 reduce-scatter during the
    forward and backward of all micro-batches); depth-first accumulation only has the last
    micro-batch's backward (with ZeRO: the 3 collectives again for every micro-batch)."""
    layout = point_of(row)
    if layout.data_degree == 1:
        return 0.0
    evaluate = Evaluator(point, row["gpus"])
    workload, device = evaluate.workload(layout), evaluate.device
    stages, p, m = point.model.layers // layout.layers_per_stage, layout.pipeline_degree, layout.micro_batches
    held = range(0, stages, p)  # rank 0's stages (looping r, r + p, …; contiguous: stage 0)
    grid = None if layout.tensor_parallel == "none" else layout.tensor_parallel
    parameters = sum(local_parameters(grid, layout.tensor_grid, workload.shape, stage == 0, layout.layers_per_stage,
                                      stage == stages - 1)["all"] for stage in held)
    forward = sum(stage_seconds(workload, device, stage, stages)[0] for stage in held)
    backward = sum(stage_seconds(workload, device, stage, stages)[1] for stage in held)
    zero, layered = FAMILIES[layout.family][1], layout.family in ("modular_pipeline", "zero_layered")
    if zero:
        volume = 3 * all_gather(parameters, layout.data_degree) * (1 if layered else m)
        return volume / (m * (forward + backward))
    return all_reduce(parameters, layout.data_degree) / (m * backward if layered else backward)


def pipeline_transfer_share(point, row: dict) -> float:
    """Share of the step a rank spends receiving activations and their gradients: 2 receives per
    local stage and micro-batch (v·m each way, docs/strategies/modular_pipeline.md), of the activation piece."""
    layout = point_of(row)
    if layout.pipeline_degree == 1:
        return 0.0
    evaluate = Evaluator(point, row["gpus"])
    loops = point.model.layers // (layout.layers_per_stage * layout.pipeline_degree)
    receives = 2 * loops * layout.micro_batches
    return receives * receive_seconds(evaluate.workload(layout), evaluate.device) / row["step_time_s"]


def network_free_step(point, row: dict) -> float:
    """The same layout's step with infinitely fast links: the compute-bound step."""
    evaluate = Evaluator(point, row["gpus"])
    evaluate.device = replace(evaluate.device, intra_node_bandwidth=math.inf, inter_node_bandwidth=math.inf)
    return evaluated(evaluate, point_of(row))["step_time_s"]


def missing_row(point, budget: dict, configuration: str, entry: dict) -> dict:
    """Why a configuration has no shortest time for this model and hardware."""
    reason = (f"no layout reaches {UTILISATION_FLOOR:.0%} utilisation at any GPU count"
              if entry["unconstrained"] is None else "layouts reach the utilisation floor but none fits the device")
    free = entry["unconstrained"]
    return {"model": point.model.name, "hardware": point.hardware.name, "configuration": configuration,
            "reason": reason,
            "unconstrained_days": budget["steps"] * free["step_time_s"] / 86400 if free else math.nan,
            "unconstrained_layout": point_of(free).describe() if free else ""}


def summary_row(point, budget: dict, configuration: str, entry: dict) -> dict:
    """One row of the results table: the shortest training time of one configuration and what it needs."""
    row, layout = entry["fitting"], point_of(entry["fitting"])
    breakdown = memory_breakdown(point, row)
    evaluate = Evaluator(point, row["gpus"])
    state = breakdown["parameters"] + breakdown["gradients"] + breakdown["optimizer"]
    memory = point.hardware.device_memory_bytes
    return {"model": point.model.name,
            "parameters": non_embedding_parameters(point.model.layers, point.model.hidden),
            "hardware": point.hardware.name, "configuration": configuration,
            "batch_sequences": budget["batch_sequences"], "steps": budget["steps"], "gpus": row["gpus"],
            "at_gpu_cap": row["gpus"] == MAXIMUM_GPUS,  # more GPUs might still shorten it
            "layout": layout.describe(),
            "loops": point.model.layers // (layout.layers_per_stage * layout.pipeline_degree),
            "step_time_s": row["step_time_s"], "days": budget["steps"] * row["step_time_s"] / 86400,
            "overlap_credit_s": row["overlap_credit_s"],
            "mfu": row["mfu"], "bubble_fraction": row["bubble_fraction"],
            "network_overhead": 1 - network_free_step(point, row) / row["step_time_s"],
            "pipeline_transfer_share": pipeline_transfer_share(point, row),
            "bandwidth_needed_gb_s": bandwidth_needed(point, row) / 1e9,
            # a device's own link (one member per node): what the needed bandwidth is set against
            "bandwidth_achieved_gb_s": link_bandwidth(evaluate.device, row["gpus"], stride=row["gpus"]) / 1e9,
            "memory_gib": row["worst_role_bytes"] / GIB, "memory_fraction": row["worst_role_bytes"] / memory,
            "state_fraction": state / memory,
            "unconstrained_days": budget["steps"] * entry["unconstrained"]["step_time_s"] / 86400,
            "unconstrained_step_ratio": row["step_time_s"] / entry["unconstrained"]["step_time_s"]}


# ----- 5. at the paper's scale

def at_paper_scale(cfg, directory: Path) -> Finding:
    """Every model × hardware: scan the GPU counts, keep each configuration's shortest training time."""
    started, rows, curves, budgets, missing = time.perf_counter(), [], [], [], []
    for model in SHAPES:
        fields = model_fields(model)
        budget = training_budget(non_embedding_parameters(fields["layers"], fields["hidden"]))
        budgets.append({"model": model, **budget})
        for hardware in HARDWARE:
            point = point_config(cfg, model, hardware, budget["batch_sequences"])
            found = scan(point)
            for name, entry in found.items():
                curves += [{"model": model, "hardware": hardware, "configuration": name, "gpus": gpus,
                            "days": budget["steps"] * step / 86400} for gpus, step in entry["curve"]]
                if entry["fitting"] is not None:
                    rows.append(summary_row(point, budget, name, entry))
                else:
                    missing.append(missing_row(point, budget, name, entry))
            print(f"[training_time] {model} on {hardware}: batch {budget['batch_sequences']} × {SEQUENCE_LENGTH}, "
                  f"{budget['steps']:,.0f} steps; shortest days "
                  + ", ".join(f"{row['configuration']} {row['days']:.3g} ({row['gpus']} GPUs)"
                              for row in rows if row["model"] == model and row["hardware"] == hardware)
                  + f" [{time.perf_counter() - started:.0f} s]", flush=True)
    figures = [plot_training_time(rows, directory), plot_bandwidth(rows, directory)]
    return Finding(verdicts=paper_verdicts(rows, missing, curves),
                   tables={"budget": budgets, "shortest_training_time": rows, "ratios": ratio_rows(rows),
                           "no_shortest_time": missing, "scan": curves}, figures=figures)


def shortest(rows: list, model: str, hardware: str, configurations) -> dict:
    """The row of the fastest of `configurations` for this model and hardware (None if none fits)."""
    candidates = [row for row in rows if row["model"] == model and row["hardware"] == hardware
                  and row["configuration"] in configurations]
    return min(candidates, key=lambda row: row["days"]) if candidates else None


def ratio_rows(rows: list) -> list:
    """Per model and hardware: layered / depth-first shortest times (the best of plain and ZeRO each,
    and each pair), and the best layered one against interleaved 1F1B (the reference)."""
    table = []
    for model in SHAPES:
        for hardware in HARDWARE:
            baseline, improved = shortest(rows, model, hardware, BASELINES), shortest(rows, model, hardware, IMPROVED)
            pairs = {f"{a}/{b}": _ratio(shortest(rows, model, hardware, (a,)), shortest(rows, model, hardware, (b,)))
                     for a, b in (("layered", "depth_first"), ("layered_zero", "depth_first_zero"))}
            table.append({"model": model, "hardware": hardware, "improved/baseline": _ratio(improved, baseline),
                          **pairs, "improved/interleaved": _ratio(improved, shortest(rows, model, hardware,
                                                                                     ("interleaved",))),
                          "zero_bubble/improved": _ratio(shortest(rows, model, hardware, ZERO_BUBBLE), improved),
                          "baseline": baseline["configuration"] if baseline else "",
                          "improved": improved["configuration"] if improved else ""})
    return table


def _ratio(numerator, denominator) -> float:
    return numerator["days"] / denominator["days"] if numerator and denominator else math.nan


def _span(values: list) -> str:
    values = [value for value in values if not math.isnan(value)]
    return f"{min(values):.2f}–{max(values):.2f} (median {sorted(values)[len(values) // 2]:.2f})" if values else "n/a"


def paper_verdicts(rows: list, missing: list, curves: list = ()) -> list:
    return [halving_verdict(rows), infiniband_verdict(rows), zero_memory_verdict(rows),
            memory_wall_verdict(rows, missing), zero_bubble_verdict(rows, curves)]


def equal_gpus_ratio(rows: list, curves: list, model: str, hardware: str) -> float:
    """Best zero-bubble step / best layered + modular step at the GPU count of the latter's shortest
    time (the `scan` curves: fitting, efficient layouts only): the schedules compared on the same
    GPUs, without the utilisation floor's cliff between two GPU counts."""
    improved = shortest(rows, model, hardware, IMPROVED)
    if improved is None:
        return math.nan
    there = [curve["days"] for curve in curves if (curve["model"], curve["hardware"], curve["gpus"])
             == (model, hardware, improved["gpus"]) and curve["configuration"] in ZERO_BUBBLE]
    there = [days for days in there if not math.isnan(days)]
    return min(there) / improved["days"] if there else math.nan


def zero_bubble_verdict(rows: list, curves: list = ()) -> Verdict:
    """Issue 32: whether a split-backward schedule (ZB-H1, ZBV) beats layered + modular's shortest time
    at the paper's scale (InfiniBand), which would change the paper's conclusion; and the two at the
    same GPU count, which tells a faster step from one that stays above the utilisation floor on
    twice the GPUs."""
    points = [(row["model"], row["hardware"], row["zero_bubble/improved"]) for row in ratio_rows(rows)
              if row["hardware"] != "a100_ethernet"]
    finite = [value for _, _, value in points if not math.isnan(value)]
    faster = [f"{model} on {hardware} ({value:.2f})" for model, hardware, value in points if value < 1]
    none_fit = [f"{model} on {hardware}" for model, hardware, value in points if math.isnan(value)]
    equal = [equal_gpus_ratio(rows, curves, model, hardware) for model, hardware, _ in points]
    verdict = "reproduced" if not faster else "partly" if len(faster) < len(finite) / 2 else "refuted"
    return Verdict("zero-bubble pipelines do not change it: layered + modular stays the fastest",
                   f"shortest time, best of ZB-H1/ZBV / best of layered+modular (plain, ZeRO), InfiniBand: "
                   f"{_span(finite)}; zero-bubble faster at {', '.join(faster) or 'no point'}; at the GPU count "
                   f"of layered+modular's shortest time, best zero-bubble step / its step: {_span(equal)}; no "
                   f"zero-bubble layout fits at {', '.join(none_fit) or 'no point'}", "", verdict,
                   "a split backward keeps each micro-batch's graph from I to W, so it runs without "
                   "recomputation (strategies/modular_pipeline.py check): where activations outgrow the device "
                   "no zero-bubble layout fits; where one fits, its smaller bubble shortens the step on the same "
                   "GPUs and can keep MFU above the utilisation floor on twice as many, which halves the time")


def halving_verdict(rows: list) -> Verdict:
    """Layered + modular against contiguous depth-first, each the better of plain and ZeRO, on InfiniBand."""
    ratios = [row["improved/baseline"] for row in ratio_rows(rows) if row["hardware"] != "a100_ethernet"]
    finite = sorted(value for value in ratios if not math.isnan(value))
    median = finite[len(finite) // 2] if finite else math.nan
    verdict = "reproduced" if median <= 0.6 else "partly" if median <= 0.85 else "refuted"
    return Verdict("layered gradient accumulation + modular pipeline cut the shortest training time by half",
                   f"shortest time, layered+modular / contiguous depth-first (best of plain and ZeRO each), "
                   f"{len(finite)} model × hardware points (1.2B–1T, A100 and H100 InfiniBand): {_span(finite)}",
                   "", verdict,
                   f"plan mode's closed forms at the critical batch (Kaplan et al. 2020); the GPU count the batch "
                   f"allows = the most GPUs a layout keeps ≥ {UTILISATION_FLOOR:.0%} busy; plan.efficiency of peak "
                   f"assumed (× hardware.relative_matmul_efficiency on the H100), not calibrated")


def infiniband_verdict(rows: list) -> Verdict:
    """The best improved configuration on 1.56 GB/s Ethernet per GPU against 25 GB/s InfiniBand."""
    improved = [_ratio(shortest(rows, m, "a100_ethernet", IMPROVED), shortest(rows, m, "dgx_a100_80g", IMPROVED))
                for m in SHAPES]
    baseline = [_ratio(shortest(rows, m, "a100_ethernet", BASELINES), shortest(rows, m, "dgx_a100_80g", BASELINES))
                for m in SHAPES]
    against_baseline = [_ratio(shortest(rows, m, "a100_ethernet", IMPROVED),
                               shortest(rows, m, "dgx_a100_80g", BASELINES)) for m in SHAPES]
    worst = max((value for value in against_baseline if not math.isnan(value)), default=math.nan)
    verdict = "reproduced" if worst <= 1.0 else "partly" if worst <= 1.5 else "refuted"
    return Verdict("fast InfiniBand is not necessary (layered accumulation lowers the network requirement)",
                   f"shortest time on A100 Ethernet (1.56 GB/s per GPU) / on InfiniBand (25 GB/s): layered+modular "
                   f"{_span(improved)}, contiguous depth-first {_span(baseline)}; layered+modular on Ethernet / "
                   f"depth-first on InfiniBand {_span(against_baseline)}", "", verdict,
                   "reproduced when the new methods on Ethernet are at least as fast as the old ones on "
                   "InfiniBand for every model; Ethernet caps the data-parallel degree whose traffic still hides "
                   "(bandwidth figure)")


def zero_memory_verdict(rows: list) -> Verdict:
    """Parameters + gradients + optimizer state per GPU of the ZeRO-layered fastest layouts."""
    zero = [row for row in rows if row["configuration"] == "layered_zero"]
    infiniband = [row["state_fraction"] for row in zero if row["hardware"] != "a100_ethernet"]
    ethernet = [row["state_fraction"] for row in zero if row["hardware"] == "a100_ethernet"]
    totals = [row["memory_fraction"] for row in zero]
    worst = max(zero, key=lambda row: row["state_fraction"], default=None)
    verdict = ("not tested" if worst is None else "reproduced" if worst["state_fraction"] <= 0.05
               else "partly" if worst["state_fraction"] <= 0.2 else "refuted")
    return Verdict("with ZeRO + layered accumulation the training state is a tiny fraction of the GPU memory",
                   f"weights + gradients + Adam state per GPU at the fastest ZeRO-layered layouts, share of 80 GB: "
                   f"InfiniBand {_span(infiniband)}, Ethernet {_span(ethernet)}; all memory incl. activations "
                   f"and buffers {_span(totals)}", "", verdict,
                   "the state is sharded over the data-parallel group (÷ n) but one stage's whole gradient is kept "
                   "while it is reduced: tiny (≤ 5%) except for the largest stages"
                   + (f" ({worst['model']} on {worst['hardware']}, {worst['layout']}: {worst['state_fraction']:.1%})"
                      if worst else ""))


def memory_wall_verdict(rows: list, missing: list) -> Verdict:
    """Whether memory stops or slows training: per model and hardware, is there a layout that fits
    at all, and the shortest time of the four configurations among layouts that fit over the
    shortest ignoring memory."""
    configurations = BASELINES + IMPROVED
    ratios, walls = {"infiniband": [], "ethernet": []}, []
    for model in SHAPES:
        for hardware in HARDWARE:
            point = [row for row in rows + missing if (row["model"], row["hardware"]) == (model, hardware)
                     and row["configuration"] in configurations]
            fitting = [row["days"] for row in point if "days" in row]
            free = [row["unconstrained_days"] for row in point if not math.isnan(row["unconstrained_days"])]
            network = "ethernet" if hardware == "a100_ethernet" else "infiniband"
            if fitting and free:
                ratios[network].append(min(fitting) / min(free))
            elif free:
                walls.append(f"{model} on {hardware}")
    largest = shortest(rows, list(SHAPES)[-1], "dgx_a100_80g", configurations) or {}
    worst = max(ratios["infiniband"], default=math.nan)
    stopped = [wall for wall in walls if "ethernet" not in wall]
    verdict = "reproduced" if not stopped and worst <= 1.05 else "partly" if not stopped else "refuted"
    return Verdict("no memory wall: memory does not stop training up to 1T parameters",
                   f"every model has a fitting layout at ≥ {UTILISATION_FLOOR:.0%} utilisation on InfiniBand"
                   + (f" except {', '.join(stopped)}" if stopped else "")
                   + (f" (1T on A100: {largest['layout']}, {largest['memory_gib']:.0f} GiB of 80); " if largest
                      else " (1T on A100: no layout fits); ")
                   + f"shortest time fitting / ignoring memory (best of the four configurations): InfiniBand "
                   f"{_span(ratios['infiniband'])}, Ethernet {_span(ratios['ethernet'])}; no fitting efficient "
                   f"layout at all: {', '.join(walls) or 'none'}", "", verdict,
                   "the state shards away (ZeRO), but layered accumulation keeps every micro-batch's checkpoints: "
                   "where they do not fit, a slower layout is left"
                   + (" (on InfiniBand memory slows training, it does not stop it)" if not stopped else ""))


# ----- 6. figures

def plot_panels(rows: list, value: str, ylabel: str, title: str, path: Path, reference=None) -> str:
    """One log-log panel per hardware, `value` against parameters, one line per configuration;
    `reference(rows of a hardware)` draws a dashed level (or None)."""
    from matplotlib.figure import Figure
    figure = Figure(figsize=(13, 4.2), layout="constrained")
    for column, hardware in enumerate(HARDWARE):
        axes = figure.add_subplot(1, len(HARDWARE), column + 1)
        here = [row for row in rows if row["hardware"] == hardware]
        for colour, (name, (_, label)) in enumerate(CONFIGURATIONS.items()):
            points = sorted((row["parameters"], row[value]) for row in here
                            if row["configuration"] == name and row[value] > 0)
            if points:
                axes.plot(*zip(*points), marker="o", color=f"C{colour}", label=label,
                          linestyle=":" if name == "interleaved" else "-")
        if reference is not None and here:
            axes.axhline(reference(here), color="black", linestyle="--", label="achieved (profile, between nodes)")
        axes.set(xscale="log", yscale="log", xlabel="non-embedding parameters", title=hardware)
        axes.grid(True, which="both", alpha=0.3)
        if column == 0:
            axes.set_ylabel(ylabel)
            axes.legend(fontsize=7)
    figure.suptitle(title, fontsize=10)
    figure.savefig(path, dpi=110)
    return path.name


def plot_training_time(rows: list, directory: Path) -> str:
    """Shortest training time (days) vs parameters, one panel per hardware, one line per configuration."""
    return plot_panels(rows, "days", "shortest training time (days)",
                       "Shortest training time at the critical batch (plan mode, plan.efficiency assumed)",
                       directory / "training_time.png")


def plot_bandwidth(rows: list, directory: Path) -> str:
    """Network bandwidth per GPU each configuration's fastest layout needs to hide its data-parallel
    traffic, against the profile's (dashed)."""
    return plot_panels(rows, "bandwidth_needed_gb_s", "data-parallel bandwidth needed per GPU (GB/s)",
                       "Network bandwidth needed (at each configuration's fastest layout) vs achieved",
                       directory / "bandwidth.png",
                       reference=lambda here: min(row["bandwidth_achieved_gb_s"] for row in here))
