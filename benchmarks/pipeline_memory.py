"""Pipeline rank 0's peak memory at m = 16 against m = 4, same micro-batch: measured and planned.

    .venv/bin/python benchmarks/pipeline_memory.py [--only one_f_one_b ...] [--micro-batches 4 16]

Issue 28 item 3. One wide block per stage (hidden 256, 512 tokens, one sequence per micro-batch:
a boundary message is 512 KiB, a sixteenth of what the block saves per micro-batch), two pipeline
ranks; `interleaved_1f1b` holds two such stages per rank (v = 2). The global batch grows with m,
so 1F1B and interleaved 1F1B should keep at most ~p micro-batches in flight whatever m
(Narayanan et al. 2021, §2.2), and GPipe must grow: it runs every forward before any backward.

Each column is a real measurement or the plan, on the same config:
- measured: both ranks run setup and two training steps on gloo (`layerwise.tools.dry_run.one_rank_step`,
  the dry run's per-rank reference), and pipeline rank 0's second-step peak is read from the
  compute-side meter set up as RunEvidence sets it up (summary.json `peak_compute_bytes` is the
  maximum over ranks of the same meter); `held` is the most sends StageWork held at once;
- held to the end: the same run with no send released before FINISH (`send_releases` patched to
  prove nothing; gloo's sends never complete before `wait()`): the executor before issue 28;
- planned: `layerwise.planning.result.plan_result`, the role of pipeline rank 0 before the allocator margin.
"""

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("WANDB_MODE", "disabled")

from layerwise.tools.dry_run import one_rank_step  # noqa: E402
from layerwise.run.launch import run_ranks  # noqa: E402
from layerwise.planning.result import plan_result  # noqa: E402
from layerwise.preflight import validate  # noqa: E402
from benchmarks.common import compose_config  # noqa: E402

MIB = 2 ** 20
SHAPE = ["logger=none", "trainer.progress=none", "model.hidden=256", "model.heads=4", "data.sequence_length=512",
         "model.max_sequence_length=512",
         "model.dropout=0.0", "hardware.devices_per_node=2", "data.max_bytes=2000000"]
SCHEDULES = {  # strategy -> its one-wide-block-per-stage layout on two pipeline ranks
    "gpipe": ["strategy=gpipe", "model.layers=2", "strategy.layers_per_stage=1"],
    "one_f_one_b": ["strategy=one_f_one_b", "model.layers=2", "strategy.layers_per_stage=1"],
    "interleaved_1f1b": ["strategy=interleaved_1f1b", "model.layers=4", "strategy.layers_per_stage=1"],
}


def config(schedule: str, micro_batches: int):
    """One sequence per micro-batch: the global batch is m sequences."""
    return compose_config(*SHAPE, *SCHEDULES[schedule], f"strategy.micro_batches={micro_batches}",
                          f"data.global_batch_size={micro_batches}")


def measured_rank(rank: int, cfg, hold_sends: bool) -> dict:
    """This rank's second-step peak and the most sends its StageWork held (one_rank_step's steps)."""
    from strategies import modular_pipeline
    from strategies.stages import StageWork
    if hold_sends:  # nothing proven: every send waits for FINISH, as before issue 28
        modular_pipeline.send_releases = lambda plan: defaultdict(dict)
    held, finish = [], StageWork.finish

    def recording_finish(work):
        held.append(work.state.most_held)
        finish(work)
    StageWork.finish = recording_finish
    result = one_rank_step(cfg, int(os.environ["WORLD_SIZE"]))
    return {"peak": result["peak_compute_bytes"], "held": max(held)}


def measure(schedule: str, micro_batches: int, hold_sends: bool = False) -> dict:
    cfg = config(schedule, micro_batches)
    ranks = run_ranks(measured_rank, validate(cfg), cfg, hold_sends, timeout=600)
    return ranks[0]


def planned(schedule: str, micro_batches: int) -> float:
    cfg = config(schedule, micro_batches)
    result = plan_result(cfg, validate(cfg))
    role = next(role for role in result["roles"] if 0 in role["pipeline_ranks"])
    return role["peak_compute_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=list(SCHEDULES))
    parser.add_argument("--micro-batches", nargs=2, type=int, default=[4, 16])
    arguments = parser.parse_args()
    small, large = arguments.micro_batches
    rows = []
    for schedule in arguments.only:
        row = {"schedule": schedule}
        for m in (small, large):
            row[m] = {"measured": measure(schedule, m), "held_to_end": measure(schedule, m, hold_sends=True),
                      "planned": planned(schedule, m)}
            print(f"{schedule} m={m}: measured {row[m]['measured']['peak'] / MIB:.2f} MiB "
                  f"(held {row[m]['measured']['held']}), held to the end {row[m]['held_to_end']['peak'] / MIB:.2f} "
                  f"MiB (held {row[m]['held_to_end']['held']}), planned {row[m]['planned'] / MIB:.2f} MiB", flush=True)
        rows.append(row)
    print(f"\n| schedule | m | rank 0 measured MiB | sends held | planned MiB | planned / measured "
          f"| held to the end: measured MiB | sends held |\n|---|---|---|---|---|---|---|---|")
    for row in rows:
        for m in (small, large):
            cell = row[m]
            print(f"| {row['schedule']} | {m} | {cell['measured']['peak'] / MIB:.2f} | {cell['measured']['held']} | "
                  f"{cell['planned'] / MIB:.2f} | {cell['planned'] / cell['measured']['peak']:.3f} | "
                  f"{cell['held_to_end']['peak'] / MIB:.2f} | {cell['held_to_end']['held']} |")
    print(f"\n| schedule | measured m{large}/m{small} | planned m{large}/m{small} | held to the end: measured "
          f"m{large}/m{small} |\n|---|---|---|---|")
    for row in rows:
        ratio = {key: row[large][key]["peak"] / row[small][key]["peak"] for key in ("measured", "held_to_end")}
        print(f"| {row['schedule']} | {ratio['measured']:.3f} | {row[large]['planned'] / row[small]['planned']:.3f} | "
              f"{ratio['held_to_end']:.3f} |")


if __name__ == "__main__":
    main()
