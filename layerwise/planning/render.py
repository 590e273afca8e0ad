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


def _plot_memory(result: dict, path: Path, device_memory_bytes: float) -> None:
    """Stacked bars per rank role, one colour per kind, and the device's memory as a line."""
    from matplotlib.figure import Figure
    figure = Figure(figsize=(9, 1.5 + 0.45 * len(result["roles"])), layout="constrained")
    axes = figure.add_subplot()
    kinds = list(result["roles"][0]["memory_bytes"])
    for colour, kind in enumerate(kinds):
        lefts = [sum(role["memory_bytes"][k] for k in kinds[:colour]) / GIB for role in result["roles"]]
        widths = [role["memory_bytes"][kind] / GIB for role in result["roles"]]
        axes.barh(range(len(widths)), widths, left=lefts, color=f"C{colour}", label=kind)
    axes.axvline(device_memory_bytes / (1 + result["allocator_margin"]) / GIB, color="black", linestyle="--",
                 label="device memory less the allocator margin")
    axes.set_yticks(range(len(result["roles"])), [role["role"] for role in result["roles"]])
    axes.invert_yaxis()
    axes.set_xlabel("GiB per device")
    axes.set_title(f"plan: {result['strategy']} × {result['model']} on {result['world_size']} devices", fontsize=10)
    axes.legend(loc="lower right", fontsize=8)
    figure.savefig(path, dpi=110)
