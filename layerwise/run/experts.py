"""Mixture of experts, seen while training (issue 58 item 7): each step's expert loads, auxiliary loss
and dropped tokens in metrics.csv and the loggers, every MoE block's loads in expert_load.csv, and
the chart of expert load over the run (expert_load.png).

What a step's MoE module recorded (models/moe.py: `load` [E] slots per global expert before drops,
`dropped`, and aux·loss_scale summed over the step's micro-batches) is gathered in ONE all-reduce
(sum) over every rank, each rank filling the blocks it holds; a block is held by data × context
ranks that saw different tokens and by `replicas` = world / (data · context · pipeline) ranks that
saw the same ones (tensor parallelism), so the sums are divided by `replicas`. Definitions:

- `expert_tokens_max`, `expert_tokens_mean`: over every MoE block ℓ and expert i, the step's slots
  (token, choice pairs; k per token) routed to i in ℓ, summed over micro-batches and ranks: the
  largest, and the mean (= k · tokens of the step / E); `expert_load_ratio` = max / mean (1: balanced).
- `aux_loss`: the balance loss of models/moe.py without α, mean over the MoE blocks (1.0 when the
  router spreads evenly and its probabilities are flat), each block's the mean over the step's
  sequences.
- `dropped_tokens`: slots beyond an expert's capacity (model.capacity_factor), all blocks; 0 when
  dropless.
"""

import csv
from pathlib import Path

import torch
import torch.distributed as dist

from models import blocks_of
from models.moe import MoE

COLUMNS = ["expert_tokens_max", "expert_tokens_mean", "expert_load_ratio", "aux_loss", "dropped_tokens"]
LOAD_FILE, CHART_FILE = "expert_load.csv", "expert_load.png"


def has_experts(cfg) -> bool:
    return bool(cfg.model.get("experts"))


class ExpertLoads:
    """The step's MoE numbers over all ranks (module docstring), and expert_load.csv on rank 0."""

    def __init__(self, cfg, world_size: int, layout: dict, run_directory: Path):
        self.moe_blocks = [index for index, block in enumerate(blocks_of(cfg.model)) if block.experts]
        self.experts = int(cfg.model.experts)
        spread = layout.get("data", 1) * layout.get("context", 1) * layout.get("pipeline", 1)
        self.replicas = max(1, world_size // spread)
        self.data_ranks = layout.get("data", 1) * layout.get("context", 1)
        self.path = Path(run_directory) / LOAD_FILE

    def gather(self, model, device) -> tuple:
        """(this step's row values, loads per MoE block [list of E floats]); every rank calls it."""
        width = self.experts
        vector = torch.zeros(len(self.moe_blocks) * width + 2, dtype=torch.float64, device=device)
        for slot, index in enumerate(self.moe_blocks):
            block = model.blocks[str(index)] if str(index) in model.blocks else None
            moe = getattr(block, "mlp", None) if block is not None else None
            if not isinstance(moe, MoE) or moe.load is None:
                continue  # another pipeline stage holds it (or no training forward ran)
            vector[slot * width:(slot + 1) * width] += moe.load.to(device, torch.float64)
            vector[-2] += moe.dropped.to(device, torch.float64)
            vector[-1] += moe.aux.to(device, torch.float64)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(vector)  # evidence, not training traffic: not counted
        values = (vector / self.replicas).tolist()
        loads = [values[slot * width:(slot + 1) * width] for slot in range(len(self.moe_blocks))]
        flat = [load for block in loads for load in block]
        mean = sum(flat) / len(flat) if flat else 0.0
        row = {"expert_tokens_max": max(flat, default=0.0), "expert_tokens_mean": mean,
               "expert_load_ratio": max(flat, default=0.0) / mean if mean else None,
               "aux_loss": values[-1] / self.data_ranks / max(1, len(self.moe_blocks)),
               "dropped_tokens": values[-2]}
        return row, loads

    def append(self, step: int, loads: list) -> None:
        """Rank 0: one row per MoE block (step, block, e0..e{E-1}) in expert_load.csv."""
        new = not self.path.exists()
        with self.path.open("a", newline="") as handle:
            writer = csv.writer(handle)
            if new:
                writer.writerow(["step", "block"] + [f"e{i}" for i in range(self.experts)])
            writer.writerows([step, index] + [round(load, 3) for load in block]
                             for index, block in zip(self.moe_blocks, loads))


def read_loads(path: Path) -> dict:
    """expert_load.csv as {block: {step: [loads]}}; a step written twice (a resumed run redid it)
    keeps its last row."""
    found = {}
    with Path(path).open() as handle:
        for row in csv.DictReader(handle):
            loads = [float(value) for key, value in row.items() if key.startswith("e")]
            found.setdefault(int(row["block"]), {})[int(row["step"])] = loads
    return found


def shares_of_mean(loads: list) -> list:
    """Each expert's load over the mean load (1 = balanced); all 1.0 for a step without tokens."""
    mean = sum(loads) / len(loads)
    return [load / mean for load in loads] if mean else [1.0] * len(loads)


def write_expert_load_chart(run_directory: Path) -> list:
    """expert_load.png from expert_load.csv: on top, each MoE block's busiest expert over the mean
    per step (1 = balanced); below, one heat map row per (block, expert), its share of the mean
    over the steps. Returns the chart's path (none without the file)."""
    path = Path(run_directory) / LOAD_FILE
    if not path.exists():
        return []
    loads = read_loads(path)
    from matplotlib.figure import Figure
    figure = Figure(figsize=(7.0, 5.2), layout="constrained")
    top, bottom = figure.subplots(2, 1, height_ratios=(1, 2))
    rows, labels = [], []
    for block, by_step in sorted(loads.items()):
        steps = sorted(by_step)
        shares = [shares_of_mean(by_step[s]) for s in steps]
        top.plot(steps, [max(share) for share in shares], linewidth=1, label=f"block {block}")
        for expert in range(len(shares[0])):
            rows.append([share[expert] for share in shares])
            labels.append(f"{block}.{expert}")
    top.axhline(1.0, color="0.4", linewidth=0.8)
    top.set_ylabel("busiest expert / mean")
    top.set_title("expert load over the run (tokens routed per expert, per step)", fontsize=9)
    top.legend(fontsize=6, ncol=4)
    first = sorted(next(iter(loads.values())))
    image = bottom.imshow(rows, aspect="auto", interpolation="nearest", cmap="viridis",
                          extent=(first[0] - 0.5, first[-1] + 0.5, len(rows) - 0.5, -0.5))
    step_of_labels = max(1, len(labels) // 32)
    bottom.set_yticks(range(0, len(labels), step_of_labels), labels[::step_of_labels], fontsize=5)
    bottom.set_ylabel("block.expert")
    bottom.set_xlabel("step")
    figure.colorbar(image, ax=bottom, label="load / mean")
    chart = Path(run_directory) / CHART_FILE
    figure.savefig(chart, dpi=110)
    return [chart]
