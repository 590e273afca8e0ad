"""Activation recomputation vs none, side by side (`strategy.activation_recompute`, issue 15 item 3).

    .venv/bin/python benchmarks/recompute.py [--model gpt_small] [--layers 8] [--steps 4]

For the modular pipeline (2 pipeline ranks, looping placement, layered accumulation, m=4) and
zero_layered (2 data ranks): compute-side peak memory (summary.json `peak_compute_bytes`, measured
on every step) and median step time, with `none` and `full`; then the ratios. A recomputed backward
costs a forward more (3F instead of 2F), so the ideal step-time ratio is 4/3. CPU numbers.
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bucketing import run_arguments, two_rank_summary  # noqa: E402

STRATEGIES = {"modular_pipeline": ["strategy=modular_pipeline", "strategy.pipeline_degree=2"],
              "zero_layered": ["strategy=zero_layered"]}


def measure(directory: Path, arguments, extra: list) -> dict:
    summary = two_rank_summary(directory, arguments, f"model.layers={arguments.layers}",
                               "trainer.measure_every_n_steps=1", "strategy.micro_batches=4", *extra)
    return {"peak": summary["peak_compute_bytes"], "step_time": summary["step_time_s_median"]}


def main() -> None:
    parser = run_arguments(__doc__, batch=16)
    parser.add_argument("--layers", type=int, default=8)
    arguments = parser.parse_args()
    print(f"{'strategy':<18}{'recompute':>10}{'peak MB':>9}{'step s':>8}")
    for name, overrides in STRATEGIES.items():
        results = {}
        for mode in ("none", "full"):
            with tempfile.TemporaryDirectory() as scratch:
                results[mode] = measure(Path(scratch), arguments, [*overrides, f"strategy.activation_recompute={mode}"])
            print(f"{name:<18}{mode:>10}{results[mode]['peak'] / 1e6:>9.1f}{results[mode]['step_time']:>8.3f}")
        print(f"{'':18}peak full / none {results['full']['peak'] / results['none']['peak']:.3f}, "
              f"step time full / none {results['full']['step_time'] / results['none']['step_time']:.3f}")


if __name__ == "__main__":
    main()
