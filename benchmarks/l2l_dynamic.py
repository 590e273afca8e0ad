"""L2L's dynamic architectures (issue 34; docs/results/l2l.md, "Dynamic architectures"), measured.

    .venv/bin/python benchmarks/l2l_dynamic.py layer_drop      # bytes, step time, peak against p (~4 min here)
    .venv/bin/python benchmarks/l2l_dynamic.py growth --seeds 3  # 4 -> 8 -> 16 vs 16 blocks (4-8 min a seed here)

1. LayerDrop: the relay alone (strategies/l2l.py `Relay`, AdamW on the host), 16 blocks × 128, batch
   8 × 64 tokens, m = 2, fp32, both variants, p ∈ {0, 0.25, 0.5}; each step draws the mask of
   (seed 0, step). Per step: the counted host<->device bytes against the formula
   3·4·(P − the dropped blocks' parameters) (+ the constant variant's stash, 5·(L_kept + 1)·B·s·h·4),
   the compute-side peak (parallel.memory's meter) and the wall time.
2. Growth: train.py's `single` on the stdlib corpus, a 64-wide GPT grown 4 -> 8 -> 16 blocks (grow_by=0
   doubles: Gong et al.'s stacking) at steps 100 and 200, against 16 blocks from the start, 300 steps
   of the same batches each (the same token budget): training loss by step and validation loss.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from layerwise.run.optim import build_optimizer  # noqa: E402
from models import build_model, layer_drop_mask  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from parallel.comm import Communicator, Group  # noqa: E402
from parallel.memory import ComputeMemoryMeter  # noqa: E402
from strategies.l2l import Relay  # noqa: E402

ADAMW = OmegaConf.create(dict(name="adamw", lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8))


def relay_step_bytes(layers, hidden, batch, sequence, micro_batches, constant, p, steps=8):
    """{bytes, formula, peak, seconds} of `steps` relay steps (after one warm-up) under LayerDrop p."""
    model = build_model("gpt", vocab_size=256, sequence_length=sequence, layers=layers, hidden=hidden, heads=4,
                        mlp_ratio=4, dropout=0.1, seed=0)
    communicator = Communicator()
    relay = Relay(model, build_optimizer(ADAMW, model.named_parameters()), communicator, Group("data", (0,)),
                  micro_batches, constant_memory=constant)
    total = sum(parameter.numel() for parameter in model.parameters())
    block = sum(parameter.numel() for parameter in model.blocks["0"].parameters())
    generator = torch.Generator().manual_seed(0)
    rows = []
    for step in range(steps + 1):
        dropped = layer_drop_mask(0, step, layers, p)
        model.drop_blocks(dropped)
        tokens = torch.randint(0, 256, (batch, sequence), generator=generator)
        relay.store.optimizer.zero_grad(set_to_none=True)
        communicator.reset()
        meter = ComputeMemoryMeter()
        start = time.perf_counter()
        with meter:
            relay.step(tokens, tokens)
        seconds = time.perf_counter() - start
        formula = 3 * 4 * (total - len(dropped) * block)
        if constant:
            formula += 5 * (layers - len(dropped) + 1) * batch * sequence * hidden * 4
        if step > 0:  # the first step creates the optimizer state
            rows.append(dict(dropped=len(dropped), bytes=communicator.snapshot()["host_device"], formula=formula,
                             peak=meter.peak_bytes, seconds=seconds))
    relay.close()
    return rows


def layer_drop_table(layers=16, hidden=128, batch=8, sequence=64, micro_batches=2):
    print(f"\n## LayerDrop under l2l: {layers} blocks × {hidden}, batch {batch} × {sequence}, m = {micro_batches}, "
          f"fp32, 8 steps each (masks of seed 0, steps 1-8)")
    print("| variant | p | blocks dropped per step (mean) | host<->device MiB per step (mean) | = formula every step | "
          "/ p = 0 | peak MiB (max over steps) | step time s (median; loaded machine) |")
    print("|---|---:|---:|---:|---|---:|---:|---:|")
    for constant in (False, True):
        base = None
        for p in (0.0, 0.25, 0.5):
            rows = relay_step_bytes(layers, hidden, batch, sequence, micro_batches, constant, p)
            mean_bytes = statistics.mean(row["bytes"] for row in rows)
            base = base or mean_bytes
            print(f"| {'constant' if constant else 'standard'} | {p} | "
                  f"{statistics.mean(row['dropped'] for row in rows):.2f} | {mean_bytes / 2**20:.3f} | "
                  f"{all(row['bytes'] == row['formula'] for row in rows)} | {mean_bytes / base:.3f} | "
                  f"{max(row['peak'] for row in rows) / 2**20:.3f} | "
                  f"{statistics.median(row['seconds'] for row in rows):.3f} |", flush=True)


def growth_run(directory, seed, grown: bool, steps=300):
    from layerwise.config.store import compose
    from layerwise.preflight import validate
    from layerwise.run.fit import train
    overrides = ["logger=none", "trainer.progress=none", "strategy=single", f"seed={seed}",
                 "data.global_batch_size=16", "data.sequence_length=64", "model.hidden=64", "model.heads=4",
                 "model.dropout=0.0", f"trainer.max_steps={steps}", "trainer.val_check_interval=100",
                 "trainer.limit_val_batches=4", "trainer.checkpoint_every_n_steps=1000"]
    overrides += (["model.layers=4", "strategy.grow_at=[100,200]", "strategy.grow_by=0"] if grown
                  else ["model.layers=16"])
    cfg = compose(overrides)
    name = f"{'grown' if grown else 'deep'}_seed{seed}"
    start = time.perf_counter()
    summary = train(cfg, Path(directory) / name, validate(cfg))
    assert summary["status"] == "completed", summary
    import csv
    with (Path(directory) / name / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    validation = {int(row["step"]): float(row["val_loss"]) for row in rows if row.get("val_loss")}
    return summary["losses"], validation, time.perf_counter() - start


def growth_table(seeds, directory):
    print("\n## Progressive stacking: 4 -> 8 -> 16 blocks (at steps 100, 200) vs 16 from the start, "
          "GPT 64 wide, batch 16 × 64, 300 steps, single, stdlib corpus")
    print("| seed | model | train loss, mean of steps 91-100 | 191-200 | 291-300 | val loss @100 | @200 | @300 | "
          "wall s (loaded machine) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    curves = {}
    for seed in seeds:
        for grown in (True, False):
            losses, validation, seconds = growth_run(directory, seed, grown)
            curves[seed, grown] = losses
            windows = [statistics.mean(losses[end - 10:end]) for end in (100, 200, 300)]
            print(f"| {seed} | {'grown 4→8→16' if grown else '16 from start'} | "
                  + " | ".join(f"{value:.4f}" for value in windows) + " | "
                  + " | ".join(f"{validation.get(step, float('nan')):.4f}" for step in (100, 200, 300))
                  + f" | {seconds:.0f} |", flush=True)
    return curves


def plot(curves, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axis = plt.subplots(figsize=(7, 4))
    for (seed, grown), losses in sorted(curves.items()):
        smooth = [statistics.mean(losses[max(0, i - 9):i + 1]) for i in range(len(losses))]
        axis.plot(range(1, len(losses) + 1), smooth, color="C0" if grown else "C1",
                  label=f"{'grown 4→8→16' if grown else '16 from start'} (seed {seed})", alpha=0.8)
    for step in (100, 200):
        axis.axvline(step, color="grey", linewidth=0.5)
    axis.set_xlabel("step (16 × 64 tokens each)")
    axis.set_ylabel("training loss, 10-step mean")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"figure: {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("layer_drop", "growth"))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--figure", default="docs/results/l2l_growth.png")
    parser.add_argument("--curves", default="docs/results/l2l_growth_curves.json")
    arguments = parser.parse_args()
    torch.set_num_threads(1)  # a shared machine: one core per benchmark
    if arguments.part == "layer_drop":
        layer_drop_table()
    else:
        with tempfile.TemporaryDirectory() as directory:
            curves = growth_table(range(1, arguments.seeds + 1), directory)
        Path(arguments.curves).write_text(json.dumps({f"seed{seed} {'grown' if grown else 'deep'}": losses
                                                      for (seed, grown), losses in curves.items()}))
        plot(curves, arguments.figure)


if __name__ == "__main__":
    main()
