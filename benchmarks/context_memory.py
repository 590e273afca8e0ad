"""Peak activation memory per rank under context parallelism, measured beside plan mode's prediction.

    .venv/bin/python benchmarks/context_memory.py [--lengths 2048 16384] [--degrees 1 2 4] [--comm ring]

For each sequence length s and context degree c (issue 57 item 4): a small Llama (llama_tiny: 4
layers, hidden 128, 4 heads, 2 kv heads) under `strategy=modular_pipeline` with one stage and `strategy.context_parallel=c` on c forked
ranks (one sequence per step, data degree 1), trained for two steps with the compute-memory meter on
every step (parallel/memory.py's ComputeMemoryMeter: summary.json `peak_compute_bytes`, the largest
over ranks and steps), and the same config through `mode=plan` (nothing run). The activation peak is
the peak less the parameters, gradients and optimizer state, which both sides hold identically (plan
mode's exact counts of them); the prediction is the largest role's activations + buffers. Printed:
measured and predicted activation MiB, each as a ratio to c = 1 at the same length, and predicted /
measured (the issue's target: within ±5%).
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("WANDB_MODE", "disabled")

from benchmarks.common import compose_config  # noqa: E402
from layerwise.planning.mode import plan  # noqa: E402
from layerwise.preflight import validate  # noqa: E402
from layerwise.run.fit import train  # noqa: E402

MIB = 2 ** 20
# modular_pipeline with one stage: its gradient buckets are reduced in place (strategies/buckets.py), as plan
# mode prices them (strategy=ddp measured the same activations at 2,048 tokens: within 0.5 MiB per c).
COMMON = ["model=llama_tiny", "strategy=modular_pipeline", "strategy.pipeline_degree=1", "strategy.layers_per_stage=4",
          "strategy.micro_batches=1", "logger=none", "trainer.progress=none", "trainer.limit_val_batches=0",
          "trainer.measure_every_n_steps=1", "trainer.max_steps=2", "data.global_batch_size=1"]
STATIC = ("parameters", "gradients", "optimizer")


def overrides(length: int, degree: int, comm: str) -> list:
    return [*COMMON, f"data.sequence_length={length}", f"model.max_sequence_length={length}",
            f"hardware.devices_per_node={degree}", f"strategy.context_parallel={degree}",
            f"strategy.context_parallel_comm={comm}"]


def measure(length: int, degree: int, comm: str) -> dict:
    """(measured, predicted) activation bytes of the largest rank, and the static bytes subtracted."""
    with tempfile.TemporaryDirectory() as directory:
        cfg = compose_config(*overrides(length, degree, comm), "mode=plan")
        planned = plan(cfg, validate(cfg), Path(directory) / "plan", charts=False)
        cfg = compose_config(*overrides(length, degree, comm))
        measured = train(cfg, Path(directory) / "run", validate(cfg))
    role = max(planned["roles"], key=lambda role: role["peak_compute_bytes"])
    static = sum(role["memory_bytes"][kind] for kind in STATIC)
    predicted = role["peak_compute_bytes"] - static  # activations + buffers
    return {"length": length, "degree": degree, "measured": measured["peak_compute_bytes"] - static,
            "predicted": predicted, "static": static, "measured_peak": measured["peak_compute_bytes"]}


def table(rows: list) -> str:
    base = {row["length"]: row for row in rows if row["degree"] == 1}
    lines = ["| s | c | measured activation MiB | ratio to c=1 | predicted MiB | ratio to c=1 | predicted / measured |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        first = base.get(row["length"])
        measured_ratio = f"{row['measured'] / first['measured']:.3f}" if first else "-"
        predicted_ratio = f"{row['predicted'] / first['predicted']:.3f}" if first else "-"
        lines.append(f"| {row['length']:,} | {row['degree']} | {row['measured'] / MIB:.2f} | {measured_ratio} | "
                     f"{row['predicted'] / MIB:.2f} | {predicted_ratio} | {row['predicted'] / row['measured']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[2048, 16384])
    parser.add_argument("--degrees", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--comm", default="ring", choices=("ring", "all_gather"))
    arguments = parser.parse_args()
    rows = []
    for length in arguments.lengths:
        for degree in arguments.degrees:
            rows.append(measure(length, degree, arguments.comm))
            row = rows[-1]
            print(f"s={length} c={degree} {arguments.comm}: measured activation {row['measured'] / MIB:.2f} MiB "
                  f"(peak {row['measured_peak'] / MIB:.2f}, static {row['static'] / MIB:.2f}), predicted "
                  f"{row['predicted'] / MIB:.2f} MiB", flush=True)
    print(f"\n{arguments.comm}:\n" + table(rows))


if __name__ == "__main__":
    main()
