"""The one plotter: a Timeline (simulated or measured) as a Gantt chart PNG.

One row per rank; forwards in blues and backwards in oranges, darker for later stages so looping
placement shows as a repeating shade pattern; any other compute kind (K-FAC's curvature and
inversion units) in magentas, shaded the same way; communication in grey; gradient reductions as
green diamonds. Uses matplotlib's object API (no pyplot), so it never changes the global backend.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.lines import Line2D

from .ir import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, REDUCE_GRADIENT
from .simulate import TimedAction, Timeline

# Split backward: I (input gradient) keeps B's oranges, W (weight gradient) is drawn in greens.
_COLOUR_MAPS = {FORWARD: colormaps["Blues"], BACKWARD: colormaps["Oranges"], BACKWARD_INPUT: colormaps["Oranges"],
                BACKWARD_WEIGHT: colormaps["Greens"]}
_OTHER_COMPUTE_MAP = colormaps["RdPu"]  # a pass's own compute kinds (K-FAC units), apart from F/B
_COMMUNICATION_COLOUR, _REDUCE_COLOUR = "0.6", "tab:green"
_FONT_SIZE = 7
_CHARACTER_INCHES = 0.62 * _FONT_SIZE / 72  # rough width of one label character


def plot_timeline(timeline: Timeline, path: str | Path, title: str | None = None, time_unit: str = "s") -> Path:
    """Draw `timeline` as a Gantt chart PNG at `path` and return the path.

    Boxes wide enough carry the compact action string; the title gives makespan and bubble fraction.
    """
    stages = 1 + max((record.action.stage for row in timeline.ranks for record in row), default=0)
    longest_row = max((sum(r.action.info.is_compute for r in row) for row in timeline.ranks), default=1)
    figure = Figure(figsize=(min(28.0, max(9.0, 0.3 * longest_row)), 1.9 + 0.5 * len(timeline.ranks)),
                    layout="constrained")
    axes = figure.add_subplot()
    inches_per_time = 0.92 * figure.get_figwidth() / (timeline.makespan or 1.0)
    for rank, row in enumerate(timeline.ranks):
        _draw_row(axes, rank, row, stages, inches_per_time)
    _decorate(axes, timeline, title, time_unit)
    figure.savefig(path, dpi=110)
    return Path(path)


def _draw_row(axes, rank: int, row, stages: int, inches_per_time: float) -> None:
    """One rank's actions: boxes for compute (tall) and timed communication (short), diamonds for
    reductions. Boxes of one height are drawn in one call: a plan of thousands of actions (plan
    mode at full scale) would take seconds with one artist per box."""
    boxes = {0.8: ([], []), 0.35: ([], [])}  # height -> (x ranges, colours)
    diamonds = []
    for record in row:
        action, width = record.action, record.end - record.start
        if action.kind == REDUCE_GRADIENT:
            diamonds.append(record.start + width / 2)
            continue
        if width <= 0:
            continue  # an instantaneous transfer (unit cost): nothing to see
        shade = 0.35 + 0.5 * action.stage / max(stages - 1, 1)
        ranges, colours = boxes[0.8 if action.info.is_compute else 0.35]
        ranges.append((record.start, width))
        colours.append(_colour(action, shade))
        _label(axes, rank, record, shade, inches_per_time)
    for height, (ranges, colours) in boxes.items():
        if ranges:
            axes.broken_barh(ranges, (rank - height / 2, height), facecolors=colours, edgecolor="white",
                             linewidth=0.6)
    if diamonds:
        axes.plot(diamonds, [rank - 0.3] * len(diamonds), marker="D", markersize=5, linestyle="",
                  color=_REDUCE_COLOUR, zorder=3)


def _label(axes, rank: int, record: TimedAction, shade: float, inches_per_time: float) -> None:
    """The compact action string, where the box is wide enough to hold it."""
    action, width, label = record.action, record.end - record.start, str(record.action)
    if width * inches_per_time >= len(label) * _CHARACTER_INCHES + 0.04:
        axes.text(record.start + width / 2, rank, label, ha="center", va="center", fontsize=_FONT_SIZE,
                  color="white" if shade > 0.6 and action.info.is_compute else "black", zorder=4)


def _colour(action, shade: float):
    """Blues / oranges for F / B, magentas for other compute (by the kind's `is_compute`), grey otherwise."""
    if action.kind in _COLOUR_MAPS:
        return _COLOUR_MAPS[action.kind](shade)
    return _OTHER_COMPUTE_MAP(shade) if action.info.is_compute else _COMMUNICATION_COLOUR


def _is_other_compute(action) -> bool:
    return action.info.is_compute and action.kind not in _COLOUR_MAPS


def _decorate(axes, timeline: Timeline, title: str | None, time_unit: str) -> None:
    ranks = len(timeline.ranks)
    axes.set_yticks(range(ranks), [f"rank {rank}" for rank in range(ranks)])
    axes.set_ylim(ranks - 0.5, -0.5)  # rank 0 on top, as in the papers' figures
    axes.set_xlim(0, 1.01 * (timeline.makespan or 1.0))  # room for a reduction diamond at the very end
    axes.set_xlabel(f"time ({time_unit})")
    axes.grid(axis="x", linewidth=0.3, alpha=0.5)
    summary = (f"makespan {timeline.makespan:.4g} {time_unit}, ideal {timeline.ideal:.4g}, "
               f"bubble {timeline.bubble_fraction:.1%}")
    axes.set_title(f"{title or timeline.name or 'schedule'}\n{summary}", fontsize=10)
    other = any(_is_other_compute(record.action) for row in timeline.ranks for record in row)
    split = any(record.action.kind == BACKWARD_WEIGHT for row in timeline.ranks for record in row)
    handles = _legend_handles(other, split)
    axes.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.12 / ranks),
                ncol=len(handles) if not split else 3, fontsize=8, frameon=False)


def _legend_handles(other_compute: bool, split_backward: bool = False) -> list:
    """The legend; the magenta entry only when the timeline has such units, the W entry only for a split
    backward (legends of F/B plans unchanged)."""
    other = [Patch(color=_OTHER_COMPUTE_MAP(0.6), label="K-FAC / other compute")] if other_compute else []
    backward = "I: input gradient" if split_backward else "backward"
    weight = [Patch(color=_COLOUR_MAPS[BACKWARD_WEIGHT](0.6), label="W: weight gradient")] if split_backward else []
    return [Patch(color=_COLOUR_MAPS[FORWARD](0.6), label="forward (darker = later stage)"),
            Patch(color=_COLOUR_MAPS[BACKWARD](0.6), label=f"{backward} (darker = later stage)"), *weight, *other,
            Patch(color=_COMMUNICATION_COLOUR, label="communication"),
            Line2D([], [], marker="D", linestyle="", color=_REDUCE_COLOUR, label="gradient reduction")]
