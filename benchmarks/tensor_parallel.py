"""1-D (P=8) vs 2-D (P=4) vs 3-D (P=8) tensor parallelism on one model, measured in one run.

    .venv/bin/python benchmarks/tensor_parallel.py [--steps 10] [--hidden 128] [--batch 16]

Prints per-rank logical communication bytes per step (the Communicator's counts, maximum over
ranks, median over steps), parameter bytes per rank (from rank 0's checkpoint shard) and the
median step time relative to 1-D. On this 2-core CPU the times measure process contention more
than the network; the byte counts are the algorithm's (docs/strategies/three_d.md).
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from layerwise.run.fit import train  # noqa: E402
from layerwise.preflight import validate  # noqa: E402
from layerwise.reproduce.measure import overrides  # noqa: E402
from strategies.checkpoint.per_rank import read_checkpoint_file  # noqa: E402
from benchmarks.common import compose_config  # noqa: E402

CASES = [("single", "single", 1), ("1-D", "tp_1d", 8), ("2-D", "tp_2d", 4), ("3-D", "three_d", 8)]


def parameter_bytes(directory: Path) -> int:
    path = directory / "checkpoints" / "last.ckpt"
    path = path / "rank0.pt" if path.is_dir() else path
    state = read_checkpoint_file(path)["state_dict"]
    return sum(t.numel() * t.element_size() for t in state.values())


def measure(arguments, root: Path) -> list:
    rows = []
    for label, strategy, devices in CASES:
        cfg = compose_config(*overrides(arguments, strategy, devices))
        summary = train(cfg, root / strategy, validate(cfg))
        comm = summary["comm_bytes_per_step"]
        rows.append({"label": label, "ranks": devices, "comm": comm, "total": sum(comm.values()),
                     "parameters": parameter_bytes(root / strategy),
                     "step_time": summary["step_time_s_median"], "losses": summary["losses"]})
    return rows


def print_table(rows, arguments) -> None:
    print(f"\nGPT h={arguments.hidden} L={arguments.layers} heads=8 s={arguments.sequence} "
          f"B={arguments.batch}, fp32, {arguments.steps} steps; bytes are per rank per step")
    print(f"{'grid':<7}{'P':>3}{'all_gather':>13}{'reduce_scat':>13}{'all_reduce':>13}{'total':>13}"
          f"{'vs 1-D':>8}{'param B/rank':>14}{'vs single':>10}{'step s':>9}{'vs 1-D':>8}")
    one_d, single = rows[1], rows[0]
    for row in rows:
        comm = row["comm"]
        print(f"{row['label']:<7}{row['ranks']:>3}{comm['all_gather']:>13,.0f}"
              f"{comm['reduce_scatter']:>13,.0f}{comm['all_reduce']:>13,.0f}{row['total']:>13,.0f}"
              f"{row['total'] / one_d['total']:>8.3f}{row['parameters']:>14,}"
              f"{row['parameters'] / single['parameters']:>10.3f}{row['step_time']:>9.3f}"
              f"{row['step_time'] / one_d['step_time']:>8.2f}")
    same = all(torch.allclose(torch.tensor(r["losses"]), torch.tensor(single["losses"]), rtol=1e-5)
               for r in rows)
    print(f"losses equal to single (rtol 1e-5) on every grid: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--sequence", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    arguments = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        print_table(measure(arguments, Path(root)), arguments)


if __name__ == "__main__":
    main()
