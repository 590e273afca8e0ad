"""A plan on the terminal (the table) and on disk (plan.json, plan.png, plan_memory.png)."""

import json
from pathlib import Path

from cost.inputs import Device
from layerwise.planning.roles import GIB
from strategies.schedule import plot_timeline


def table(result: dict, device: Device) -> str:
    lines = [f"plan: {result['strategy']} × {result['model']} × {result['hardware']} on {result['world_size']} "
             f"devices; predicted step {result['step_time_s']:.3f} s, {result['tokens_per_s']:.0f} tokens/s, "
             f"MFU {result['mfu']:.1%}, bubble {result['bubble_fraction']:.1%} (efficiency "
             f"{result['efficiency_assumed']:.0%} "
             f"{'of the rate mode=calibrate measured' if device.activation_seconds_per_element else 'assumed, not calibrated'})",
             f"{'role':40s} {'params':>8s} {'grads':>8s} {'optim':>8s} {'activ':>8s} {'buffers':>8s} "
             + "".join(f"{kind:>8s} " for kind in _extra_kinds(result)) + f"{'total GiB':>10s} {'device':>7s} fits"]
    for role in result["roles"]:
        b = role["memory_bytes"]
        lines.append(f"{role['role']:40s} " + " ".join(f"{b[k] / GIB:8.2f}" for k in
                     ("parameters", "gradients", "optimizer", "activations", "buffers", *_extra_kinds(result)))
                     + f" {role['peak_with_margin_bytes'] / GIB:10.2f} {device.memory_bytes / GIB:7.1f} "
                     f"{'yes' if role['fits'] else 'NO'}")
    lines += [f"note: {caveat}" for caveat in result.get("caveats", [])]
    if "refresh_interval" in result:  # PipeFisher (layerwise/planning/pipefisher.py)
        lines.append(f"PipeFisher: first-order step {result['step_time_first_order_s']:.3f} s, bubble "
                     f"{result['bubble_fraction_first_order']:.1%} → {result['bubble_fraction']:.1%} with K-FAC packed into "
                     f"a {result['refresh_interval']}-step cycle (K-FAC work / bubble {result['kfac_work_per_bubble']:.2f})")
    return "\n".join(lines)


def caveats(device: Device, tensor_parallel) -> list:
    """What the reader of this plan should know of its accuracy: where ranks outnumber the cores, the
    collectives between them are priced at a table measured with a core per rank, and the 2-D and 3-D
    grids ran slower than predicted on the machine it was checked on (docs/plan.md, "Collectives on
    shared cores")."""
    if device.core_share >= 1:
        return []
    grid = " (this 2-D/3-D grid's most of all)" if tensor_parallel in ("2d", "3d") else ""
    return [f"{1 / device.core_share:.3g} ranks per core: compute is priced time-shared, but collectives between "
            f"ranks that share cores cost more than their price, measured with a core per rank{grid}; predicted steps of such "
            "layouts are the least reliable (docs/plan.md, \"Collectives on shared cores\")"]


def _extra_kinds(result: dict) -> list:
    """Kinds of bytes beyond the five every plan has (PipeFisher's "kfac"), as the roles list them."""
    return [kind for kind in result["roles"][0]["memory_bytes"]
            if kind not in ("parameters", "gradients", "optimizer", "activations", "buffers")]


def _write(result: dict, timeline, directory: Path, device_memory_bytes: float, charts: bool = True) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "plan.json").write_text(json.dumps(result, indent=1))
    if not charts:
        return
    if timeline is not None:  # L2L's relay is priced in closed form: no simulated timeline
        plot_timeline(timeline, directory / "plan.png", title=f"predicted step: {result['strategy']}", time_unit="s")
    _plot_memory(result, directory / "plan_memory.png", device_memory_bytes)


# The device's memory is drawn as a line only when it is at most this many times the largest role (the
# bars then fill a third of the axis or more): further out it squeezed gpt_tiny's 0.04 GiB bars into the
# first pixels of a 7 GiB axis (issue 55); it is then written in the title instead.
CAPACITY_IN_VIEW = 3
UNITS = (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10))


def byte_unit(largest_bytes: float) -> tuple:
    """(name, bytes per unit): the largest binary unit in which `largest_bytes` is at least 1."""
    return next(((name, size) for name, size in UNITS if largest_bytes >= size), ("bytes", 1))


def in_unit(value_bytes: float, unit: tuple) -> str:
    """`value_bytes` in `unit` with three significant figures, whole units from 1000 on ("51.2 MiB",
    "6.75 GiB", "1,210 GiB")."""
    value = value_bytes / unit[1]
    return f"{value:.3g} {unit[0]}" if value < 1000 else f"{value:,.0f} {unit[0]}"


def _plot_memory(result: dict, path: Path, device_memory_bytes: float) -> None:
    """plan_memory.png: memory_figure saved."""
    memory_figure(result, device_memory_bytes).savefig(path, dpi=110)


def memory_figure(result: dict, device_memory_bytes: float):
    """Stacked bars per rank role, one colour per kind, in the unit of the largest role (MiB, GiB);
    the axis ends just past the largest bar, or past the device's memory less the allocator margin
    where that is within CAPACITY_IN_VIEW of it (drawn as a line); further out the title states it."""
    from matplotlib.figure import Figure
    roles_, kinds = result["roles"], list(result["roles"][0]["memory_bytes"])
    largest = max(sum(role["memory_bytes"].values()) for role in roles_)
    capacity = device_memory_bytes / (1 + result["allocator_margin"])
    unit = byte_unit(max(largest, capacity) if capacity <= CAPACITY_IN_VIEW * largest else largest)
    figure = Figure(figsize=(9, 1.5 + 0.45 * len(roles_)), layout="constrained")
    axes = figure.add_subplot()
    for colour, kind in enumerate(kinds):
        lefts = [sum(role["memory_bytes"][k] for k in kinds[:colour]) / unit[1] for role in roles_]
        widths = [role["memory_bytes"][kind] / unit[1] for role in roles_]
        axes.barh(range(len(widths)), widths, left=lefts, color=f"C{colour}", label=kind)
    for row, role in enumerate(roles_):  # each role's total at the end of its bar
        total = sum(role["memory_bytes"].values())
        axes.annotate(f" {in_unit(total, unit)}", (total / unit[1], row), va="center", fontsize=8)
    title = f"plan: {result['strategy']} × {result['model']} on {result['world_size']} devices"
    if capacity <= CAPACITY_IN_VIEW * largest:
        axes.axvline(capacity / unit[1], color="black", linestyle="--", label="device memory less the allocator margin")
        right = max(largest * 1.25, capacity * 1.05)
    else:
        title += (f"\ndevice memory less the allocator margin: {in_unit(capacity, byte_unit(capacity))} "
                  f"(largest role {largest / capacity:.1%} of it; off this axis)")
        right = largest * 1.25  # room for the totals' labels
    axes.set_xlim(0, right / unit[1])
    axes.set_yticks(range(len(roles_)), [role["role"] for role in roles_])
    axes.invert_yaxis()
    axes.set_xlabel(f"{unit[0]} per device")
    axes.set_title(title, fontsize=10)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    return figure
