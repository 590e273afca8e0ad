"""Plan mode against published large-scale training throughput (issue 31 item 1).

    python benchmarks/plan_vs_published.py        the table: predicted vs published TFLOP/s per GPU
    python benchmarks/plan_vs_published.py --runs benchmarks/published/vtrain_runs.csv   vTrain's measured runs

Every row of benchmarks/published/megatron_runs.csv (Narayanan et al. 2021 table 1 on A100s, the
Megatron-LM README's H100 weak scaling, Korthikanti et al. 2022 table 4's step times; each row cites
its source) is priced by plan mode's own
closed form (layerwise/planning/search.py `Evaluator` → cost/step_time.py `closed_form_step`, the
formulas the simulator, the search and the reproductions share) at the run's exact layout:
tensor × pipeline (interleaved with v virtual stages where the run used them) × data, its
micro-batch, recomputation and precision. The predicted step is turned into TFLOP/s per GPU the way
the row's source counts FLOPs (`counted_flops`), so the two figures compare directly.
The rows' split into tuned and held-out was fixed in the csv before any model term changed.
"""

import csv
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from omegaconf import OmegaConf

from cost.step_time import closed_form_step
from layerwise.planning.search import Evaluator, Point

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


def point_config(base, run: PublishedRun):
    """An untyped copy of `base` with the run's model, hardware, precision and batch."""
    container = OmegaConf.to_container(base, resolve=True, throw_on_missing=False)
    hardware = OmegaConf.to_container(OmegaConf.load(ROOT / f"conf/hardware/{run.hardware}.yaml"))
    hardware.pop("defaults", None)
    container["model"] = {**container["model"], "name": run.name, "architecture": "gpt", "layers": run.layers,
                          "hidden": run.hidden, "heads": run.heads, "mlp_ratio": 4, "tie_embeddings": False,
                          "max_sequence_length": run.sequence_length, "planning_only": True}
    container["hardware"] = {**container["hardware"], **hardware, "precision": run.precision,
                             "nodes": run.gpus // hardware["devices_per_node"]}
    container["data"] = {**container["data"], "corpus": "token_bin", "vocab_size": run.vocabulary,
                         "global_batch_size": run.global_batch, "sequence_length": run.sequence_length}
    return OmegaConf.create(container)


def point_of(run: PublishedRun) -> Point:
    """The search's point of the run: 1F1B, or interleaved 1F1B with v virtual stages per rank
    (Narayanan et al. 2021 §2.2.2), the 1-D (Megatron) tensor grid, one stage = l / (p·v) layers."""
    family = "interleaved_1f1b" if run.virtual_stages > 1 else "one_f_one_b"
    grid = "1d" if run.tensor_parallel > 1 else "none"
    return Point.of(family, run.pipeline_parallel, grid, run.tensor_parallel,
                    run.layers // (run.pipeline_parallel * run.virtual_stages), run.micro_batches,
                    "full" if run.recompute == "full" else "none", run.data_parallel)


def workload_of(evaluate: Evaluator, run: PublishedRun):
    """The Evaluator's workload of the run's layout, with how Megatron-LM communicates and overlaps
    (cost.inputs.Workload's run fields): 16-bit collectives, messages and gradients (--fp16/--bf16),
    scatter/gather of pipeline messages (default since Narayanan et al. 2021 §4.1), the gradient
    reduction overlapped (torch DDP, or the H100 runs' --overlap-grad-reduce) or after the backward
    (--DDP-impl local), materialised attention scores (2021: no flash kernel); on the H100 runs
    sequence parallelism, --tp-comm-overlap and the distributed optimizer (--overlap-param-gather
    exists only with it: gradients reduce-scattered, parameters gathered beside the next forward);
    selective recomputation where the run used it (K22's sequence-parallel rows)."""
    modern = run.megatron_core
    return replace(evaluate.workload(point_of(run)), wire_bytes=2, scatter_gather=True,
                   reduction_overlaps_backward=run.data_reduction == "overlapped", tensor_overlap=modern,
                   attention_scores=not modern, sequence_parallel=run.sequence_parallel,
                   distributed_optimizer=modern, recompute_attention=run.recompute == "selective")


# Each term of the model switched off (docs/plan.md, "Against published runs": what each one moves).
ABLATIONS = {
    "roofline products and memory-bound operators": lambda w, d: (w, replace(d, memory_bandwidth=0.0)),
    "16-bit wire bytes": lambda w, d: (replace(w, wire_bytes=4), d),
    "scatter/gather messages": lambda w, d: (replace(w, scatter_gather=False), d),
    "reduction overlapped with the backward": lambda w, d: (replace(w, reduction_overlaps_backward=False), d),
    "distributed optimizer (reduce-scatter)": lambda w, d: (replace(w, distributed_optimizer=False), d),
    "tensor collectives overlapped": lambda w, d: (replace(w, tensor_overlap=False), d),
    "attention scores materialised": lambda w, d: (replace(w, attention_scores=False), d),
    "sequence parallelism": lambda w, d: (replace(w, sequence_parallel=False), d),
    "selective recomputation (the core attention rerun)": lambda w, d: (replace(w, recompute_attention=False), d),
    "tensor collectives free": lambda w, d: (w, replace(d, intra_node_bandwidth=float("inf"))),
    "inter-node traffic free (messages, data reduction)": lambda w, d: (w, replace(d, inter_node_bandwidth=float("inf"))),
}


def predict(base, run: PublishedRun, ablate: str = None) -> dict:
    """Plan mode's closed-form step for the run (cost.step_time.closed_form_step, the search's and the
    simulator's formulas), and the TFLOP/s per GPU it implies as the source counts; `ablate` names an
    ABLATIONS term to switch off."""
    evaluate = Evaluator(point_config(base, run), run.gpus)
    layout = point_of(run)
    workload, device = workload_of(evaluate, run), evaluate.device
    if ablate is not None:
        workload, device = ABLATIONS[ablate](workload, device)
    step = closed_form_step(workload, device, layout.schedule, layout.micro_batches,
                            layout.breadth_first_micro_batches)
    predicted = counted_flops(run) / (step["step_seconds"] * run.gpus) / 1e12
    return {"run": run.name, "source": run.source, "split": run.split, "verified": run.verified,
            "step_time_s": step["step_seconds"],
            "bubble_fraction": step["bubble_fraction"], "predicted_tflops_per_gpu": predicted,
            "published_tflops_per_gpu": run.published_throughput,
            "error": predicted / run.published_throughput - 1}


def validation_table(base, runs: list = None, ablate: str = None) -> list:
    """One `predict` row per published run (default: every row of the csv)."""
    return [predict(base, run, ablate) for run in (runs if runs is not None else read_runs())]


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
