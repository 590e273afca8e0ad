"""PipeFisher's packing, simulated: K-FAC work / bubble, k, fill and packing efficiency per schedule.

    .venv/bin/python benchmarks/pipefisher_packing.py

The table of layerwise/reproduce/packing.py (FLOP cost model, one BERT-Base block per stage,
p = m = 8), printed, and the GPipe and 1F1B cycles drawn (K-FAC units in magenta) as
docs/strategies/pipefisher_{schedule}_bert_base.png. Pure simulation: seconds on one core.
"""

from pathlib import Path

from layerwise.reproduce.packing import BERT_BASE, SCHEDULES, V100_FP32, packed_cycle, table_rows
from strategies.schedule import plot_timeline
from strategies.schedule import curvature as units

ROOT = Path(__file__).resolve().parent.parent
DRAWN = ("gpipe", "one_f_one_b")


def draw(schedule: str) -> None:
    cost = units.pipefisher_cost(BERT_BASE, flops_per_second=V100_FP32)
    _, cycle = packed_cycle(schedule, SCHEDULES[schedule], cost)
    path = ROOT / "docs" / "strategies" / f"pipefisher_{schedule}_bert_base.png"
    title = (f"PipeFisher {schedule}, BERT-Base block per stage, p = m = 8: k = {cycle.refresh_interval} "
             f"(magenta: K-FAC units; steps laid end to end)")
    plot_timeline(units.cycle_timeline(cycle.plans, cost), path, title=title, time_unit="s (V100 fp32 FLOP model)")
    print(f"wrote {path.relative_to(ROOT)}")


def main() -> None:
    print("| schedule | bubble (plan) | K-FAC work / bubble | k | ceil(ratio) | filled, whole cycle | "
          "filled, steps before the last | packing efficiency | bubble with K-FAC | split in token halves |")
    for r in table_rows():
        print(f"| {r['schedule']} | {r['bubble']:.1%} | {r['ratio']:.2f} | {r['k']} | {r['ceil']} | {r['fill']:.1%} | "
              f"{r['fill_before_last']:.1%} | {r['packing']:.1%} | {r['with_kfac']:.1%} | {r['split']} |")
    for schedule in DRAWN:
        draw(schedule)


if __name__ == "__main__":
    main()
