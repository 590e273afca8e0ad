"""Plan mode's predicted memory (and step time) against measured runs, side by side, on this machine.

    .venv/bin/python benchmarks/plan_vs_measured.py [--steps 4] [--only NAME ...]
    .venv/bin/python benchmarks/plan_vs_measured.py --time [--steps 12]   step times (after mode=calibrate)

For each configuration: `layerwise.plan.plan` (nothing run), then the same config trained for a few
steps with the compute-memory meter on every step (`trainer.measure_every_n_steps=1`); the measured
peak is the maximum over ranks and steps (summary.json `peak_compute_bytes`), the predicted one the
largest role's bytes before the allocator margin. Memory is exact accounting on both sides.

`--time`: the predicted step against the measured median, for the configurations that run one rank
per core here (2 ranks: more ranks than cores would time the cores' sharing, which no plan models),
with `hardware=calibrated` (run `python train.py mode=calibrate` first) and `plan.efficiency=1`
(the calibrated peak is already the achieved rate); the meter runs on the first 2 steps and the
last only, so the median of 12 steps is an unmetered step.
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("WANDB_MODE", "disabled")

from layerwise.plan import plan  # noqa: E402
from layerwise.run import train  # noqa: E402
from layerwise.validate import validate  # noqa: E402
from tests.harness import compose_config  # noqa: E402

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
}


def compare(name: str, overrides: list, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        cfg = compose_config(*COMMON, *overrides, "mode=plan")
        predicted = plan(cfg, validate(cfg), Path(directory) / "plan")
        cfg = compose_config(*COMMON, *overrides, f"trainer.max_steps={steps}", "trainer.measure_every_n_steps=1")
        measured = train(cfg, Path(directory) / "run", validate(cfg))
    peak = max(sum(role["bytes"].values()) for role in predicted["roles"])
    return {"name": name, "predicted": peak, "measured": measured["peak_compute_bytes"],
            "predicted_s": predicted["step_seconds"], "measured_s": measured["step_time_s_median"]}


def compare_time(name: str, overrides: list, steps: int) -> dict:
    calibrated = [*COMMON, *overrides, "hardware=calibrated", "plan.efficiency=1.0"]
    with tempfile.TemporaryDirectory() as directory:
        cfg = compose_config(*calibrated, "mode=plan")
        predicted = plan(cfg, validate(cfg), Path(directory) / "plan")
        cfg = compose_config(*calibrated, f"trainer.max_steps={steps}", f"trainer.measure_every_n_steps={steps}")
        measured = train(cfg, Path(directory) / "run", validate(cfg))
    return {"name": name, "predicted_s": predicted["step_seconds"], "measured_s": measured["step_time_s_median"]}


def time_table(steps: int) -> None:
    rows = [compare_time(name, overrides, steps) for name, overrides in CONFIGS.items()
            if not any(override.startswith("hardware.devices_per_node") for override in overrides)]
    print(f"\n{'configuration':32s} {'predicted s':>12s} {'measured s':>11s} {'measured / predicted':>21s}")
    for row in rows:
        print(f"{row['name']:32s} {row['predicted_s']:12.4f} {row['measured_s']:11.4f} "
              f"{row['measured_s'] / row['predicted_s']:21.2f}")
    order = [row["name"] for row in sorted(rows, key=lambda row: row["predicted_s"])]
    measured_order = [row["name"] for row in sorted(rows, key=lambda row: row["measured_s"])]
    print(f"fastest first, predicted: {order}\nfastest first, measured:  {measured_order}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--time", action="store_true", help="step times with hardware=calibrated (see above)")
    arguments = parser.parse_args()
    if arguments.time:
        return time_table(max(arguments.steps, 12))
    rows = []
    for name, overrides in CONFIGS.items():
        if arguments.only is None or name in arguments.only:
            rows.append(compare(name, overrides, arguments.steps))
            print(f"{name}: predicted {rows[-1]['predicted'] / 2**20:.2f} MiB, measured "
                  f"{rows[-1]['measured'] / 2**20:.2f} MiB", flush=True)
    print(f"\n{'configuration':32s} {'predicted MiB':>14s} {'measured MiB':>13s} {'ratio':>6s} "
          f"{'pred s':>7s} {'meas s':>7s}")
    for row in rows:
        print(f"{row['name']:32s} {row['predicted'] / 2**20:14.2f} {row['measured'] / 2**20:13.2f} "
              f"{row['predicted'] / row['measured']:6.3f} {row['predicted_s']:7.3f} {row['measured_s']:7.3f}")
    ratios = sorted(row["predicted"] / row["measured"] for row in rows)
    print(f"memory ratio predicted/measured: median {ratios[len(ratios) // 2]:.3f}, range "
          f"{ratios[0]:.3f}–{ratios[-1]:.3f} over {len(rows)} configurations")


if __name__ == "__main__":
    main()
