"""Plan mode against published large-scale training throughput (issue 31 item 1; issue 56 item 3).

    python benchmarks/plan_vs_published.py        the table: predicted vs published TFLOP/s per GPU
    python benchmarks/plan_vs_published.py --runs benchmarks/published/vtrain_runs.csv   vTrain's measured runs

Every row of benchmarks/published/megatron_runs.csv (Narayanan et al. 2021 table 1 on A100s, the
Megatron-LM README's H100 weak scaling, Korthikanti et al. 2022 table 4's step times; each row cites
its source) is a configuration a user would type (`overrides_of`: `python train.py mode=plan` with
the run's shape, hardware, batch, exact layout and, through our strategies' own switches, what its
software did: recomputation, sequence parallelism, the reduction's overlap, the distributed
optimizer, tensor overlap, materialised attention scores), composed and validated as train.py does
it (`published_config`) and priced by plan mode's workload of that configuration
(layerwise/planning/inputs.py `workload_of`). What Megatron-LM does that no switch of ours does is
named, with why, in MEGATRON_ONLY and priced on top: nothing now (16-bit tensor collectives and
fp16 gradient reductions became strategy.tensor_collective_dtype and strategy.reduction_dtype). The step is the search's closed form (cost/step_time.py
`closed_form_step`, held within 1% of plan mode's simulator), or plan mode's simulated plan itself
with `simulate`. The predicted step is turned into TFLOP/s per GPU the way the row's source counts
FLOPs (`counted_flops`), so the two figures compare directly.
The rows' split into tuned and held-out was fixed in the csv before any model term changed.
"""

import copy
import csv
import functools
import re
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from omegaconf import OmegaConf

from cost.step_time import closed_form_step, predict_step
from layerwise.config.errors import ConfigError
from layerwise.config.validate import (check_choices, check_hardware, check_model, check_ranges, check_schema_keys,
                                       check_strategy, check_vocabulary, world_size)
from layerwise.planning.inputs import device_of, plan_mode_errors, training_plan_of, workload_of

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "benchmarks" / "published" / "megatron_runs.csv"  # data, read as a file (never imported)
VTRAIN_RUNS = ROOT / "benchmarks" / "published" / "vtrain_runs.csv"  # vTrain's measured multi-node runs
TOLERANCE = 0.10  # issue 31: every published row within ±10%


@dataclass(frozen=True)
class PublishedRun:
    """One csv row: the run's shape, layout and its published throughput."""

    source: str
    model: str
    split: str  # tune | holdout
    verified: str  # layout | shape (the micro-batch, interleaving and recomputation assumed)
    hardware: str
    precision: str
    layers: int
    hidden: int
    heads: int
    sequence_length: int
    vocabulary: int
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    gpus: int
    global_batch: int
    micro_batch: int
    virtual_stages: int
    recompute: str  # full | selective (the core attention, Korthikanti et al. 2022 §5) | none
    sequence_parallel: bool
    data_reduction: str  # overlapped (with the backward) | after_backward
    flops: str  # narayanan | megatron: how the source counts a step's FLOPs
    published_tflops_per_gpu: float  # 0 where the source publishes a step time instead
    published_percent_of_peak: float
    published_step_s: float  # 0 where the source publishes throughput instead
    comment: str

    @property
    def micro_batches(self) -> int:
        return self.global_batch // (self.data_parallel * self.micro_batch)

    @property
    def name(self) -> str:
        return f"{self.source} {self.model}"

    @property
    def megatron_core(self) -> bool:
        """The 2024 Megatron-Core runs (M24): flash attention, --tp-comm-overlap, the distributed optimizer."""
        return self.source == "M24"

    @property
    def published_throughput(self) -> float:
        """TFLOP/s per GPU as published, or as counted over the published step time."""
        if self.published_tflops_per_gpu:
            return self.published_tflops_per_gpu
        return counted_flops(self) / (self.published_step_s * self.gpus) / 1e12


def read_runs(path: Path = RUNS) -> list:
    """The csv's rows (lines starting with # are its header comment; an empty number is 0)."""
    with open(path) as handle:
        lines = [line for line in handle if not line.startswith("#")]
    runs = []
    for row in csv.DictReader(lines):
        fields = {}
        for name, kind in PublishedRun.__annotations__.items():
            value = row[name]
            if kind is bool:
                fields[name] = value == "true"
            else:
                fields[name] = kind(value or 0) if kind in (int, float) else value
        runs.append(PublishedRun(**fields))
    return runs


def counted_flops(run: PublishedRun) -> float:
    """A step's FLOPs as the run's source counts them. Narayanan et al. 2021 eq. 3 (with full
    recomputation: forward, recomputed forward, backward = 4 passes of the matrix products):
    96·B·s·l·h²·(1 + s/6h + V/16lh). Megatron-LM's num_floating_point_operations (the README's
    H100 table; no recomputed forward): 72·B·s·l·h²·(1 + s/6h + V/12lh)."""
    b, s, l, h, v = run.global_batch, run.sequence_length, run.layers, run.hidden, run.vocabulary
    if run.flops == "narayanan":
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    if run.flops == "megatron":
        return 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    raise ValueError(f"unknown flops counting {run.flops!r} in {RUNS.name}")


def model_name(run: PublishedRun) -> str:
    """The run as a model name a command line can carry: 'K22_175B_selective' (Hydra's override
    grammar takes letters, digits, '_', '.' and '-' unquoted)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "", f"{run.source}_{run.model}".replace(" ", "_"))


def overrides_of(run: PublishedRun, efficiency: float = None) -> list:
    """What a user types to plan the run: `python train.py mode=plan` + these. The run's shape (no
    conf/model file holds it: gpt3_175b's node with its widths), hardware, precision and batch; its
    layout — 1F1B, or interleaved 1F1B with v virtual stages per rank (Narayanan et al. 2021
    §2.2.2), the 1-D (Megatron) tensor grid, one stage = l / (p·v) layers; and what its software
    did, through our own switches (layerwise/config/schema.py): full or selective recomputation,
    sequence parallelism, the reduction after the backward (`--DDP-impl local`: overlap_reduction
    off) or bucketed under it, the H100 runs' distributed optimizer and `--tp-comm-overlap`
    (tensor_overlap), and attention's materialised scores in 2021-22 (no flash kernel:
    plan.flash_attention=false). Messages in the compute dtype and scatter/gather are our defaults.
    `efficiency`: plan.efficiency (the large-product rate), e.g. the one fitted on the tuned rows."""
    family = "interleaved_1f1b" if run.virtual_stages > 1 else "one_f_one_b"
    hardware = OmegaConf.load(ROOT / f"conf/hardware/{run.hardware}.yaml")
    line = ["mode=plan", "model=gpt3_175b", f"model.name={model_name(run)}", f"model.layers={run.layers}",
            f"model.hidden={run.hidden}", f"model.heads={run.heads}", f"model.max_sequence_length={run.sequence_length}",
            f"hardware={run.hardware}", f"hardware.nodes={run.gpus // hardware.devices_per_node}",
            f"hardware.precision={run.precision}", f"strategy={family}",
            f"strategy.pipeline_degree={run.pipeline_parallel}",
            f"strategy.layers_per_stage={run.layers // (run.pipeline_parallel * run.virtual_stages)}",
            f"strategy.micro_batches={run.micro_batches}"]
    if run.tensor_parallel > 1:  # partial sums in the params dtype, as Megatron's mappings.py `_reduce`
        line += ["strategy.tensor_parallel=1d", f"strategy.tensor_grid={run.tensor_parallel}",
                 "strategy.tensor_collective_dtype=compute"]
    if run.precision.startswith("16"):  # fp16 gradients reduced in fp16 (under --bf16 Megatron forces
        line.append("strategy.reduction_dtype=compute")  # accumulate_allreduce_grads_in_fp32: our fp32 default)
    if run.recompute != "none":
        line.append(f"strategy.activation_recompute={run.recompute}")
    if run.sequence_parallel and run.tensor_parallel > 1:
        line.append("strategy.sequence_parallel=true")
        if run.megatron_core:
            line.append("strategy.tensor_overlap=true")
    if run.data_reduction == "after_backward":
        line.append("strategy.overlap_reduction=false")
    if run.megatron_core:
        line.append("strategy.distributed_optimizer=true")
    else:
        line.append("plan.flash_attention=false")
    line += ["data=token_bin", f"data.vocab_size={run.vocabulary}", f"data.global_batch_size={run.global_batch}",
             f"data.sequence_length={run.sequence_length}"]
    return line + ([f"plan.efficiency={efficiency}"] if efficiency is not None else [])


def command_of(run: PublishedRun, efficiency: float = None) -> str:
    return "python train.py " + " ".join(overrides_of(run, efficiency))


# What Megatron-LM does that our strategies do not, each priced on top of the configuration's own
# workload (layerwise/planning/inputs.py `communication_of`), with why it is not a switch of ours:
# name -> (workload -> workload, reason). Empty: the last two terms, 16-bit tensor collectives and
# fp16 gradient reductions, are our switches strategy.tensor_collective_dtype=compute (the default)
# and strategy.reduction_dtype=compute (each fp16 row's command sets it).
MEGATRON_ONLY = {}


def published_config(run: PublishedRun, efficiency: float = None, checked: bool = False):
    """The run's configuration as train.py composes it (layerwise/config/store.py `compose`) and its
    world size; `checked`: also held to the configuration's and plan mode's rules train.py's
    validation runs in mode=plan (layerwise/preflight.py `validate`, whose other rooms' rules — data
    files, this machine's GPUs — a plan does not need): names, keys, ranges, the model, the hardware
    and the strategy's own checks, which build and check the whole plan (a minute for the deepest
    pipelines here, so the table's tests check the small rows and the generator every row)."""
    cfg = copy.deepcopy(_composed(run))
    if efficiency is not None:  # as the override plan.efficiency=… would set it
        cfg.plan.efficiency = efficiency
    world = world_size(cfg)
    if checked:
        errors = (check_choices(cfg) + check_schema_keys(cfg) + check_ranges(cfg) + check_model(cfg)
                  + check_vocabulary(cfg) + check_hardware(cfg) + check_strategy(cfg, world) + plan_mode_errors(cfg))
        if errors:
            raise ConfigError(errors)
    return cfg, world


@functools.lru_cache(maxsize=None)
def _composed(run: PublishedRun):
    """`overrides_of(run)` composed once (the efficiency fit prices each tuned row a dozen times)."""
    from layerwise.config.store import compose
    return compose(overrides_of(run))


def priced_workload(cfg, world: int, megatron_only=tuple(MEGATRON_ONLY)):
    """Plan mode's workload of the configuration (`layerwise.planning.inputs.workload_of`, what
    `train.py mode=plan` prices), then each named MEGATRON_ONLY term."""
    workload = workload_of(cfg, world)
    for name in megatron_only:
        workload = MEGATRON_ONLY[name][0](workload)
    return workload


# Each term of the model switched off (docs/plan.md, "Against published runs": what each one moves).
ABLATIONS = {
    "roofline products and memory-bound operators": lambda w, d: (w, replace(d, memory_bandwidth=0.0)),
    "16-bit messages (strategy.message_dtype)": lambda w, d: (replace(w, message_bytes=4), d),
    "16-bit tensor collectives (strategy.tensor_collective_dtype)": lambda w, d: (replace(w, tensor_bytes=4), d),
    "16-bit gradient reductions (strategy.reduction_dtype)": lambda w, d: (replace(w, reduction_bytes=4), d),
    "scatter/gather messages": lambda w, d: (replace(w, scatter_gather=False), d),
    "reduction overlapped with the backward": lambda w, d: (replace(w, reduction_overlaps_backward=False), d),
    "distributed optimizer (reduce-scatter)": lambda w, d: (replace(w, distributed_optimizer=False), d),
    "tensor collectives overlapped": lambda w, d: (replace(w, tensor_overlap=False), d),
    "attention scores materialised": lambda w, d: (replace(w, attention_scores=False), d),
    # without it the configuration's scatter/gather (on by default) splits the messages instead
    "sequence parallelism": lambda w, d: (replace(w, sequence_parallel=False,
                                                  scatter_gather=w.scatter_gather or w.sequence_parallel), d),
    "selective recomputation (the core attention rerun)": lambda w, d: (replace(w, recompute_attention=False), d),
    "tensor collectives free": lambda w, d: (w, replace(d, intra_node_bandwidth=float("inf"))),
    "inter-node traffic free (messages, data reduction)": lambda w, d: (w, replace(d, inter_node_bandwidth=float("inf"))),
}


def predict(base, run: PublishedRun, ablate: str = None, simulate: bool = False,
            megatron_only=tuple(MEGATRON_ONLY), checked: bool = False) -> dict:
    """The run's step as `train.py mode=plan` prices its configuration (`overrides_of` at `base`'s
    plan.efficiency): the configuration's workload with the MEGATRON_ONLY terms named in
    `megatron_only`, in the search's closed form (cost.step_time.closed_form_step, held within 1% of
    the simulator by tests/test_plan_search.py) or, with `simulate`, plan mode's own simulated plan
    (layerwise/planning/result.py `plan_result`: minutes for the deepest pipelines); and the TFLOP/s
    per GPU it implies as the source counts. `ablate` names an ABLATIONS term to switch off."""
    cfg, world = published_config(run, base.plan.efficiency, checked or simulate)
    workload, device = priced_workload(cfg, world, megatron_only), device_of(cfg, world)
    if ablate is not None:
        workload, device = ABLATIONS[ablate](workload, device)
    if simulate:
        step = predict_step(workload, device, training_plan_of(cfg))
    else:
        step = closed_form_step(workload, device, cfg.strategy.schedule, cfg.strategy.micro_batches,
                                cfg.strategy.breadth_first_micro_batches)
    predicted = counted_flops(run) / (step["step_seconds"] * run.gpus) / 1e12
    return {"run": run.name, "source": run.source, "split": run.split, "verified": run.verified,
            "command": command_of(run, base.plan.efficiency),
            "step_time_s": step["step_seconds"],
            "bubble_fraction": step["bubble_fraction"], "predicted_tflops_per_gpu": predicted,
            "published_tflops_per_gpu": run.published_throughput,
            "published_step_s": run.published_step_s or counted_flops(run) / (run.published_tflops_per_gpu * 1e12 * run.gpus),
            "error": predicted / run.published_throughput - 1}


def validation_table(base, runs: list = None, ablate: str = None, simulate: bool = False,
                     megatron_only=tuple(MEGATRON_ONLY), checked: bool = False) -> list:
    """One `predict` row per published run (default: every row of the csv)."""
    return [predict(base, run, ablate, simulate, megatron_only, checked)
            for run in (runs if runs is not None else read_runs())]


def summary(rows: list) -> dict:
    """Mean, median and worst |error| and how many within ±10%, over all rows, each split and each
    source (N21, M24, K22, V24)."""
    def stats(selected):
        errors = [abs(row["error"]) for row in selected]
        return {"rows": len(errors), "mean": statistics.fmean(errors) if errors else float("nan"),
                "median": statistics.median(errors) if errors else float("nan"),
                "worst": max(errors, default=float("nan")),
                "within": sum(error <= TOLERANCE for error in errors)}
    sources = dict.fromkeys(row["source"] for row in rows)
    return {"all": stats(rows), "tune": stats([r for r in rows if r["split"] == "tune"]),
            "holdout": stats([r for r in rows if r["split"] == "holdout"]),
            **{source: stats([r for r in rows if r["source"] == source]) for source in sources}}


def fit_efficiency(base, runs: list = None, low: float = 0.3, high: float = 1.0, steps: int = 12) -> float:
    """The one fitted term: the large-product rate (plan.efficiency, the roofline's compute ceiling)
    at which the tuned rows' mean signed error is 0 (bisection: the predicted rate grows with it).
    Only rows with split=tune are used; the held-out rows never see it."""
    tuned = [run for run in (runs if runs is not None else read_runs()) if run.split == "tune"]
    for _ in range(steps):
        middle = (low + high) / 2
        cfg = OmegaConf.merge(base, {"plan": {"efficiency": middle}})
        if statistics.fmean(predict(cfg, run)["error"] for run in tuned) > 0:
            high = middle
        else:
            low = middle
    return round((low + high) / 2, 3)
