"""K-FAC vs the first-order optimizer: steps to a target validation loss, each tuned by a small sweep.

    .venv/bin/python benchmarks/pipefisher_convergence.py [--steps 60 --every 10 --lrs 3e-3,1e-2]

Runs two Hydra multiruns of train.py on the default corpus (gpt_tiny, one process): `strategy=kfac`
over outer optimizers {LAMB, SGD} × damping {1e-3, 1e-2} and `strategy=single` over {AdamW, LAMB},
each over the same learning rates (--lrs) and the same step budget. For each method the best point (lowest final validation loss) is
kept; the target is the worse of the two best final losses (a level both reach); the ratio is
K-FAC's steps to the target over the first-order steps (and the same in seconds). Prints the figures and draws both curves.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

from matplotlib.figure import Figure
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parent.parent
# Each method is tuned over its outer optimizers, learning rates (--lrs) and, for K-FAC, damping:
# comparing K-FAC+LAMB with plain AdamW alone would mix the preconditioner with the outer optimizer.
METHODS = {"kfac": ["strategy=kfac", "optimizer=lamb,sgd", "strategy.damping=1e-3,1e-2",
                    "strategy.refresh_interval=1"],
           "first_order": ["strategy=single", "optimizer=adamw,lamb"]}


def sweep(method: str, args, directory: Path) -> list:
    """One Hydra multirun over the learning rates; the summaries of its points."""
    command = [sys.executable, "train.py", "-m", *METHODS[method], f"optimizer.lr={args.lrs}",
               f"model={args.model}", f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={args.every}",
               "trainer.limit_val_batches=2", "optimizer.warmup_steps=5", "logger=none", "trainer.progress=none",
               f"hydra.sweep.dir={directory / method}", "resume=false"]
    subprocess.run(command, cwd=ROOT, check=True)
    return [json.loads(path.read_text()) | {"point": label(path.parent)}
            for path in sorted((directory / method).glob("*/summary.json"))]


def label(point_directory: Path) -> str:
    """What was tuned at this point, from its resolved config (directory names may be shortened)."""
    cfg = OmegaConf.load(point_directory / "config.yaml")
    tuned = f"optimizer={cfg.optimizer.name},optimizer.lr={cfg.optimizer.lr}"
    return tuned + (f",strategy.damping={cfg.strategy.damping}" if "damping" in cfg.strategy else "")


def curve(summary: dict) -> list:
    """(step, validation loss) pairs, the initial evaluation at step 0."""
    points = [(0, summary["initial_val_loss"])]
    return points + sorted((int(step), loss) for step, loss in summary["val_losses"].items())


def steps_to(points: list, target: float):
    return next((step for step, loss in points if loss <= target), None)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--lrs", default="3e-3,1e-2")
    parser.add_argument("--model", default="gpt_tiny")
    parser.add_argument("--out", default=str(ROOT / "runs" / "pipefisher_convergence"))
    args = parser.parse_args()
    directory = Path(args.out)
    best = {m: min(sweep(m, args, directory), key=lambda s: s["final_val_loss"]) for m in METHODS}
    target = max(s["final_val_loss"] for s in best.values())
    steps = {m: steps_to(curve(s), target) for m, s in best.items()}
    report = {m: {"point": s["point"], "final_val_loss": s["final_val_loss"], "steps_to_target": steps[m],
                  "wall_time_s": s["wall_time_s"], "step_time_s_median": s["step_time_s_median"],
                  "seconds_to_target": steps[m] * s["step_time_s_median"]}
              for m, s in best.items()}
    report["target_val_loss"], report["ratio"] = target, steps["kfac"] / steps["first_order"]
    report["wall_ratio"] = report["kfac"]["seconds_to_target"] / report["first_order"]["seconds_to_target"]
    print(json.dumps(report, indent=1))
    (directory / "report.json").write_text(json.dumps(report, indent=1))
    plot(best, target, ROOT / "docs" / "strategies" / "pipefisher_convergence.png")


def plot(best: dict, target: float, path: Path) -> None:
    figure = Figure(figsize=(6.5, 4), layout="constrained")
    axes = figure.add_subplot()
    for method, summary in best.items():
        steps, losses = zip(*curve(summary))
        chosen = [part for part in summary["point"].split(",")
                  if part.startswith(("optimizer", "strategy.damping"))]
        axes.plot(steps, losses, marker="o", label=f"{method}, " + ", ".join(chosen))
    axes.axhline(target, color="0.5", linestyle="--", label=f"target {target:.3f}")
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("validation loss (nats/token)")
    axes.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
