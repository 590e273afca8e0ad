"""Plan mode against published Megatron-LM throughput (issue 31): predicted vs published TFLOP/s per GPU.

    .venv/bin/python benchmarks/plan_vs_published.py                 # fit the large-product rate on the tuned rows, then the table
    .venv/bin/python benchmarks/plan_vs_published.py --efficiency 0.5  # the table at a given rate (no fit)
    .venv/bin/python benchmarks/plan_vs_published.py --ablations     # also: each term switched off in turn
    .venv/bin/python benchmarks/plan_vs_published.py --runs benchmarks/published/vtrain_runs.csv   # vTrain's 109 measured runs
    .venv/bin/python benchmarks/plan_vs_published.py --simulate      # each row validated and simulated as train.py mode=plan does (~10 min)
    .venv/bin/python benchmarks/plan_vs_published.py --ours          # without MEGATRON_ONLY: what our strategies would step
    .venv/bin/python benchmarks/plan_vs_published.py --commands      # also each row's train.py command line

A thin command line over layerwise/reproduce/published.py: every row of benchmarks/published/megatron_runs.csv
(or the csv --runs names) composed as the `python train.py mode=plan` configuration a user would type
(`published.overrides_of`) and priced by plan mode's workload of it, in closed form (cost/step_time.py)
or simulated (--simulate), with the MEGATRON_ONLY terms named (--ours: without them), counted as its source
counts FLOPs, with the error; the rate is always fitted on megatron_runs.csv's tuned rows;
mean and worst |error| over all rows, the tuned rows and the held-out rows. Plan mode only: nothing runs
on a GPU, and the timings of this machine play no part.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from layerwise.config.store import compose  # noqa: E402
from layerwise.reproduce.published import (ABLATIONS, MEGATRON_ONLY, RUNS, TOLERANCE, fit_efficiency,  # noqa: E402
                                           read_runs, summary, validation_table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--efficiency", type=float, default=None,
                        help="plan.efficiency (the large-product rate); default: fitted on the tuned rows")
    parser.add_argument("--ablations", action="store_true", help="also the table's errors with each term switched off")
    parser.add_argument("--runs", type=Path, default=RUNS, help=f"the csv of runs to price (default {RUNS.name})")
    parser.add_argument("--simulate", action="store_true",
                        help="validate each row and simulate its plan as train.py mode=plan does (minutes)")
    parser.add_argument("--ours", action="store_true", help="without the MEGATRON_ONLY terms: our strategies' step")
    parser.add_argument("--commands", action="store_true", help="print each row's train.py command")
    arguments = parser.parse_args()
    if not arguments.runs.is_file():
        parser.error(f"--runs {arguments.runs}: no such file (the sets are in benchmarks/published/)")
    runs = read_runs(arguments.runs)
    base = compose(["model=gpt3_175b", "hardware=dgx_a100_80g", "logger=none"])
    efficiency = arguments.efficiency if arguments.efficiency is not None else fit_efficiency(base)
    fitted = compose(["model=gpt3_175b", "hardware=dgx_a100_80g", "logger=none", f"plan.efficiency={efficiency}"])
    megatron_only = () if arguments.ours else tuple(MEGATRON_ONLY)
    rows = validation_table(fitted, runs, simulate=arguments.simulate, megatron_only=megatron_only)
    print(f"plan.efficiency (large-product rate) = {efficiency}"
          + (" (fitted on the tuned rows)" if arguments.efficiency is None else " (given)"))
    print("Megatron-LM's own, priced on top of each configuration: "
          + ("; ".join(f"{name} ({reason})" for name, (_, reason) in MEGATRON_ONLY.items()) if megatron_only else "none"))
    print("| run | split | layout verified | predicted step s | bubble | predicted TFLOP/s/GPU | published | error |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        marker = "" if abs(row["error"]) <= TOLERANCE else " **miss**"
        print(f"| {row['run']} | {row['split']} | {row['verified']} | {row['step_time_s']:.3f} | "
              f"{row['bubble_fraction']:.3f} | {row['predicted_tflops_per_gpu']:.1f} | "
              f"{row['published_tflops_per_gpu']:g} | {row['error']:+.1%}{marker} |")
    if arguments.commands:
        print()
        for row in rows:
            print(f"{row['run']}: {row['command']}")
    for split, stats in summary(rows).items():
        if stats["rows"]:
            print(f"{split}: {stats['rows']} rows, mean |error| {stats['mean']:.1%}, median {stats['median']:.1%}, "
                  f"worst {stats['worst']:.1%}, {stats['within']} within ±{TOLERANCE:.0%}")
    if arguments.ablations:
        print("\n| term switched off | error per row (csv order) | mean | worst | within ±10% |\n|---|---|---|---|---|")
        for name in ABLATIONS:
            ablated = validation_table(fitted, runs, ablate=name, megatron_only=megatron_only)
            stats = summary(ablated)["all"]
            errors = " ".join(f"{row['error']:+.0%}" for row in ablated)
            print(f"| {name} | {errors} | {stats['mean']:.1%} | {stats['worst']:.1%} | {stats['within']} |")


if __name__ == "__main__":
    main()
