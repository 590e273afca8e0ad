"""Eager vs compiled blocks (`trainer.compile`, issue 59), side by side in one run, per strategy family.

    .venv/bin/python benchmarks/compile.py [--model gpt_tiny] [--steps 8] [--batch 8] [--sequence 128] [--repeats 2]

For each family that compiles (the whole model: single, ddp; a pipeline: modular_pipeline p = 2
with 4 micro-batches; sharded: fsdp2), one eager run and one compiled run of the same config: the
median step time over steps 3 … n−1 (step 1 compiles, step 2 may still warm up; the eager run's
memory meter watches steps 1, 2 and n, so those are left out of both; measure_every_n_steps=1000), compiled / eager, the
compile seconds and graphs (of the first compiled run; later ones load inductor's cache), and for
the pipeline the measured bubble fraction of each. Eager and compiled runs alternate `--repeats`
times and the faster median of each is shown: the 2 cores are shared, and load hits both alike. Numbers from
this 2-core CPU with gloo: on a CPU a compiled block gains little or loses (issue 59: 1.08× slower
on gpt_small); the value is on GPUs, where scripts/device_check.sh runs the same table.
"""

import argparse
import csv
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import compose_config  # noqa: E402
from layerwise.preflight import validate  # noqa: E402
from layerwise.run.fit import train  # noqa: E402

FAMILIES = {
    "single": ["strategy=single"],
    "ddp": ["strategy=ddp"],
    "modular_pipeline": ["strategy=modular_pipeline", "strategy.pipeline_degree=2", "strategy.micro_batches=4"],
    "fsdp2": ["strategy=fsdp2"],
}


def run(directory: Path, arguments, *extra: str) -> tuple:
    """(summary, median step seconds of steps 3 … n−1) of one run without validation or checkpoints."""
    cfg = compose_config("logger=none", "trainer.progress=none", "trainer.limit_val_batches=0",
                         "trainer.charts=false", f"model={arguments.model}",
                         f"data.global_batch_size={arguments.batch}", f"data.sequence_length={arguments.sequence}",
                         f"trainer.max_steps={arguments.steps}", "trainer.checkpoint_every_n_steps=1000",
                         "trainer.measure_every_n_steps=1000", "trainer.check_point_to_point_order=false", *extra)
    summary = train(cfg, directory, validate(cfg))
    with (directory / "metrics.csv").open() as handle:
        rows = [row for row in csv.DictReader(handle) if 3 <= int(row["step"]) < arguments.steps]
    return summary, statistics.median(float(row["step_time_s"]) for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt_tiny")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--sequence", type=int, default=128)
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--repeats", type=int, default=2, help="alternating eager/compiled pairs; the best median of each")
    arguments = parser.parse_args()
    torch.set_num_threads(1)  # single runs in this process: one thread, as each forked rank has (rank_threads)
    print(f"{arguments.model}, batch {arguments.batch} × {arguments.sequence} tokens, steps 3..{arguments.steps - 1}")
    print(f"{'family':<18}{'eager ms':>9}{'compiled ms':>12}{'ratio':>7}{'compile s':>10}{'graphs':>7}"
          f"{'bubble eager':>13}{'bubble comp.':>13}")
    with tempfile.TemporaryDirectory() as scratch:
        for name in arguments.families:
            runs = {"eager": [], "compiled": []}
            for repeat in range(arguments.repeats):  # alternated: load from other processes hits both alike
                for mode, extra in (("eager", ()), ("compiled", ("trainer.compile=true",))):
                    runs[mode].append(run(Path(scratch) / f"{name}_{mode}{repeat}", arguments, *FAMILIES[name], *extra))
            (eager, eager_s), (compiled, compiled_s) = (min(runs[mode], key=lambda r: r[1]) for mode in runs)
            record = runs["compiled"][0][0]["compile"]  # the first compiled run's: the one that compiled
            bubbles = [summary.get("bubble_fraction", {}).get("measured") for summary in (eager, compiled)]
            shown = ["" if bubble is None else f"{bubble:.3f}" for bubble in bubbles]
            print(f"{name:<18}{eager_s * 1e3:>9.1f}{compiled_s * 1e3:>12.1f}{compiled_s / eager_s:>7.2f}"
                  f"{record['compile_s']:>10.1f}{record['graphs_first_step'] + record['graphs_after_first_step']:>7}"
                  f"{shown[0]:>13}{shown[1]:>13}", flush=True)


if __name__ == "__main__":
    main()
