"""Plan mode's predicted memory (and step time) against measured runs, side by side, on this machine.

    .venv/bin/python benchmarks/plan_vs_measured.py [--steps 4] [--only NAME ...]

For each configuration: `layerwise.plan.plan` (nothing run), then the same config trained for a few
steps with the compute-memory meter on every step (`trainer.measure_every_n_steps=1`); the measured
peak is the maximum over ranks and steps (summary.json `peak_compute_bytes`), the predicted one the
largest role's bytes before the allocator margin. Memory is exact accounting on both sides; step
times are printed for reference only: the time model is not calibrated yet (issue 16 item 4).
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--only", nargs="*", default=None)
    arguments = parser.parse_args()
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
