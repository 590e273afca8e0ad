"""Bucketed vs per-tensor gradient all-reduces, side by side (`strategy.bucket_mb`, issue 15 item 4).

    .venv/bin/python benchmarks/bucketing.py [--model gpt_small] [--steps 4] [--bucket-mb 25]

Two data-parallel ranks; for the modular pipeline's stage reduction (pipeline_degree=1) and L2L's
host-side reduction: collectives per step (metrics.csv `comm_calls`), logical all-reduce bytes per
step (equal by construction) and median step time, with bucket_mb=0 (one all-reduce per parameter
tensor) and bucket_mb=25 (one per flat bucket). Numbers from a 2-core CPU with gloo: the counts
and bytes are exact, the times are not GPU times.
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from layerwise.run.fit import train  # noqa: E402
from layerwise.preflight import validate  # noqa: E402
from benchmarks.common import compose_config  # noqa: E402

STRATEGIES = {"modular_pipeline": ["strategy=modular_pipeline", "strategy.pipeline_degree=1"],
              "l2l": ["strategy=l2l"]}


def two_rank_summary(directory: Path, arguments, *extra: str) -> dict:
    """summary.json of a run on 2 ranks, without validation, checkpoints or the strict p2p check."""
    cfg = compose_config("logger=none", "trainer.progress=none", "trainer.limit_val_batches=0",
                         f"model={arguments.model}", f"data.global_batch_size={arguments.batch}",
                         f"data.sequence_length={arguments.sequence}", f"trainer.max_steps={arguments.steps}",
                         "hardware.devices_per_node=2", "trainer.checkpoint_every_n_steps=1000",
                         "trainer.check_point_to_point_order=false", *extra)
    return train(cfg, directory, validate(cfg))


def run_arguments(description: str, batch: int) -> argparse.ArgumentParser:
    """The arguments of two_rank_summary's runs, shared by the benchmarks that use it."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt_small")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--sequence", type=int, default=128)
    return parser


def measure(directory: Path, arguments, extra: list) -> dict:
    summary = two_rank_summary(directory, arguments, *extra)
    return {"calls": summary["comm_calls_per_step"], "bytes": summary["comm_bytes_per_step"]["all_reduce"],
            "step_time": summary["step_time_s_median"]}


def main() -> None:
    parser = run_arguments(__doc__, batch=8)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    arguments = parser.parse_args()
    print(f"{'strategy':<18}{'bucket_mb':>10}{'calls/step':>11}{'all-reduce MB':>14}{'step s':>8}")
    for name, overrides in STRATEGIES.items():
        results = {}
        for size in (0, arguments.bucket_mb):
            with tempfile.TemporaryDirectory() as scratch:
                results[size] = measure(Path(scratch), arguments, [*overrides, f"strategy.bucket_mb={size}"])
            r = results[size]
            print(f"{name:<18}{size:>10g}{r['calls']:>11.0f}{r['bytes'] / 1e6:>14.3f}{r['step_time']:>8.3f}")
        per_tensor, bucketed = results[0], results[arguments.bucket_mb]
        print(f"{'':18}calls bucketed / per tensor {bucketed['calls'] / per_tensor['calls']:.3f}, "
              f"bytes equal: {bucketed['bytes'] == per_tensor['bytes']}, "
              f"step time bucketed / per tensor {bucketed['step_time'] / per_tensor['step_time']:.3f}")


if __name__ == "__main__":
    main()
