"""ZeRO-3 with layered accumulation vs depth-first ZeRO-3 vs PyTorch FSDP2, side by side (docs/strategies/zero_layered.md).

    .venv/bin/python benchmarks/zero_layered.py [--model gpt_small] [--steps 3] [--ranks 2 4]

For each data-parallel degree n and m micro-batches: logical bytes per rank per step (metrics.csv
where the strategy counts them, and an independent wrapper around torch.distributed's all-gather /
reduce-scatter for every variant), median step time, compute-side peak memory; then the ratios.
The unsharded reference (modular_pipeline at pipeline_degree=1: replicated, the same layered order)
gives the memory baseline. Numbers from a 2-core CPU with gloo: traffic is exact, times are not GPU times.
"""

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from layerwise.preflight import validate  # noqa: E402
from benchmarks.common import compose_config, run_on_ranks  # noqa: E402
from layerwise.reproduce.measure import counted_fit  # noqa: E402  (the independent counter)

VARIANTS = {
    "layered": ["strategy=zero_layered"],
    "depth_first": ["strategy=zero_depth_first"],
    "fsdp2_sync": ["strategy=fsdp2", "strategy.sync_every_micro_batch=true"],
    "fsdp2_no_sync": ["strategy=fsdp2", "strategy.sync_every_micro_batch=false"],
    "unsharded": ["strategy=modular_pipeline", "strategy.pipeline_degree=1"],
}


def measure(directory: Path, ranks: int, micro_batches: int, arguments, extra) -> dict:
    cfg = compose_config("logger=none", "trainer.progress=none", "trainer.limit_val_batches=0",
                         f"model={arguments.model}", f"data.global_batch_size={arguments.batch}",
                         f"data.sequence_length={arguments.sequence}", f"trainer.max_steps={arguments.steps}",
                         f"hardware.devices_per_node={ranks}", f"strategy.micro_batches={micro_batches}",
                         "trainer.checkpoint_every_n_steps=1000", *extra)
    directory.mkdir(parents=True)
    world = validate(cfg)
    tallies = run_on_ranks(counted_fit, world, cfg, directory, world)
    summary = json.loads((directory / "summary.json").read_text())
    logged = summary["comm_bytes_per_step"]
    return {"counted": max(t["all_gather"] + t["reduce_scatter"] for t in tallies) / arguments.steps,
            "logged": logged["all_gather"] + logged["reduce_scatter"] + logged["all_reduce"],
            "step_time": summary["step_time_s_median"], "peak": summary["peak_compute_bytes"]}


def report(ranks: int, results: dict) -> None:
    base = results["layered"]
    print(f"\nn={ranks}  {'variant':<14}{'counted MB':>11}{'metrics MB':>11}{'step s':>8}{'peak MB':>9}"
          f"{'bytes/layered':>14}{'time/layered':>13}")
    for name, r in results.items():
        print(f"{'':5}{name:<14}{r['counted'] / 1e6:>11.3f}{r['logged'] / 1e6:>11.3f}{r['step_time']:>8.3f}"
              f"{r['peak'] / 1e6:>9.1f}{r['counted'] / base['counted'] if base['counted'] else 0:>14.2f}"
              f"{r['step_time'] / base['step_time']:>13.2f}")
    print(f"{'':5}peak memory layered / unsharded: {base['peak'] / results['unsharded']['peak']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt_small")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--sequence", type=int, default=128)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    arguments = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="zero_layered_bench_"))
    everything = {}
    try:
        for ranks in arguments.ranks:
            results = {name: measure(root / f"n{ranks}_{name}", ranks, arguments.micro_batches, arguments, extra)
                       for name, extra in VARIANTS.items()}
            everything[ranks] = results
            report(ranks, results)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\n" + json.dumps({str(k): v for k, v in everything.items()}))


if __name__ == "__main__":
    main()
