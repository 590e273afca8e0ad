"""Plan mode's predicted memory (and step time) against measured runs, side by side, on this machine.

    .venv/bin/python benchmarks/plan_vs_measured.py [--steps 4] [--only NAME ...]
    .venv/bin/python benchmarks/plan_vs_measured.py --time [--steps 12]   step times (after mode=calibrate)

For each configuration: `layerwise.planning.mode.plan` (nothing run), then the same config trained for a few
steps with the compute-memory meter on every step (`trainer.measure_every_n_steps=1`); the measured
peak is the maximum over ranks and steps (summary.json `peak_compute_bytes`), the predicted one the
largest role's bytes before the allocator margin. Memory is exact accounting on both sides.

`--time`: the predicted step against the measured median step (`TIME_CONFIGS`: every strategy plan
mode prices, and the compositions), with `hardware=calibrated` (run `python train.py mode=calibrate`
first; its `matmul_efficiency: 1` says its peak is the achieved rate, so no `plan.efficiency`); the meter runs on
the first 2 steps and the last only, so the median of 12 steps is an unmetered step. Each
configuration is measured `--repeats` times (3) in interleaved passes, each pass after its own
`mode=calibrate` (`--no-recalibrate`: the profile on disk), and the ratio is the median of the
passes' predicted / measured. Layouts of more ranks than this machine's cores are included: the plan models their sharing
of the cores (layerwise.planning.inputs.device_of), and their runs vary most from pass to pass.

Both tables print the tuned rows and the held-out ones (`HELD_OUT`, fixed before the model was changed
for issue 31) separately, each group with its mean and worst error.
"""

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("WANDB_MODE", "disabled")

from layerwise.planning.mode import plan  # noqa: E402
from layerwise.tools.calibrate import calibrate  # noqa: E402
from layerwise.run.fit import train  # noqa: E402
from layerwise.preflight import validate  # noqa: E402
from benchmarks.common import compose_config  # noqa: E402

COMMON = ["logger=none", "trainer.progress=none", "trainer.limit_val_batches=0", "model.layers=8"]
CONFIGS = {
    "modular_pipeline p2 v4": ["strategy=modular_pipeline"],
    "modular_pipeline p2 recompute": ["strategy=modular_pipeline", "strategy.activation_recompute=full"],
    "gpipe p2": ["strategy=gpipe", "strategy.layers_per_stage=4"],
    "one_f_one_b p2": ["strategy=one_f_one_b", "strategy.layers_per_stage=4"],
    "interleaved_1f1b p2 v2": ["strategy=interleaved_1f1b", "strategy.layers_per_stage=2"],
    "modular_pipeline p2 × d2": ["strategy=modular_pipeline", "hardware.devices_per_node=4"],
    "zero_layered d2": ["strategy=zero_layered"],
    "zero_layered p2 × d2": ["strategy=zero_layered", "strategy.pipeline_degree=2", "hardware.devices_per_node=4"],
    "modular_pipeline p2 × 1d2": ["strategy=modular_pipeline", "strategy.tensor_parallel=1d",
                                  "hardware.devices_per_node=4"],
    "one_f_one_b p2 × 2d q2": ["strategy=one_f_one_b", "strategy.layers_per_stage=4", "strategy.tensor_parallel=2d",
                               "hardware.devices_per_node=8"],
    "zero_layered p2 × 1d2 × d2": ["strategy=zero_layered", "strategy.pipeline_degree=2", "strategy.tensor_parallel=1d",
                                   "hardware.devices_per_node=8"],
    "modular_pipeline p4 m8": ["strategy=modular_pipeline", "strategy.pipeline_degree=4", "strategy.micro_batches=8",
                               "hardware.devices_per_node=4"],
    "modular_pipeline p2 × 3d q2": ["strategy=modular_pipeline", "strategy.tensor_parallel=3d",
                                    "hardware.devices_per_node=16", "data.global_batch_size=32"],
    # issue 31's 3-D grid on 8 ranks (+12% memory there): a tuned row; the p2 × 3-D row above is held out
    "three_d q2 (memory)": ["strategy=three_d", "strategy.tensor_grid=2", "hardware.devices_per_node=8"],
}


# Step time (--time): every strategy plan mode prices, and the compositions, on this machine. Layouts of
# more ranks than cores run with `hardware.compute_units_per_node` = the cores (the calibrated profile's).
TIME_CONFIGS = {
    **{name: overrides for name, overrides in CONFIGS.items() if not any("devices_per_node" in o for o in overrides)},
    "zero_depth_first d2": ["strategy=zero_depth_first"],
    "zero_layered p2": ["strategy=zero_layered", "strategy.pipeline_degree=2"],
    "single": ["strategy=single", "hardware.devices_per_node=1"],
    "ddp d2": ["strategy=ddp"],
    "tp_1d q2": ["strategy=tp_1d", "strategy.tensor_grid=2"],
    "l2l": ["strategy=l2l", "hardware.devices_per_node=1"],
    "l2l constant memory": ["strategy=l2l", "strategy.constant_memory=true", "hardware.devices_per_node=1"],
    "pipefisher p2": ["strategy=pipefisher", "strategy.layers_per_stage=4"],
    **{name: CONFIGS[name] for name in ("modular_pipeline p2 × d2", "modular_pipeline p2 × 1d2", "zero_layered p2 × d2")},
    "tp_2d q2": ["strategy=tp_2d", "strategy.tensor_grid=2", "hardware.devices_per_node=4"],
    "three_d q2": ["strategy=three_d", "strategy.tensor_grid=2", "hardware.devices_per_node=8"],
}

# The Llama family (issue 29): RMSNorm, RoPE, SwiGLU, grouped-query attention (llama_tiny: 4 heads, 2 kv heads).
LLAMA = ["model=llama_tiny"]
CONFIGS.update({
    "llama modular_pipeline p2 v4": [*LLAMA, "strategy=modular_pipeline"],
    "llama one_f_one_b p2": [*LLAMA, "strategy=one_f_one_b", "strategy.layers_per_stage=4"],
    "llama zero_layered p2 × d2": [*LLAMA, "strategy=zero_layered", "strategy.pipeline_degree=2",
                                   "hardware.devices_per_node=4"],
    "llama modular_pipeline p2 × 1d2": [*LLAMA, "strategy=modular_pipeline", "strategy.tensor_parallel=1d",
                                        "hardware.devices_per_node=4"],
    "llama one_f_one_b p2 × 2d q2": [*LLAMA, "strategy=one_f_one_b", "strategy.layers_per_stage=4",
                                     "strategy.tensor_parallel=2d", "hardware.devices_per_node=8"],
    "llama pipefisher p2 (GPipe)": [*LLAMA, "strategy=pipefisher", "strategy.layers_per_stage=4"],
})

# PipeFisher's memory (its K-FAC factors, inverses and captures beside the pipeline's; a run must reach
# its cycle's second step, 4 steps do); its step time is the "pipefisher p2" row above.
CONFIGS.update({
    "pipefisher p2 (GPipe)": ["strategy=pipefisher", "strategy.layers_per_stage=4"],
    "pipefisher p2 (1F1B)": ["strategy=pipefisher", "strategy.layers_per_stage=4", "strategy.schedule=one_f_one_b"],
    "pipefisher p2 × 1d2": ["strategy=pipefisher", "strategy.layers_per_stage=4", "strategy.tensor_parallel=1d",
                            "hardware.devices_per_node=4"],
})

# Held out (issue 31 goal 3), chosen 2026-11-26 02:45 UTC before any model term changed: a third of each
# table, never looked at while a term was tuned, reported on their own. They include the 3-D and 2-D
# grids, ZeRO (depth-first and × tensor × data), L2L, the interleaved schedule, a 4-stage pipeline and a
# Llama composition, so every family has tuned and held-out rows. One set for both tables (a name held
# out is held out in both): 9 of CONFIGS' 23 memory rows, 7 of TIME_CONFIGS' 19 step rows. three_d q2's
# step is held out although issue 31 reported its error (−49%): no term below is fitted to that row.
HELD_OUT = {
    "modular_pipeline p2 × 3d q2", "one_f_one_b p2 × 2d q2", "zero_layered p2 × 1d2 × d2", "interleaved_1f1b p2 v2",
    "modular_pipeline p4 m8", "llama modular_pipeline p2 × 1d2", "pipefisher p2 (1F1B)",
    "three_d q2", "tp_2d q2", "zero_depth_first d2", "l2l constant memory", "modular_pipeline p2 × 1d2", "gpipe p2",
}


def summary(label: str, errors: list) -> str:
    """Mean and worst |predicted / measured − 1| of one group of rows."""
    if not errors:
        return f"{label}: no rows"
    worst = max(errors, key=abs)
    return (f"{label}: mean |error| {statistics.mean(abs(e) for e in errors):.1%}, worst {worst:+.1%} "
            f"over {len(errors)} configurations")


def compare(name: str, overrides: list, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        cfg = compose_config(*COMMON, *overrides, "mode=plan")
        predicted = plan(cfg, validate(cfg), Path(directory) / "plan")
        cfg = compose_config(*COMMON, *overrides, f"trainer.max_steps={steps}", "trainer.measure_every_n_steps=1")
        measured = train(cfg, Path(directory) / "run", validate(cfg))
    peak = max(role["peak_compute_bytes"] for role in predicted["roles"])
    return {"name": name, "predicted": peak, "measured": measured["peak_compute_bytes"],
            "predicted_s": predicted["step_time_s"], "measured_s": measured["step_time_s_median"]}


def compare_time(name: str, overrides: list, steps: int) -> dict:
    calibrated = [*COMMON, *overrides, "hardware=calibrated"]  # its matmul_efficiency is 1: no plan.efficiency
    with tempfile.TemporaryDirectory() as directory:
        cfg = compose_config(*calibrated, "mode=plan")
        predicted = plan(cfg, validate(cfg), Path(directory) / "plan")
        cfg = compose_config(*calibrated, f"trainer.max_steps={steps}", f"trainer.measure_every_n_steps={steps}")
        measured = train(cfg, Path(directory) / "run", validate(cfg))
    return {"name": name, "predicted_s": predicted["step_time_s"], "measured_s": measured["step_time_s_median"]}


def time_table(steps: int, only=None, repeats: int = 3, recalibrate: bool = True) -> None:
    """Each configuration planned and measured once per pass, the passes interleaved (every
    configuration, then again) so a burst of noise hits one run of many, not every run of one. With
    `recalibrate` each pass starts with `mode=calibrate`, so a prediction and its run are minutes
    apart: this machine's rates drift between calibrations (fp32 products 84-97 GFLOP/s, a block's
    modelled time 3.6-4.3 ms over four calibrations within an hour, idle machine; issue 31). The
    ratio is the median over passes of each pass's prediction over its run."""
    names = [name for name in TIME_CONFIGS if only is None or name in only]
    runs, predicted = {name: [] for name in names}, {name: [] for name in names}
    for attempt in range(repeats):
        if recalibrate:
            calibrate(compose_config("mode=calibrate", "calibrate.silent=true",
                                     f"calibrate.directory={ROOT / 'conf' / 'hardware'}"))
        for name in names:
            row = compare_time(name, TIME_CONFIGS[name], steps)
            predicted[name].append(row["predicted_s"])
            runs[name].append(row["measured_s"])
            print(f"pass {attempt + 1}: {name}: predicted {row['predicted_s']:.4f} s, measured {row['measured_s']:.4f} s",
                  flush=True)
    ratios = {name: statistics.median(p / m for p, m in zip(predicted[name], runs[name])) for name in names}
    for label, group in (("tuned", [n for n in names if n not in HELD_OUT]), ("held out", [n for n in names if n in HELD_OUT])):
        print(f"\n{label}:\n| configuration | predicted s (each pass) | measured s (each pass) | "
              "predicted / measured (median of passes) |\n|---|---|---|---|")
        for name in group:
            print(f"| {name} | {', '.join(f'{t:.4f}' for t in predicted[name])} | "
                  f"{', '.join(f'{t:.4f}' for t in runs[name])} | {ratios[name]:.2f} |")
        print(summary(f"step time, {label}", [ratios[n] - 1 for n in group]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)  # steps 3-7 run without the meter (summary speeds)
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--time", action="store_true", help="step times with hardware=calibrated (see above)")
    parser.add_argument("--repeats", type=int, default=3, help="--time: measured passes per configuration")
    parser.add_argument("--recalibrate", action=argparse.BooleanOptionalAction, default=True,
                        help="--time: run mode=calibrate before each pass (~70 s; else the profile on disk)")
    arguments = parser.parse_args()
    if arguments.time:
        return time_table(max(arguments.steps, 12), arguments.only, arguments.repeats, arguments.recalibrate)
    rows = []
    for name, overrides in CONFIGS.items():
        if arguments.only is None or name in arguments.only:
            rows.append(compare(name, overrides, arguments.steps))
            print(f"{name}: predicted {rows[-1]['predicted'] / 2**20:.2f} MiB, measured "
                  f"{rows[-1]['measured'] / 2**20:.2f} MiB", flush=True)
    for label, group in (("tuned", [r for r in rows if r["name"] not in HELD_OUT]),
                         ("held out", [r for r in rows if r["name"] in HELD_OUT])):
        print(f"\n{label}:\n{'configuration':32s} {'predicted MiB':>14s} {'measured MiB':>13s} {'ratio':>6s}")
        for row in group:
            print(f"{row['name']:32s} {row['predicted'] / 2**20:14.2f} {row['measured'] / 2**20:13.2f} "
                  f"{row['predicted'] / row['measured']:6.3f}")
        print(summary(f"memory, {label}", [row["predicted"] / row["measured"] - 1 for row in group]))


if __name__ == "__main__":
    main()
