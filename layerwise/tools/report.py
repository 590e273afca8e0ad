"""A sweep ends with its answer: `sweep_summary.csv` and `sweep_report.md` (a table and plots).

    python train.py -m strategy=modular_pipeline,zero_layered strategy.micro_batches=2,4
        at the end of the multirun (any launcher, also when points failed; a mode=plan sweep:
        its predictions only) the sweep directory gets the report and the launcher prints the
        table (`SweepReport`, a Hydra callback registered under hydra.callbacks in conf/config.yaml)
    python -m layerwise.report SWEEP_DIR                 regenerate one sweep's report
    python -m layerwise.report SWEEP_A SWEEP_B --out DIR  regenerate both and compare them

One row per point: its overrides, status and failure reason, then the measurements its
`summary.json` holds (final validation loss, medians of step time and tokens/s, MFU, peaks,
bytes per step by kind, bubble) and, for the strategies plan mode covers (`layerwise.planning.inputs.PLANNED`),
plan mode's prediction for the point's own config next to them. The same table goes to W&B as one
extra run (`job_type="report"`) in the sweep's group. The run-side half lives here too:
`write_plan_charts` and `log_run_evidence`, which `RunEvidence` calls when a run ends.
"""

import argparse
import atexit
import csv
import json
import os
import sys
from pathlib import Path

from hydra.experimental.callback import Callback

from parallel.comm import KINDS

SUMMARY_VALUES = ["final_val_loss", "step_time_s_median", "tokens_per_s_median", "tokens_per_s_per_device", "mfu",
                  "peak_compute_bytes", "allocator_peak_bytes"]  # copied under their summary.json names
MEASURED = SUMMARY_VALUES + [f"comm_bytes_{kind}" for kind in KINDS] + ["bubble_fraction_simulated",
                                                                         "bubble_fraction_measured"]
# plan mode's figure of the same name, predicted (comm_bytes_per_step: all kinds, the busiest pipeline rank)
PREDICTED = ["predicted_step_time_s", "predicted_peak_compute_bytes", "predicted_bubble_fraction",
             "predicted_comm_bytes_per_step"]
COLUMNS = ["point", "overrides", "strategy", "status", "failure_reason", "steps"] + MEASURED + PREDICTED \
    + ["prediction", "directory"]
SUMMARY_FILE, MARKDOWN_FILE, FIGURE_FILE = "sweep_summary.csv", "sweep_report.md", "sweep_report.png"
MIB = 2 ** 20
FINISHED = ("completed", "planned")  # a point's status when it did its work: trained, or planned (mode=plan)
REASON_LENGTH = 240  # a failure reason in one table cell; the point's summary.json has it all


class NotASweep(ValueError):
    """A directory given as a sweep is not one; the message names it and the fix."""


# ================================================================================ reading a sweep

def point_directories(sweep: Path) -> list:
    """The sweep's point directories (`<n>_<overrides>`, layerwise.config.store.point_directory), by number."""
    sweep = Path(sweep)
    if not sweep.is_dir():
        raise NotASweep(f"{sweep} does not exist or is not a directory. Fix: pass the sweep directory "
                        f"a multirun printed (hydra.sweep.dir, by default runs/multirun/<date>_<time>).")
    points = [p for p in sweep.iterdir() if is_point_directory(p)]
    if not points:
        hint = ("it is one run's directory (it holds summary.json); a sweep is the directory above "
                "its points" if (sweep / "summary.json").exists() else
                "it holds no point directories <n>_<overrides> (Hydra writes multirun.yaml and one per point)")
        raise NotASweep(f"{sweep} is not a sweep directory: {hint}. Fix: pass the directory a "
                        f"`python train.py -m ...` ran in (hydra.sweep.dir, by default runs/multirun/<date>_<time>).")
    return sorted(points, key=lambda p: int(p.name.split("_", 1)[0]))


def is_point_directory(path: Path) -> bool:
    """`<n>_...` holding Hydra's record of the job (.hydra/) or a summary (a Slurm job that failed
    before Hydra ran writes one from the launcher)."""
    number, separator, _ = path.name.partition("_")
    return (path.is_dir() and number.isdigit() and separator == "_"
            and ((path / ".hydra").is_dir() or (path / "summary.json").exists()))


def point_overrides(directory: Path) -> list:
    """The point's overrides as Hydra recorded them (`.hydra/overrides.yaml`)."""
    path = directory / ".hydra" / "overrides.yaml"
    if not path.exists():
        return directory.name.split("_", 1)[1].split(",") if "_" in directory.name else []
    from omegaconf import OmegaConf
    return [str(item) for item in OmegaConf.load(path)]


def read_json(path: Path):
    """The file's object, or None when the point did not write it."""
    return json.loads(path.read_text()) if path.exists() else None


def failure_reason(summary) -> str:
    """The summary's error in one line, or why there is no summary."""
    if summary is None:
        return "no summary.json: the point stopped before its run started (see its train.log)"
    error = summary.get("error") or ""
    lines = [line for line in str(error).splitlines() if line.strip()]
    reason = lines[-1] if lines else ""
    return reason if len(reason) <= REASON_LENGTH else reason[:REASON_LENGTH - 1] + "…"


def measurements(summary: dict) -> dict:
    """The report's measured columns, under the point's summary.json names (docs/evidence.md)."""
    comm = summary.get("comm_bytes_per_step") or {}
    bubble = summary.get("bubble_fraction") or {}
    values = {key: summary.get(key) for key in SUMMARY_VALUES}
    values.update({f"comm_bytes_{kind}": comm.get(kind) for kind in KINDS})
    values.update(bubble_fraction_simulated=bubble.get("simulated"), bubble_fraction_measured=bubble.get("measured"))
    return values


def prediction(cfg, world_size: int) -> dict:
    """Plan mode's analytic prediction for a point's config (layerwise/planning/mode.py, cost/step_time.py):
    step time, bubble, the most bytes a pipeline rank holds (without the allocator margin, as the
    measured compute-side peak counts live tensors) and the most bytes a pipeline rank moves a step."""
    from layerwise.planning.inputs import PLANNED, device_of, training_plan_of, workload_of
    from layerwise.planning.fits import worst_role
    from cost.step_time import predict_step
    if cfg.strategy.name not in PLANNED:
        return {"prediction": f"none: plan mode does not cover strategy={cfg.strategy.name} "
                              f"(layerwise.planning.inputs.PLANNED: {', '.join(PLANNED)})"}
    step = predict_step(workload_of(cfg, world_size), device_of(cfg), training_plan_of(cfg))
    _, breakdown, _ = worst_role(cfg, world_size)
    return {"predicted_step_time_s": step["step_seconds"], "predicted_bubble_fraction": step["bubble_fraction"],
            "predicted_peak_compute_bytes": sum(breakdown.values()),
            "predicted_comm_bytes_per_step": max(sum(rank.values()) for rank in step["bytes_by_rank"]),
            "prediction": prediction_source(cfg)}


def prediction_source(cfg) -> str:
    """Where a point's predicted columns come from (the `prediction` column)."""
    if cfg.hardware.get("matmul_efficiency") is not None:
        return (f"plan mode, hardware={cfg.hardware.name} at its matrix products' measured rate "
                f"(matmul_efficiency={cfg.hardware.matmul_efficiency})")
    relative = cfg.hardware.get("relative_matmul_efficiency", 1.0)
    scaled = f" × relative_matmul_efficiency={relative}" if relative != 1.0 else ""
    return (f"plan mode, hardware={cfg.hardware.name} at plan.efficiency={cfg.plan.efficiency}{scaled} of its peak "
            f"(assumed, not calibrated)")


def planned(directory: Path, cfg) -> dict:
    """A mode=plan point's columns: the plan.json it wrote (layerwise/planning/mode.py), predictions only."""
    result = plan_with_current_names(read_json(directory / "plan.json"))
    if result is None:
        return {"status": "failed", "prediction": "none: the point wrote no plan.json",
                "failure_reason": "no plan.json: the point stopped before its plan was written (see its train.log)"}
    per_rank = result.get("comm_bytes_per_step_by_pipeline_rank") or []  # L2L's relay plan has no pipeline ranks
    return {"status": "planned", "strategy": result["strategy"], "failure_reason": "",
            "predicted_step_time_s": result["step_time_s"], "predicted_bubble_fraction": result["bubble_fraction"],
            # without the allocator margin, as prediction() gives it beside a measurement
            "predicted_peak_compute_bytes": max(sum(role["memory_bytes"].values()) for role in result["roles"]),
            "predicted_comm_bytes_per_step": max((sum(rank.values()) for rank in per_rank), default=None),
            "prediction": prediction_source(cfg)}


# plan.json's names before issue 27 gave it summary.json's vocabulary (docs/evidence.md, "Migration
# (issue 27)"): a run directory written before then still reports.
PLAN_NAMES_BEFORE_27 = {"step_seconds": "step_time_s", "bytes_by_pipeline_rank": "comm_bytes_per_step_by_pipeline_rank",
                        "exposed_data_seconds": "exposed_data_s", "exposed_transfer_seconds": "exposed_transfer_s",
                        "bubble_first_order": "bubble_fraction_first_order",
                        "step_first_order_seconds": "step_time_first_order_s",
                        "step_kfac_no_bubbles_seconds": "step_time_kfac_no_bubbles_s",
                        "preconditioning_seconds": "preconditioning_s"}
ROLE_NAMES_BEFORE_27 = {"bytes": "memory_bytes", "total_bytes": "peak_with_margin_bytes"}


def plan_with_current_names(result):
    """A plan.json's object under today's names, whichever issue wrote it (None stays None)."""
    if result is None:
        return None
    renamed = {PLAN_NAMES_BEFORE_27.get(key, key): value for key, value in result.items()}
    renamed["roles"] = [{ROLE_NAMES_BEFORE_27.get(key, key): value for key, value in role.items()}
                        for role in result.get("roles", [])]
    return renamed


def point_row(directory: Path) -> dict:
    """One point as a row of COLUMNS (empty values where the point did not measure or predict); a
    mode=plan point's row holds its plan's predictions only."""
    summary = read_json(directory / "summary.json")
    row = dict.fromkeys(COLUMNS)
    overrides = point_overrides(directory)
    row.update(point=int(directory.name.split("_", 1)[0]), overrides=" ".join(overrides), override_list=overrides,
               directory=str(directory), status=(summary or {}).get("status", "failed"))
    config_path = directory / "config.yaml"
    if summary is None and config_path.exists():
        from omegaconf import OmegaConf
        cfg = OmegaConf.load(config_path)
        if cfg.mode == "plan":
            row.update({"strategy": cfg.strategy.name, **planned(directory, cfg)})
            return row
    row["failure_reason"] = "" if row["status"] == "completed" else failure_reason(summary)
    if summary is not None:
        row.update(strategy=summary.get("strategy"), steps=summary.get("steps"), **measurements(summary))
    if config_path.exists() and summary is not None and summary.get("world_size"):
        from omegaconf import OmegaConf
        cfg = OmegaConf.load(config_path)
        row["strategy"] = cfg.strategy.name
        try:
            row.update(prediction(cfg, summary["world_size"]))
        except Exception as error:  # noqa: BLE001 - an estimator that rejects a layout must not cost the sweep its table
            row["prediction"] = f"none: plan mode failed on this config: {type(error).__name__}: {error}"
    else:
        row["prediction"] = "none: the point left no config.yaml or world size to plan from"
    return row


def validation_curve(directory: Path) -> list:
    """(step, validation loss) of a point: summary.json's, else metrics.csv's (a failed point's partial file)."""
    summary = read_json(directory / "summary.json") or {}
    points = [(0, summary["initial_val_loss"])] if summary.get("initial_val_loss") is not None else []
    if summary.get("val_losses"):
        return points + sorted((int(step), value) for step, value in summary["val_losses"].items())
    metrics = directory / "metrics.csv"
    if not metrics.exists():
        return points
    with metrics.open() as handle:
        return points + [(int(r["step"]), float(r["val_loss"])) for r in csv.DictReader(handle) if r.get("val_loss")]


# ================================================================================ writing the answer

def finished(rows: list) -> str:
    """`5 of 6 points completed`, or `planned` for a mode=plan sweep (its points predict only)."""
    verb = "planned" if any(row["status"] == "planned" for row in rows) else "completed"
    return f"{sum(row['status'] in FINISHED for row in rows)} of {len(rows)} points {verb}"


def varying_overrides(rows: list) -> tuple:
    """(overrides every point shares, each point's own ones): the label of a point is what differs."""
    lists = [row["override_list"] for row in rows]
    shared = [o for o in lists[0] if all(o in other for other in lists)] if len(lists) > 1 else []
    return shared, [" ".join(o for o in own if o not in shared) or "(no overrides)" for own in lists]


def write_csv(rows: list, path: Path, extra: tuple = ()) -> None:
    """The rows with their raw values, COLUMNS after the `extra` ones (a comparison's `sweep`)."""
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(extra) + COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def formatted(rows: list, labels: list) -> tuple:
    """(headers, cells): the columns a reader compares, in readable units (the CSV keeps raw values)."""
    def number(value, scale=1.0, digits=3):
        return "" if value is None else f"{value / scale:.{digits}f}"
    headers = ["#", "point", "status", "val loss", "step ms", "pred. ms", "tokens/s", "tok/s/dev", "MFU %",
               "peak MiB", "pred. MiB", "alloc MiB", "MiB/step", "pred. MiB/step", "bubble sim/meas/pred"]
    cells = []
    for row, label in zip(rows, labels):
        moved = [row[f"comm_bytes_{kind}"] for kind in KINDS if row[f"comm_bytes_{kind}"] is not None]
        bubbles = [row["bubble_fraction_simulated"], row["bubble_fraction_measured"], row["predicted_bubble_fraction"]]
        cells.append([str(row["point"]), label, row["status"], number(row["final_val_loss"], digits=4),
                      number(row["step_time_s_median"], 1e-3, 1), number(row["predicted_step_time_s"], 1e-3, 1),
                      number(row["tokens_per_s_median"], digits=0), number(row["tokens_per_s_per_device"], digits=0),
                      number(row["mfu"], 1e-2, 2), number(row["peak_compute_bytes"], MIB, 2),
                      number(row["predicted_peak_compute_bytes"], MIB, 2), number(row["allocator_peak_bytes"], MIB, 2),
                      number(sum(moved), MIB, 3) if moved else "", number(row["predicted_comm_bytes_per_step"], MIB, 3),
                      "/".join(number(b, digits=2) or "–" for b in bubbles) if any(b is not None for b in bubbles)
                      else ""])
    return headers, cells


def text_table(headers: list, cells: list) -> str:
    """Left-aligned columns for the terminal."""
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths)) for cell in cells]
    return "\n".join(line.rstrip() for line in lines)


def markdown_table(headers: list, cells: list) -> str:
    """A GitHub-flavoured Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(c.replace("|", "\\|") for c in cell) + " |" for cell in cells])


def write_markdown(title: str, rows: list, labels: list, shared: list, path: Path) -> None:
    """sweep_report.md: the counts, the table, where predictions come from, failures, the figure."""
    headers, cells = formatted(rows, labels)
    failed = [f"- #{row['point']} ({label}): {row['status']}: {row['failure_reason']}"
              for row, label in zip(rows, labels) if row["status"] not in FINISHED]
    notes = sorted({row["prediction"] for row in rows if row["prediction"]})
    text = [f"# {title}", "", f"{finished(rows)}. "
            f"Every point: `{' '.join(shared) or '(no shared overrides)'}`.", "",
            markdown_table(headers, cells), "",
            "Measured: medians over the steps of each point's `summary.json` (step time is the slowest "
            "rank's; MiB/step: logical bytes per rank per step, all kinds). `pred.`: plan mode's analytic "
            "prediction for the point's config; empty where there is none:", ""]
    text += [f"- {note}" for note in notes] + [""]
    if any(row["status"] == "planned" for row in rows):
        text += ["`planned`: a mode=plan point, nothing trained: its row holds the predictions of the "
                 "`plan.json` it wrote, no measurement.", ""]
    if failed:
        text += ["Failed points:", ""] + failed + [""]
    text += [f"![validation loss, step time, memory, bytes, predicted vs measured]({FIGURE_FILE})", "",
             f"All columns, raw values: [`{SUMMARY_FILE}`]({SUMMARY_FILE}).", ""]
    path.write_text("\n".join(text))


def plot(rows: list, labels: list, curves: list, path: Path, title: str) -> Path:
    """One figure: validation-loss curves of all points; bars of step time, memory and bytes per
    point; predicted vs measured step time and memory."""
    from matplotlib.figure import Figure
    figure = Figure(figsize=(14, 13), layout="constrained")
    figure.suptitle(title, fontsize=11)
    grid = figure.subplots(3, 2)
    ticks = [f"#{row['point']}\n" + "\n".join(map(short_override, label.split())) for row, label in zip(rows, labels)]
    _plot_curves(grid[0][0], curves, [f"#{row['point']} {label}" for row, label in zip(rows, labels)])
    _bars(grid[0][1], ticks, {"step time (median)": [_scaled(r["step_time_s_median"], 1e-3) for r in rows]},
          "ms per step", "step time")
    _bars(grid[1][0], ticks, {"compute-side peak": [_scaled(r["peak_compute_bytes"], MIB) for r in rows],
                              "allocator peak (CUDA)": [_scaled(r["allocator_peak_bytes"], MIB) for r in rows]},
          "MiB (max over ranks)", "memory")
    _stacked(grid[1][1], ticks, {kind: [_scaled(r[f"comm_bytes_{kind}"], MIB) for r in rows] for kind in KINDS},
             "MiB per rank per step", "bytes per step by kind")
    _bars(grid[2][0], ticks, {"measured": [_scaled(r["step_time_s_median"], 1e-3) for r in rows],
                              "plan mode": [_scaled(r["predicted_step_time_s"], 1e-3) for r in rows]},
          "ms per step", "step time: predicted vs measured (no bar: not planned)")
    _bars(grid[2][1], ticks, {"measured compute-side peak": [_scaled(r["peak_compute_bytes"], MIB) for r in rows],
                              "plan mode (busiest pipeline rank)": [_scaled(r["predicted_peak_compute_bytes"], MIB)
                                                                    for r in rows]},
          "MiB", "memory: predicted vs measured (no bar: not planned)")
    figure.savefig(path, dpi=80)
    return path


def plot_predictions(rows: list, labels: list, path: Path, title: str) -> Path:
    """A mode=plan sweep's figure: plan mode's predicted step time, memory, bytes and bubble per point."""
    from matplotlib.figure import Figure
    figure = Figure(figsize=(14, 9), layout="constrained")
    figure.suptitle(f"{title}: plan mode's predictions (nothing run)", fontsize=11)
    grid = figure.subplots(2, 2)
    ticks = [f"#{row['point']}\n" + "\n".join(map(short_override, label.split())) for row, label in zip(rows, labels)]
    panels = ((grid[0][0], "predicted_step_time_s", 1e-3, "ms per step", "predicted step time"),
              (grid[0][1], "predicted_peak_compute_bytes", MIB, "MiB", "predicted memory (busiest pipeline rank)"),
              (grid[1][0], "predicted_comm_bytes_per_step", MIB, "MiB per rank per step", "predicted bytes per step"),
              (grid[1][1], "predicted_bubble_fraction", 1e-2, "% of the step", "predicted bubble"))
    for axes, column, scale, unit, name in panels:
        _bars(axes, ticks, {name: [_scaled(row[column], scale) for row in rows]}, unit, name)
    figure.savefig(path, dpi=80)
    return path


def short_override(override: str) -> str:
    """`strategy=zero_layered` -> `zero_layered`, `strategy.micro_batches=2` -> `micro_batches=2`:
    a bar's label under the chart, where the full override would overlap its neighbours."""
    key, equals, value = override.partition("=")
    if not equals:
        return override
    return value if "." not in key else f"{key.rsplit('.', 1)[1]}={value}"


def _scaled(value, scale):
    return None if value is None else value / scale


def _plot_curves(axes, curves: list, names: list) -> None:
    for index, (curve, name) in enumerate(zip(curves, names)):
        if curve:
            steps, losses = zip(*curve)
            axes.plot(steps, losses, marker="o", markersize=3, color=f"C{index % 10}",
                      linestyle=("-", "--", ":", "-.")[index // 10 % 4], label=name)
    axes.set_xlabel("step")
    axes.set_ylabel("validation loss (nats/token)")
    drawn = [curve for curve in curves if curve]
    # strategies tested equal to the reference draw one line (fp32 summation order moves the 7th
    # digit): say so, or the legend looks wrong
    same = len(drawn) > 1 and all(len(curve) == len(drawn[0]) and all(
        step == first_step and abs(loss - first_loss) <= 1e-5 * abs(first_loss)
        for (step, loss), (first_step, first_loss) in zip(curve, drawn[0])) for curve in drawn)
    axes.set_title("validation loss" + (" (all points within 1e-5: one line)" if same else ""))
    if any(curves):
        axes.legend(fontsize=7)


def _bars(axes, ticks: list, series: dict, unit: str, title: str) -> None:
    """Grouped bars, one group per point; a missing value draws no bar."""
    width, drawn = 0.8 / len(series), False
    for index, (name, values) in enumerate(series.items()):
        positions = [i + (index - (len(series) - 1) / 2) * width for i in range(len(ticks))]
        present = [(x, v) for x, v in zip(positions, values) if v is not None]
        if present:
            axes.bar(*zip(*present), width=width, color=f"C{index}", label=name)
            drawn = True
    # a mode=plan sweep measured nothing: a chart of measurements alone stays empty, without a legend
    _finish_bars(axes, ticks, unit, title, legend=len(series) > 1 and drawn)


def _stacked(axes, ticks: list, series: dict, unit: str, title: str) -> None:
    bottoms = [0.0] * len(ticks)
    for index, (name, values) in enumerate(series.items()):
        heights = [v or 0.0 for v in values]
        if any(heights):
            axes.bar(range(len(ticks)), heights, bottom=bottoms, color=f"C{index}", label=name)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    _finish_bars(axes, ticks, unit, title, legend=any(bottoms))


def _finish_bars(axes, ticks: list, unit: str, title: str, legend: bool) -> None:
    axes.set_xticks(range(len(ticks)), ticks, fontsize=7)
    axes.set_ylabel(unit)
    axes.set_title(title)
    if legend:
        axes.set_ylim(top=axes.get_ylim()[1] * 1.3)  # room for the legend above the bars
        axes.legend(fontsize=8, loc="upper left", ncols=3)


def write_report(sweep: Path) -> list:
    """Write sweep_summary.csv, sweep_report.png and sweep_report.md in the sweep; returns the rows."""
    sweep = Path(sweep)
    directories = point_directories(sweep)
    rows = [point_row(directory) for directory in directories]
    shared, labels = varying_overrides(rows)
    write_csv(rows, sweep / SUMMARY_FILE)
    title = f"sweep {sweep.name}"
    if predictions_only(rows):
        plot_predictions(rows, labels, sweep / FIGURE_FILE, title)
    else:
        plot(rows, labels, [validation_curve(d) for d in directories], sweep / FIGURE_FILE, title)
    write_markdown(title, rows, labels, shared, sweep / MARKDOWN_FILE)
    return rows


def predictions_only(rows: list) -> bool:
    """A mode=plan sweep: points planned, none trained (so none measured)."""
    return any(row["status"] == "planned" for row in rows) and all(row["steps"] is None for row in rows)


def compare(sweeps: list, out: Path) -> list:
    """Several sweeps side by side: their rows (with a `sweep` column) in one table and one figure."""
    out.mkdir(parents=True, exist_ok=True)
    rows, curves = [], []
    for sweep in sweeps:
        directories = point_directories(sweep)
        rows += [{"sweep": Path(sweep).name, **point_row(d)} for d in directories]
        curves += [validation_curve(d) for d in directories]
    shared, labels = varying_overrides(rows)
    labels = [f"{row['sweep']}: {label}" for row, label in zip(rows, labels)]
    write_csv(rows, out / SUMMARY_FILE, extra=("sweep",))
    title = "sweeps " + ", ".join(Path(s).name for s in sweeps)
    plot(rows, labels, curves, out / FIGURE_FILE, title)
    write_markdown(title, rows, labels, shared, out / MARKDOWN_FILE)
    return rows


def print_table(rows: list, title: str) -> None:
    """The table on the terminal, under a [layerwise] title line."""
    _, labels = varying_overrides(rows)
    print(f"[layerwise] {title}\n" + text_table(*formatted(rows, labels)), flush=True)


# ================================================================================ W&B and TensorBoard

def wandb_settings(rows: list):
    """(logger config, mode) of the sweep's points when they logged to W&B, else None (mode=plan
    points log nothing)."""
    from omegaconf import OmegaConf
    for row in rows:
        path = Path(row["directory"]) / "config.yaml"
        if path.exists():
            cfg = OmegaConf.load(path)
            if cfg.mode == "plan":
                continue
            logger = cfg.logger
            mode = os.environ.get("WANDB_MODE") or logger.mode
            return (logger, mode) if logger.name == "wandb" and mode != "disabled" else None
    return None


def log_report_to_wandb(sweep: Path, rows: list) -> Path:
    """One extra W&B run of job_type="report" in the sweep's group: the table and the figure, so
    the group opens on the answer. Returns its directory (None when the points did not use W&B)."""
    settings = wandb_settings(rows)
    if settings is None:
        return None
    import wandb
    logger, mode = settings
    group = logger.group or Path(sweep).name
    run = wandb.init(dir=str(sweep), project=logger.project, entity=logger.entity, group=group,
                     job_type="report", name=f"{group}-report", mode=mode,
                     config={"sweep_directory": str(sweep), "points": len(rows)})
    try:
        table = wandb.Table(columns=COLUMNS, data=[[row[c] for c in COLUMNS] for row in rows], allow_mixed_types=True)
        run.log({"sweep_summary": table, "sweep_report": wandb.Image(str(Path(sweep) / FIGURE_FILE))})
        run.summary.update({"points": len(rows),
                            "completed": sum(row["status"] == "completed" for row in rows)})
        return Path(run.dir).parent
    finally:
        run.finish()


# ================================================================================ the hooks

class SweepReport(Callback):
    """Hydra callback: at the end of a multirun, the report in the sweep directory, its table on the
    terminal and its W&B run. A failed point makes Hydra's sweeper raise before `on_multirun_end`,
    so the same work is registered at exit too (done once, in the launching process only)."""

    def __init__(self):
        self.sweep, self.process, self.done = None, None, False

    def on_multirun_start(self, config, **kwargs) -> None:
        if config.get("mode", "fit") not in ("fit", "plan"):  # a dry sweep (mode=check) runs no point
            return
        self.sweep, self.process = Path(str(config.hydra.sweep.dir)), os.getpid()
        atexit.register(self._at_exit)

    def on_multirun_end(self, config, **kwargs) -> None:
        self.finish()

    def _at_exit(self) -> None:
        if os.getpid() == self.process:  # never in a forked rank (they leave with os._exit anyway)
            self.finish()

    def finish(self) -> None:
        """Write, print and log the report once; nothing when no point got a directory."""
        if self.done or self.sweep is None:
            return
        self.done = True
        try:
            rows = write_report(self.sweep)
        except NotASweep:  # the sweep was refused before any point ran
            return
        print_table(rows, f"sweep {self.sweep}: {finished(rows)}; {self.sweep / MARKDOWN_FILE}")
        log_report_to_wandb(self.sweep, rows)


def main(argv=None) -> int:
    """python -m layerwise.report SWEEP_DIR [SWEEP_DIR...] [--out DIR] [--wandb]"""
    parser = argparse.ArgumentParser(prog="python -m layerwise.report", description=__doc__.split("\n")[0])
    parser.add_argument("sweeps", nargs="+", type=Path, help="sweep directories (hydra.sweep.dir of a multirun)")
    parser.add_argument("--out", type=Path, default=Path("sweep_comparison"),
                        help="where the comparison of several sweeps goes (default: ./sweep_comparison)")
    parser.add_argument("--wandb", action="store_true", help="also log each sweep's report run to W&B")
    arguments = parser.parse_args(argv)
    try:
        for sweep in arguments.sweeps:
            rows = write_report(sweep)
            print_table(rows, f"sweep {sweep}: {sweep / MARKDOWN_FILE}")
            if arguments.wandb:
                log_report_to_wandb(sweep, rows)
        if len(arguments.sweeps) > 1:
            rows = compare(arguments.sweeps, arguments.out)
            print(f"[layerwise] comparison of {len(arguments.sweeps)} sweeps: {arguments.out / MARKDOWN_FILE}")
    except NotASweep as error:
        print(f"layerwise.tools.report: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
