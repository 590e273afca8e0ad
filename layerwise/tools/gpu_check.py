"""The GPU check a user runs first: every strategy for a few steps on this node's GPUs, each
compared with `strategy=single` on one GPU of the same node, in one table.

    scripts/gpu_check.sh                                   every strategy, 1/2/4/8 GPUs, 10 steps
    python -m layerwise.gpu_check --strategies ddp,modular_pipeline --ranks 2,4
    python -m layerwise.gpu_check --hardware cpu --ranks 2 --steps 2     the same table on CPU ranks
    python -m layerwise.gpu_check model=gpt_small hardware.precision=bf16-mixed --tolerance 0.05

Each point is `train.py` as a user runs it (its own run directory under --directory); the table's
numbers are read from each run's summary.json: the largest |loss − reference loss| over the steps,
the median step time, and the CUDA allocator's peak (`allocator_peak_bytes`, empty off CUDA).
A point the configuration checks reject (a 3-D grid needs 8 ranks) is listed as skipped, with the
reason. Exit code 0 when every point that ran equals the reference within --tolerance; on a
machine without a CUDA device the check prints "no CUDA device: skipped" and exits 0.
"""

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from layerwise.config.errors import ConfigError
from layerwise.config.store import compose

ROOT = Path(__file__).resolve().parents[2]
RANK_COUNTS = (1, 2, 4, 8)
CPU_RANKS = 2  # --hardware cpu: 1 and 2 processes unless --ranks says otherwise
# Small enough for one GPU, divisible the ways every strategy splits it (8 data-parallel ranks ×
# 4 micro-batches, heads over 8 tensor-parallel ranks).
BASE_OVERRIDES = ("model=gpt_tiny", "model.heads=8", "data.global_batch_size=32", "data.max_bytes=4000000",
                  "trainer.limit_val_batches=1", "trainer.checkpoint_every_n_steps=1000",
                  "logger=none", "trainer.progress=none", "hardware.nodes=1",
                  "hardware.precision=32-true")  # fp32: the differences are round-off only
SKIPPED_MESSAGE = "gpu_check: no CUDA device: skipped"
# What each strategy must equal: `single`, except PipeFisher, whose K-FAC steps equal one-process
# K-FAC (kfac), not first-order training. References run once, on one rank.
REFERENCE_OF = {"pipefisher": "kfac"}


@dataclass
class Row:
    """One line of the table: a strategy on some ranks, compared with the reference."""

    strategy: str
    ranks: int
    status: str  # completed | failed | skipped
    reference: str = "single"
    max_loss_difference: Optional[float] = None
    step_time_s: Optional[float] = None
    allocator_peak_bytes: Optional[float] = None
    reason: str = ""


def main(argv=None, preflight=None) -> int:
    """Run the check from the command line; return the exit code. `preflight`: the configuration
    checks (layerwise.preflight.validate, which `python -m layerwise.gpu_check` passes)."""
    arguments = parse_arguments(argv)
    from layerwise.run.launch import local_gpu_count

    accelerator = hardware_accelerator(arguments.hardware, arguments.overrides)
    available = local_gpu_count() if accelerator == "gpu" else CPU_RANKS
    if available == 0:
        print(SKIPPED_MESSAGE, flush=True)
        return 0
    counts = arguments.ranks or [count for count in RANK_COUNTS if count <= available]
    if accelerator == "gpu" and max(counts) > available:
        print(f"gpu_check: --ranks asks for {max(counts)} GPUs but this node has {available}. Fix: "
              f"--ranks {','.join(str(c) for c in RANK_COUNTS if c <= available)}", file=sys.stderr)
        return 2
    directory = Path(arguments.directory or ROOT / "runs" / "gpu_check" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    rows = check(arguments.strategies, counts, arguments.steps, arguments.hardware, directory,
                 arguments.overrides, preflight=preflight)
    print(format_table(rows, arguments.tolerance), flush=True)
    print(f"gpu_check: run directories in {directory}", flush=True)
    return 0 if all(passed(row, arguments.tolerance) for row in rows) else 1


def parse_arguments(argv):
    from strategies import REGISTRY

    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--hardware", default="dgx_a100_80g",
                        help="hardware profile (conf/hardware/); devices_per_node is set per point")
    parser.add_argument("--strategies", type=names_list, default=[name for name in REGISTRY
                                                                  if name != "single"],
                        help="comma-separated strategy names")
    parser.add_argument("--ranks", type=counts_list, default=None,
                        help="comma-separated rank counts (None: 1,2,4,8 up to the GPUs found)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    parser.add_argument("--tolerance", type=float, default=1e-3,
                        help="largest |loss difference| (nats) that passes; raise it for bf16")
    parser.add_argument("--directory", default=None, help="where the run directories go")
    parser.add_argument("overrides", nargs="*", help="train.py overrides added to every run")
    arguments = parser.parse_intermixed_args(argv)  # overrides may come before or after options
    unknown = [name for name in arguments.strategies if name not in REGISTRY]
    if unknown:
        parser.error(f"--strategies: unknown {', '.join(unknown)}; known: {', '.join(REGISTRY)}")
    if arguments.steps < 1:
        parser.error(f"--steps={arguments.steps}: give at least 1")
    return arguments


def names_list(text: str) -> list:
    return [name.strip() for name in text.split(",") if name.strip()]


def counts_list(text: str) -> list:
    try:
        counts = [int(count) for count in names_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers")
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: rank counts are positive integers, e.g. 1,2,4")
    return counts


def point_overrides(strategy: str, ranks: int, steps: int, hardware: str, extra) -> list:
    """train.py overrides of one point; the user's `extra` win over the defaults of the check."""
    own = [*BASE_OVERRIDES, f"hardware={hardware}", f"hardware.devices_per_node={ranks}",
           f"strategy={strategy}", f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}"]
    keys = {override.split("=", 1)[0] for override in extra}
    return [override for override in own if override.split("=", 1)[0] not in keys] + list(extra)


def hardware_accelerator(hardware: str, extra) -> str:
    return compose(point_overrides("single", 1, 1, hardware, extra)).hardware.accelerator


def rejection(overrides: list, ranks: int, preflight: Callable) -> Optional[str]:
    """Why this point is not run (the configuration checks' first problem, or a one-process
    strategy asked for several ranks), or None."""
    try:
        cfg = compose(overrides)
        world_size = preflight(cfg)
    except ConfigError as error:
        return error.problems[0]
    if world_size != ranks:
        return f"runs as {world_size} process(es), not {ranks}"
    return incomparable(cfg)


def incomparable(cfg) -> Optional[str]:
    """Why this point cannot equal its reference value by value on this hardware, or None. L2L
    draws dropout masks from the CPU generator (single's order); on a GPU `single` draws them
    with CUDA's (docs/strategies/l2l.md, "Dropout"): equal in distribution only."""
    if cfg.strategy.name == "l2l" and cfg.model.dropout > 0 and cfg.hardware.accelerator == "gpu":
        return (f"model.dropout={cfg.model.dropout}: l2l's masks come from the CPU generator, single's "
                f"from CUDA's; compare with model.dropout=0")
    return None


def run_train_py(overrides: list, run_directory: Path) -> dict:
    """Run train.py as a user does; return its summary.json (a failed one when it wrote none)."""
    result = subprocess.run([sys.executable, "train.py", *overrides, f"hydra.run.dir={run_directory}"],
                            cwd=ROOT, capture_output=True, text=True)
    (run_directory / "gpu_check.log").write_text(result.stdout + result.stderr)
    summary_path = run_directory / "summary.json"
    if summary_path.exists():
        return json.loads(summary_path.read_text())
    return {"status": "failed", "error": (result.stderr.strip().splitlines() or ["no output"])[-1]}


def check(strategies, rank_counts, steps: int, hardware: str, directory: Path, extra=(),
          run: Callable[[list, Path], dict] = run_train_py, *, preflight: Callable) -> list:
    """Run every (strategy, ranks) point and each reference once; return the table's rows.
    `preflight(cfg) -> world size` (layerwise.preflight.validate) decides which points run."""
    directory, summaries = Path(directory), {}

    def summary_of(strategy: str, ranks: int) -> dict:
        if (strategy, ranks) not in summaries:
            print(f"gpu_check: {strategy} on {ranks} rank(s), {steps} steps", flush=True)
            overrides = point_overrides(strategy, ranks, steps, hardware, extra)
            summaries[strategy, ranks] = run(overrides, make(directory / f"{strategy}-{ranks}"))
        return summaries[strategy, ranks]

    rows = [row_of("single", 1, summary_of("single", 1), summary_of("single", 1), "single")]
    for strategy in strategies:
        for ranks in rank_counts:
            reason = rejection(point_overrides(strategy, ranks, steps, hardware, extra), ranks, preflight)
            if reason:
                rows.append(Row(strategy, ranks, "skipped", reason=reason))
                continue
            reference = REFERENCE_OF.get(strategy, "single")
            rows.append(row_of(strategy, ranks, summary_of(strategy, ranks),
                               summary_of(reference, 1), reference))
    return rows


def make(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def row_of(strategy: str, ranks: int, summary: dict, reference: dict, reference_name: str) -> Row:
    """A row from a run's summary compared with its reference's summary."""
    if summary.get("status") != "completed":
        return Row(strategy, ranks, "failed", reference_name, reason=str(summary.get("error")))
    if reference.get("status") != "completed":
        return Row(strategy, ranks, "failed", reference_name,
                   reason=f"reference {reference_name} failed: {reference.get('error')}")
    losses, expected = summary["losses"], reference["losses"]
    if len(losses) != len(expected):
        return Row(strategy, ranks, "failed", reference_name,
                   reason=f"{len(losses)} steps, reference {reference_name} {len(expected)}")
    difference = max(abs(loss - reference_loss) for loss, reference_loss in zip(losses, expected))
    return Row(strategy, summary.get("world_size", ranks), "completed", reference_name, difference,
               summary.get("step_time_s_median"), summary.get("allocator_peak_bytes"))


def passed(row: Row, tolerance: float) -> bool:
    return row.status == "skipped" or (row.status == "completed" and row.max_loss_difference <= tolerance)


def format_table(rows, tolerance: float) -> str:
    """The table printed at the end: one line per point, skipped and failed points with reasons."""
    header = ("strategy", "ranks", "max |Δloss|", "step time", "allocator peak", "result")
    lines = [cells_of(row, tolerance) for row in rows]
    widths = [max(len(line[column]) for line in [header] + lines) for column in range(len(header))]
    render = lambda cells: "  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()
    return "\n".join([render(header), render(["-" * width for width in widths])]
                     + [render(line) for line in lines])


def cells_of(row: Row, tolerance: float) -> list:
    if row.status != "completed":
        return [row.strategy, str(row.ranks), "", "", "", f"{row.status}: {row.reason}"]
    peak = "-" if row.allocator_peak_bytes is None else f"{row.allocator_peak_bytes / 2 ** 20:.1f} MiB"
    step = "-" if row.step_time_s is None else f"{row.step_time_s * 1000:.1f} ms"
    verdict = f"equals {row.reference}" if passed(row, tolerance) else f"DIFFERS from {row.reference}"
    return [row.strategy, str(row.ranks), f"{row.max_loss_difference:.2e}", step, peak, verdict]


if __name__ == "__main__":
    sys.exit(main())
