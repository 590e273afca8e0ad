"""K-FAC vs the first-order optimizer: steps to a target validation loss, each method tuned fairly.

    .venv/bin/python benchmarks/pipefisher_convergence.py [--model bert_tiny --steps 150 --every 10]

Fair by construction (issue 17):
1. each method is tuned by Hydra multiruns of train.py (one process) over its outer optimizers
   (K-FAC: LAMB × `--dampings` {1e-3, 1e-2}, curvature refreshed every `--refresh-interval` = k steps,
   2 by default, PipeFisher's k at the paper's scale; first-order: {AdamW, LAMB}) and a learning-
   rate grid that is WIDENED along the ladder 1e-4 … 1 while the best point sits at its edge, so
   every method's best learning rate is interior (or the ladder's end, reported);
2. the best point of each method runs again with `--seeds` more seeds (3 in all by default);
3. the target is a loss both methods' mean curves reach by `--target-at` (70%) of the budget —
   the larger of the two mean losses there — so neither method's steps-to-target is its whole
   budget by construction; steps to target per seed, their mean and range, and the ratio of the
   means K-FAC / first-order are reported, with seconds (× each method's median step time).
Writes `<out>/report.json` and `--figure` (default docs/strategies/pipefisher_convergence.png: mean curves,
seed range). `compare(args)` is the whole comparison, for layerwise/reproduce/pipefisher.py and the
benchmark's command line (benchmarks/pipefisher_convergence.py).
`--reuse` keeps the points of this very setting an interrupted run completed under `--out`.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from matplotlib.figure import Figure
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
LADDER = ["1e-4", "3e-4", "1e-3", "3e-3", "1e-2", "3e-2", "1e-1", "3e-1", "1"]
# Each method is tuned over its outer optimizers and, for K-FAC, damping: comparing K-FAC+LAMB with
# plain AdamW alone would mix the preconditioner with the outer optimizer.
# K-FAC's outer optimizer is LAMB alone: on this CPU a K-FAC step costs ~5× a first-order one, and a
# 12-point sweep over {LAMB, momentum SGD} (docs/strategies/pipefisher.md, gpt_tiny) found LAMB best.
METHODS = {"kfac": ["strategy=kfac", "optimizer=lamb"],
           "first_order": ["strategy=single", "optimizer=adamw,lamb"]}


def method_overrides(method: str, args, values: list = None) -> list:
    """The method's tuned overrides; K-FAC refreshes its curvature every `--refresh-interval` steps,
    PipeFisher's k (2 for GPipe and 1F1B at the paper's scale: the packing needs two steps' bubbles),
    so the convergence measured is that of the stale preconditioner PipeFisher actually runs."""
    if method == "kfac":
        dampings = ",".join(f"{v:g}" for v in values) if values else args.dampings
        return METHODS["kfac"] + [f"strategy.damping={dampings}", f"strategy.refresh_interval={args.refresh_interval}"]
    return METHODS["first_order"][:1] + [f"optimizer={','.join(values)}"] if values else METHODS["first_order"]


def common(args) -> list:
    return [f"model={args.model}", f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={args.every}",
            "trainer.limit_val_batches=4", "optimizer.warmup_steps=5", "logger=none", "trainer.progress=none",
            "trainer.checkpoint_every_n_steps=100000", "resume=false"]


def multirun(overrides: list, directory: Path) -> list:
    """One Hydra multirun; the summaries of its points (a failed point is kept with its status)."""
    subprocess.run([sys.executable, "train.py", "-m", *overrides, f"hydra.sweep.dir={directory}"],
                   cwd=ROOT, check=False)
    return [json.loads(path.read_text()) | {"point": point_of(path.parent)}
            for path in sorted(directory.glob("*/summary.json"))]


def point_of(point_directory: Path) -> dict:
    """What was tuned at this point, from its resolved config (directory names may be shortened)."""
    cfg = OmegaConf.load(point_directory / "config.yaml")
    point = {"optimizer": cfg.optimizer.name, "optimizer.lr": str(cfg.optimizer.lr), "seed": cfg.seed}
    if "damping" in cfg.strategy:
        point["strategy.damping"] = str(cfg.strategy.damping)
    return point


def reused(method: str, args, directory: Path, lrs: list, failed: bool = False) -> list:
    """The points of this very setting in a round's directory, one per learning rate × grid value
    asked: finished ones (with `failed`, an interrupted one where none finished). Without --reuse only a
    fresh run's own points are there; with it, a rerun keeps the points an interrupted run completed."""
    if not args.reuse and not failed:
        return []
    found = {}
    for path in sorted(directory.glob("*/summary.json"), key=lambda path: path.stat().st_mtime):
        summary = json.loads(path.read_text()) | {"point": point_of(path.parent)}
        key = (float(summary["point"]["optimizer.lr"]), grid_value(summary["point"], method))
        wanted = key in {(float(lr), value) for lr in lrs for value in grid(method, args)}
        if wanted and same_setting(OmegaConf.load(path.parent / "config.yaml"), method, args) and \
                (finished(summary) or (failed and not finished(found.get(key, summary)))):
            found[key] = summary
    return list(found.values())


def finished(summary: dict) -> bool:
    """Completed, or failed on its own (e.g. K-FAC diverging at a high learning rate): not interrupted."""
    return usable(summary) or (summary["status"] == "failed" and "SIGTERM" not in str(summary.get("error")))


def same_setting(cfg, method: str, args) -> bool:
    return (cfg.trainer.max_steps == args.steps and cfg.trainer.val_check_interval == args.every
            and cfg.model.name == args.model and cfg.seed not in args.seeds
            and cfg.strategy.name == ("kfac" if method == "kfac" else "single")
            and (method != "kfac" or cfg.strategy.refresh_interval == args.refresh_interval))


def grid(method: str, args) -> set:
    """The values tuned besides the learning rate: K-FAC's damping, the first-order optimizer."""
    return {float(d) for d in args.dampings.split(",")} if method == "kfac" else {"adamw", "lamb"}


def grid_value(point: dict, method: str):
    return float(point["strategy.damping"]) if method == "kfac" else point["optimizer"]


def usable(summary: dict) -> bool:
    loss = summary.get("final_val_loss")
    return summary["status"] == "completed" and loss is not None and loss == loss and loss < float("inf")


def ladder_index(lr: str) -> int:
    return min(range(len(LADDER)), key=lambda i: abs(float(LADDER[i]) - float(lr)))


def tune(method: str, args, directory: Path) -> tuple:
    """(best summary, learning rates tried, every summary): widen the grid while the best is at an edge."""
    lrs, summaries, round_ = [LADDER[ladder_index(lr)] for lr in args.lrs.split(",")], [], 0
    missing = list(lrs)
    while missing:
        round_directory = directory / method / f"round{round_}"
        have = {(float(s["point"]["optimizer.lr"]), grid_value(s["point"], method))
                for s in reused(method, args, round_directory, missing)}
        lacking = [(lr, value) for lr in missing for value in sorted(grid(method, args))
                   if (float(lr), value) not in have]
        if lacking:  # the learning rates and grid values some point lacks (all of them on a fresh run)
            values = sorted({value for _, value in lacking})
            multirun(method_overrides(method, args, values) + common(args) +
                     [f"optimizer.lr={','.join(dict.fromkeys(lr for lr, _ in lacking))}"], round_directory)
        summaries += reused(method, args, round_directory, missing, failed=True)
        best = min(filter(usable, summaries), key=lambda s: s["final_val_loss"])
        indices = sorted(ladder_index(lr) for lr in lrs)
        at = ladder_index(best["point"]["optimizer.lr"])
        missing = ([LADDER[at - 1]] if at == indices[0] and at > 0 else []) + \
                  ([LADDER[at + 1]] if at == indices[-1] and at + 1 < len(LADDER) else [])
        lrs, round_ = lrs + missing, round_ + 1
        print(f"[pipefisher_convergence] {method}: best {best['point']} at {best['final_val_loss']:.4f}; "
              f"{'widening with ' + ','.join(missing) if missing else 'interior: done'}", flush=True)
    return best, sorted(lrs, key=float), summaries


def seeds_of(method: str, best: dict, args, directory: Path) -> list:
    """The best point again with the other seeds; with the tuning run, one summary per seed."""
    point = {k: v for k, v in best["point"].items() if k != "seed"}
    fixed = [o for o in method_overrides(method, args) if not o.startswith(tuple(point))]
    others = multirun(fixed + common(args) + [f"{k}={v}" for k, v in point.items()]
                      + [f"seed={','.join(str(s) for s in args.seeds)}"], directory / method / "seeds")
    return [best] + others


def curve(summary: dict) -> list:
    """(step, validation loss) pairs, the initial evaluation at step 0."""
    points = [(0, summary["initial_val_loss"])]
    return points + sorted((int(step), loss) for step, loss in summary["val_losses"].items())


def mean_curve(runs: list) -> list:
    return [(step, statistics.fmean(curve(run)[i][1] for run in runs)) for i, (step, _) in enumerate(curve(runs[0]))]


def steps_to(points: list, target: float):
    return next((step for step, loss in points if loss <= target), None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--lrs", default="3e-3,1e-2,3e-2", help="the starting grid (widened as needed)")
    parser.add_argument("--seeds", type=int, nargs="*", default=[1, 2], help="more seeds for the best points")
    parser.add_argument("--target-at", type=float, default=0.7, help="fraction of the budget the target is set at")
    parser.add_argument("--model", default="bert_tiny")
    parser.add_argument("--refresh-interval", type=int, default=2, help="K-FAC's k (PipeFisher's, §2)")
    parser.add_argument("--dampings", default="1e-3,1e-2", help="K-FAC's damping grid (§2: 1e-3 and 1e-2)")
    parser.add_argument("--reuse", action="store_true", help="reuse the rounds an interrupted run completed")
    parser.add_argument("--out", default=str(ROOT / "runs" / "pipefisher_convergence"))
    parser.add_argument("--figure", default=str(ROOT / "docs" / "strategies" / "pipefisher_convergence.png"))
    report = compare(parser.parse_args())
    print(json.dumps(report, indent=1))


def compare(args) -> dict:
    """Tune both methods, rerun their best points with more seeds; write report.json and the figure."""
    directory = Path(args.out)
    tuned = {method: tune(method, args, directory) for method in METHODS}
    runs = {method: [s for s in seeds_of(method, best, args, directory) if usable(s)]
            for method, (best, _, _) in tuned.items()}
    report = summarise(args, tuned, runs)
    (directory / "report.json").write_text(json.dumps(report, indent=1))
    plot(runs, report["target_val_loss"], Path(args.figure))
    return report


def summarise(args, tuned: dict, runs: dict) -> dict:
    at = args.target_at * args.steps
    means = {m: mean_curve(r) for m, r in runs.items()}
    target = max(min(means[m], key=lambda p: abs(p[0] - at))[1] for m in runs)
    report = {"model": args.model, "refresh_interval": args.refresh_interval, "budget_steps": args.steps,
              "evaluation_every": args.every, "target_val_loss": target, "target_set_at_step": at}
    for method, (best, lrs, summaries) in tuned.items():
        reached = [steps_to(curve(run), target) for run in runs[method]]
        steps = [args.steps if step is None else step for step in reached]  # not reached: the budget
        step_time = statistics.median(run["step_time_s_median"] for run in runs[method])
        report[method] = {"best_point": {k: v for k, v in best["point"].items() if k != "seed"},
                          "learning_rates_tried": lrs, "points_tuned": len(summaries),
                          "final_val_loss_by_seed": [run["final_val_loss"] for run in runs[method]],
                          "steps_to_target_by_seed": reached, "steps_to_target_mean": statistics.fmean(steps),
                          "step_time_s_median": step_time,
                          "seconds_to_target_mean": statistics.fmean(steps) * step_time}
    first_order, kfac = report["first_order"], report["kfac"]
    report["steps_ratio"] = kfac["steps_to_target_mean"] / first_order["steps_to_target_mean"]
    budgeted = {m: [args.steps if s is None else s for s in report[m]["steps_to_target_by_seed"]] for m in tuned}
    report["steps_ratio_range"] = [min(budgeted["kfac"]) / max(budgeted["first_order"]),
                                   max(budgeted["kfac"]) / min(budgeted["first_order"])]
    report["seconds_ratio"] = kfac["seconds_to_target_mean"] / first_order["seconds_to_target_mean"]
    return report


def plot(runs: dict, target: float, path: Path) -> None:
    figure = Figure(figsize=(6.5, 4), layout="constrained")
    axes = figure.add_subplot()
    for method, method_runs in runs.items():
        steps, losses = zip(*mean_curve(method_runs))
        lowest = [min(curve(run)[i][1] for run in method_runs) for i in range(len(steps))]
        highest = [max(curve(run)[i][1] for run in method_runs) for i in range(len(steps))]
        point = method_runs[0]["point"]
        chosen = ", ".join(f"{k.split('.')[-1]} {v}" for k, v in point.items() if k != "seed")
        axes.plot(steps, losses, marker="o", markersize=3,
                  label=f"{method} ({chosen}), mean of {len(method_runs)} seeds")
        axes.fill_between(steps, lowest, highest, alpha=0.2)
    axes.axhline(target, color="0.5", linestyle="--", label=f"target {target:.3f}")
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("validation loss (nats/token)")
    axes.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
