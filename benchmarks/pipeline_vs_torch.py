"""Our schedule executor vs torch.distributed.pipelining, same model, ranks and micro-batches.

    .venv/bin/python benchmarks/pipeline_vs_torch.py [--layers 8 --hidden 256 --micro-batches 8]

Each rank times forward+backward of one global batch (no optimizer) under GPipe, 1F1B, the
looped breadth-first schedule and the zero-bubble ones (ours `zero_bubble_h1`, one stage per rank,
against torch's `ScheduleInterleavedZeroBubble` on one stage per rank — its ZB1P, Qi et al. 2023's
ZB-H1; ours `zbv` against `ScheduleZBVZeroBubble`, both two stages per rank on the V placement),
alternating ours and theirs step by step so both see the same machine load, and prints the median
step times and the ratio ours/theirs measured in this run (`--schedules` runs a subset). The
losses of both are printed too: the two implementations compute the same thing.
"""

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,  # noqa: E402
                                          ScheduleInterleavedZeroBubble, ScheduleLoopedBFS, ScheduleZBVZeroBubble)

from layerwise.run.launch import run_ranks  # noqa: E402
from parallel.dims import Layout  # noqa: E402
from parallel.layout import ParallelLayout  # noqa: E402
from models import build_model  # noqa: E402
from strategies.modular_pipeline import training_plan  # noqa: E402
from strategies.schedule import execute  # noqa: E402
from strategies.stages import Peers, StageWork, keep_local_stages, stage_blocks  # noqa: E402

THEIRS = {"gpipe": ScheduleGPipe, "one_f_one_b": Schedule1F1B, "looped_breadth_first": ScheduleLoopedBFS,
          "zero_bubble_h1": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble}
MULTI_STAGE = ("looped_breadth_first", "zero_bubble_h1", "zbv")  # torch's classes taking a list of stages
TWO_STAGES_PER_RANK = ("looped_breadth_first", "zbv")


def stage_rank(schedule: str, stage: int, pipeline_degree: int) -> int:
    """The rank holding `stage`: looping for looped BFS, the V for ZBV (stages.stage_placement), else contiguous."""
    if schedule == "zbv":
        return stage if stage < pipeline_degree else 2 * pipeline_degree - 1 - stage
    return stage % pipeline_degree


class TorchStage(nn.Module):
    """One stage for torch.pipelining: embedding on the first, head on the last."""

    def __init__(self, model, stage, stages, layers_per_stage):
        super().__init__()
        self.embed = model.embed if stage == 0 else None
        self.blocks = nn.ModuleList(model.blocks[n] for n in stage_blocks(stage, layers_per_stage))
        self.head = model.head if stage == stages - 1 else None

    def forward(self, x):
        x = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def plan_config(schedule, pipeline_degree, layers, micro_batches):
    per_stage = layers // pipeline_degree if schedule not in TWO_STAGES_PER_RANK else layers // (2 * pipeline_degree)
    return argparse.Namespace(schedule=schedule, pipeline_degree=pipeline_degree, layers_per_stage=per_stage,
                              micro_batches=micro_batches, breadth_first_micro_batches=None), per_stage


def ours(model, layout, schedule, arguments):
    config, per_stage = plan_config(schedule, layout.degrees.pipeline, arguments.layers, arguments.micro_batches)
    plan = training_plan(config, arguments.layers)
    local = copy.deepcopy(model)
    keep_local_stages(local, list(plan.stages_on(layout.index("pipeline"))), plan.stages, per_stage)
    peers = Peers([layout.group("pipeline").ranks[r] for r in plan.placement], layout.group("pipeline"),
                  layout.group("data"), layout.communicator)
    work = StageWork(local, plan.stages, per_stage, arguments.micro_batches, peers)

    def step(batch):
        actions = plan.ranks[layout.index("pipeline")]
        work.start(batch, training=True)
        execute(actions, work.handlers())
        return work.state.loss
    return step


def theirs(model, layout, schedule, arguments):
    p, rank = layout.degrees.pipeline, layout.index("pipeline")
    config, per_stage = plan_config(schedule, p, arguments.layers, arguments.micro_batches)
    stages = arguments.layers // per_stage
    local = copy.deepcopy(model)
    mine = [s for s in range(stages) if stage_rank(schedule, s, p) == rank]
    pipeline_stages = [PipelineStage(TorchStage(local, s, stages, per_stage), s, stages, torch.device("cpu"),
                                     group=layout.group("pipeline").process_group) for s in mine]
    loss = lambda logits, targets: local.loss(logits, targets)  # noqa: E731
    if schedule in MULTI_STAGE:
        runner = THEIRS[schedule](pipeline_stages, arguments.micro_batches, loss_fn=loss)
    else:
        runner = THEIRS[schedule](pipeline_stages[0], arguments.micro_batches, loss_fn=loss)

    def step(batch):
        losses = []
        first, last = rank == 0, rank == stage_rank(schedule, stages - 1, p)
        runner.step(*((batch["tokens"],) if first else ()), target=batch["targets"] if last else None,
                    losses=losses)
        return torch.stack(losses).mean() if losses else None
    return step


def timed(step, batch):
    start = time.perf_counter()
    loss = step(batch)
    dist.barrier()
    return time.perf_counter() - start, loss


def rank_main(rank, arguments):
    torch.manual_seed(0)
    dist.init_process_group("gloo", rank=rank, world_size=arguments.ranks)
    layout = ParallelLayout(Layout(pipeline=arguments.ranks), rank=rank)
    model = build_model("gpt", vocab_size=256, sequence_length=arguments.sequence, layers=arguments.layers,
                        hidden=arguments.hidden, heads=4, seed=0)
    batch = {"tokens": torch.randint(0, 256, (arguments.batch, arguments.sequence)),
             "targets": torch.randint(0, 256, (arguments.batch, arguments.sequence))}
    results = {}
    for schedule in arguments.schedules:
        steps = {"ours": ours(model, layout, schedule, arguments), "theirs": theirs(model, layout, schedule, arguments)}
        times, losses = {"ours": [], "theirs": []}, {}
        for iteration in range(arguments.warmup + arguments.steps):
            for name, step in steps.items():  # alternate so both see the same load
                seconds, loss = timed(step, batch)
                losses[name] = None if loss is None else float(loss.detach())
                if iteration >= arguments.warmup:
                    times[name].append(seconds)
        results[schedule] = {name: statistics.median(t) for name, t in times.items()} | {"losses": losses}
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--sequence", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--schedules", nargs="+", choices=list(THEIRS), default=list(THEIRS))
    arguments = parser.parse_args()
    per_rank = run_ranks(rank_main, arguments.ranks, arguments)
    print(f"{arguments.ranks} ranks, GPT {arguments.layers}×{arguments.hidden}, batch {arguments.batch}×"
          f"{arguments.sequence}, {arguments.micro_batches} micro-batches, median of {arguments.steps} steps")
    print(f"{'schedule':24s} {'ours (s)':>10s} {'torch (s)':>10s} {'ours/torch':>11s}   loss ours / torch")
    for schedule in arguments.schedules:
        mine = max(r[schedule]["ours"] for r in per_rank)
        reference = max(r[schedule]["theirs"] for r in per_rank)
        losses = [r[schedule]["losses"] for r in per_rank if r[schedule]["losses"].get("ours") is not None]
        loss_text = f"{losses[0]['ours']:.5f} / {losses[0]['theirs']:.5f}" if losses else ""
        print(f"{schedule:24s} {mine:10.4f} {reference:10.4f} {mine / reference:11.3f}   {loss_text}")


if __name__ == "__main__":
    main()
