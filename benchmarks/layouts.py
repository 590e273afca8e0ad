"""Data × pipeline × tensor splits of 8 ranks on one model, side by side (issue 14).

    .venv/bin/python benchmarks/layouts.py [--steps 12] [--check] [--only NAME ...]

Every split trains the same model (gpt_tiny, 8 layers, hidden 64, 8 heads, batch 32 × 128 tokens,
AdamW) on 8 forked gloo ranks for `--steps` steps, with 4 micro-batches wherever the strategy has
micro-batches. From each run's summary.json: logical bytes per step by kind (max over ranks), the
median step time, the peak compute-side memory and the first loss, which must be the same for
every split (it is the loss of the same model on the same batch; the tests prove equality to
`single` separately). `--check` only validates every split (world = data × pipeline × tensor and
every divisibility) and prints its degrees.

The bytes are exact; the times come from a shared 2-core CPU running 8 processes, so they are
noisy and say more about per-message overhead than about bandwidth: the 1-minute load average is
printed at the start and the end.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from layerwise.run.fit import train  # noqa: E402
from layerwise.preflight import validate  # noqa: E402
from layerwise.config.layout import layout_of  # noqa: E402
from benchmarks.common import compose_config  # noqa: E402

WORLD = 8
MICRO = "strategy.micro_batches=4"
MODEL = ["model=gpt_tiny", "model.layers=8", "model.hidden=64", "model.heads=8",
         "data.global_batch_size=32", "data.sequence_length=128"]
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")

# name -> overrides; the degrees (data × pipeline × tensor) follow from the world of 8 ranks.
SPLITS = {
    "ddp": ["strategy=ddp"],
    "modular_pipeline p8": ["strategy=modular_pipeline", "strategy.pipeline_degree=8",
                            "strategy.layers_per_stage=1", MICRO],
    "modular_pipeline p2": ["strategy=modular_pipeline", "strategy.pipeline_degree=2",
                            "strategy.layers_per_stage=1", MICRO],
    "modular_pipeline p4": ["strategy=modular_pipeline", "strategy.pipeline_degree=4",
                            "strategy.layers_per_stage=1", MICRO],
    "tp_1d P8": ["strategy=tp_1d", "strategy.tensor_grid=8"],
    "three_d q2": ["strategy=three_d", "strategy.tensor_grid=2"],
    "tp_2d q2": ["strategy=tp_2d", "strategy.tensor_grid=2"],
    "modular_pipeline p2 1d2": ["strategy=modular_pipeline", "strategy.pipeline_degree=2",
                                "strategy.layers_per_stage=1", "strategy.tensor_parallel=1d",
                                "strategy.tensor_grid=2", MICRO],
    "modular_pipeline p2 2d q2": ["strategy=modular_pipeline", "strategy.pipeline_degree=2",
                                  "strategy.layers_per_stage=1", "strategy.tensor_parallel=2d",
                                  "strategy.tensor_grid=2", MICRO],
    "modular_pipeline p4 1d2": ["strategy=modular_pipeline", "strategy.pipeline_degree=4",
                                "strategy.layers_per_stage=1", "strategy.tensor_parallel=1d",
                                "strategy.tensor_grid=2", MICRO],
    "zero_layered p2 1d2": ["strategy=zero_layered", "strategy.pipeline_degree=2",
                            "strategy.layers_per_stage=1", "strategy.tensor_parallel=1d",
                            "strategy.tensor_grid=2", MICRO],
    "one_f_one_b p2 1d4": ["strategy=one_f_one_b", "strategy.pipeline_degree=2",
                           "strategy.layers_per_stage=4", "strategy.tensor_parallel=1d",
                           "strategy.tensor_grid=4", MICRO],
}


def config(arguments, overrides: list):
    """The composed config of one split on 8 ranks, without validation runs, checkpoints or the
    strict point-to-point check (a test-only check that costs a gather of orders)."""
    return compose_config("logger=none", "trainer.progress=none", "trainer.limit_val_batches=0",
                          *MODEL, f"trainer.max_steps={arguments.steps}", f"hardware.devices_per_node={WORLD}",
                          "trainer.checkpoint_every_n_steps=1000", "trainer.check_point_to_point_order=false",
                          *overrides)


def grid(cfg) -> str:
    """The tensor grid of a split: '-' (none), '1d 4', '2d q2', '3d q2'."""
    kind = cfg.strategy.get("tensor_parallel", "none")
    if kind in (None, "none"):
        return "-"
    q = cfg.strategy.tensor_grid
    return f"1d {q}" if kind == "1d" else f"{kind} q{q}"


def load() -> float:
    return os.getloadavg()[0]


def check(arguments) -> None:
    for name, overrides in SPLITS.items():
        cfg = config(arguments, overrides)
        world = validate(cfg)
        degrees = layout_of(cfg, world)
        print(f"{name:<28} world {world}: d{degrees.data} × p{degrees.pipeline} × t{degrees.tensor}"
              f" ({grid(cfg)})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--check", action="store_true", help="validate every split and stop")
    parser.add_argument("--only", nargs="*", help="run only these splits (names as in SPLITS)")
    arguments = parser.parse_args()
    if arguments.check:
        check(arguments)
        return
    names = arguments.only or list(SPLITS)
    start, load_start = time.monotonic(), load()
    print(f"load average (1 min) at start: {load_start:.2f}; {os.cpu_count()} CPUs; "
          f"{len(names)} splits of {WORLD} ranks, {arguments.steps} steps each", flush=True)
    rows, failures = [], {}
    for index, name in enumerate(names, 1):
        cfg = config(arguments, SPLITS[name])
        began = time.monotonic()
        print(f"[{index}/{len(names)}] {name} ...", flush=True)
        try:
            with tempfile.TemporaryDirectory() as scratch:
                summary = train(cfg, Path(scratch), validate(cfg))
        except Exception as error:  # report and go on: the table leaves the split out
            failures[name] = f"{type(error).__name__}: {error}"
            print(f"    FAILED after {time.monotonic() - began:.0f} s: {failures[name]}", flush=True)
            continue
        layout, counted = summary["layout"], summary["comm_bytes_per_step"]
        rows.append({"name": name, "split": f"{layout['data']}×{layout['pipeline']}×{layout['tensor']}",
                     "grid": grid(cfg), "bytes": {kind: counted.get(kind, 0) for kind in KINDS},
                     "step": summary["step_time_s_median"], "peak": summary["peak_compute_bytes"],
                     "loss": summary["losses"][0]})
        print(f"    d{layout['data']} × p{layout['pipeline']} × t{layout['tensor']}: "
              f"{sum(counted.get(kind, 0) for kind in KINDS) / 1e6:.3f} MB/step, "
              f"step {summary['step_time_s_median']:.3f} s, first loss {summary['losses'][0]:.5f} "
              f"({time.monotonic() - began:.0f} s, load {load():.2f})", flush=True)
    load_end = load()
    baseline = next((row["step"] for row in rows if row["name"] == "ddp"), None)
    header = (f"{'split':<28}{'d×p×t':>7}{'grid':>7}" + "".join(f"{kind:>15}" for kind in KINDS)
              + f"{'total MB':>10}{'step s':>8}{'vs ddp':>8}{'peak MB':>9}{'first loss':>12}")
    print("\nbytes per step by kind in MB (logical, max over ranks)")
    print(header)
    for row in rows:
        relative = f"{row['step'] / baseline:.2f}" if baseline else "-"
        print(f"{row['name']:<28}{row['split']:>7}{row['grid']:>7}"
              + "".join(f"{row['bytes'][kind] / 1e6:>15.3f}" for kind in KINDS)
              + f"{sum(row['bytes'].values()) / 1e6:>10.3f}{row['step']:>8.3f}{relative:>8}"
              f"{row['peak'] / 1e6:>9.1f}{row['loss']:>12.5f}")
    first = {f"{row['loss']:.5f}" for row in rows}
    print(f"\nfirst losses to 5 decimals: {', '.join(sorted(first))} "
          f"({'all equal' if len(first) == 1 else 'NOT all equal'})")
    for name, error in failures.items():
        print(f"left out: {name}: {error}")
    print(f"load average (1 min) at start {load_start:.2f}, at end {load_end:.2f}; "
          f"wall time {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
