"""mode=reproduce: one paper's headline claim, tested at the paper's scale and at ours.

    python train.py experiment=repro_training_time          at the paper's scale, by plan mode (minutes)
    python train.py experiment=repro_training_time_small    at small scale here: trains, checks the prediction

1. `reproduce.claim` names a module of this package (CLAIMS); `reproduce.scale` picks its
   `at_paper_scale(cfg, directory)` or `at_small_scale(cfg, directory)`.
2. Each returns a `Finding`: verdict rows (claim | prediction | measurement | verdict | reason),
   named tables (lists of dicts) and the figures it drew in `directory`.
3. This module writes them to the run directory — results.json, results.md, one CSV per table —
   atomically, and prints the verdict table; docs/results/ pages quote these files.
"""

import csv
import importlib
import io
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

# claim → the paper it comes from (the modules of this package, one per seed paper)
CLAIMS = {
    "training_time": "Lamy-Poirier 2021, Breadth-first pipeline parallelism (shortest training time)",
    "pipefisher": "Osawa et al. 2023, PipeFisher (K-FAC in pipeline bubbles)",
    "l2l": "Pudipeddi et al. 2020, Training large neural networks with constant memory (L2L)",
    "three_d": "Bian et al. 2021, Maximizing parallelism in distributed training (3-D tensor parallelism)",
}
SCALES = ("paper", "small")
CHOICES = {"reproduce.claim": tuple(CLAIMS), "reproduce.scale": SCALES}  # this room's rule: the pre-flight checks them
VERDICTS = ("reproduced", "partly", "refuted", "not tested")


@dataclass(frozen=True)
class Verdict:
    """One row of the README's table: the paper's claim against what we predict and measure."""

    claim: str  # the paper's words, with its number
    prediction: str  # ours at the paper's scale (plan mode), with the number
    measurement: str  # ours at small scale on this machine, with the number ("" when not measured)
    verdict: str  # one of VERDICTS
    reason: str  # why: the mechanism, or what differs from the paper's setting

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r} is not one of {', '.join(VERDICTS)}")


@dataclass
class Finding:
    """What one claim's run found: verdict rows, named tables (lists of dicts) and figure files."""

    verdicts: list = field(default_factory=list)
    tables: dict = field(default_factory=dict)
    figures: list = field(default_factory=list)  # file names inside the run directory


def reproduce(cfg, run_directory) -> Finding:
    """Run the claim's paper-scale or small-scale test and write its results."""
    directory = Path(run_directory)
    module = importlib.import_module(f"layerwise.reproduce.{cfg.reproduce.claim}")
    test = module.at_paper_scale if cfg.reproduce.scale == "paper" else module.at_small_scale
    print(f"[layerwise] reproducing {CLAIMS[cfg.reproduce.claim]} at {cfg.reproduce.scale} scale",
          flush=True)
    finding = test(cfg, directory)
    write(finding, directory, cfg)
    print(verdict_table(finding.verdicts), flush=True)
    print(f"[layerwise] results in {directory}/results.md", flush=True)
    return finding


def verdict_table(verdicts: list) -> str:
    """The verdict rows as a Markdown table (the README's rows are copied from it)."""
    lines = ["| claim | prediction at the paper's scale | measurement here | verdict | reason |",
             "|---|---|---|---|---|"]
    lines += [f"| {v.claim} | {v.prediction} | {v.measurement or '—'} | **{v.verdict}** | {v.reason} |"
              for v in verdicts]
    return "\n".join(lines)


def markdown_table(rows: list) -> str:
    """A list of dicts (one key order) as a Markdown table; floats to 4 significant digits."""
    if not rows:
        return "(no rows)"
    keys = list(rows[0])

    def cell(value):
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(row.get(key, "")) for key in keys) + " |" for row in rows]
    return "\n".join(lines)


def write(finding: Finding, directory: Path, cfg) -> None:
    """results.json, results.md and <table>.csv, each written whole or not at all."""
    claim, scale = cfg.reproduce.claim, cfg.reproduce.scale
    document = {"claim": claim, "paper": CLAIMS[claim], "scale": scale,
                "verdicts": [asdict(v) for v in finding.verdicts], "tables": finding.tables,
                "figures": finding.figures}
    write_atomically(directory / "results.json", json.dumps(document, indent=2, default=str))
    sections = [f"# {CLAIMS[claim]}: {scale} scale", "", verdict_table(finding.verdicts), ""]
    for name, rows in finding.tables.items():
        sections += [f"## {name}", "", markdown_table(rows), ""]
        write_atomically(directory / f"{name}.csv", csv_text(rows))
    sections += [f"![{name}]({name})" for name in finding.figures]
    write_atomically(directory / "results.md", "\n".join(sections) + "\n")


def csv_text(rows: list) -> str:
    buffer = io.StringIO()
    if rows:
        writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return buffer.getvalue()


def write_atomically(path: Path, text: str) -> None:
    """Write beside, then rename: a reader never sees half a file (an interrupted run leaves the old one)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)
