"""What the framework costs per step: hand-written PyTorch loops against train.py, side by side.

    .venv/bin/python benchmarks/overhead.py [--steps 100 --repeats 5 --threads 1] [overrides ...]

Two pairs, the same model (models.build_model), global batches (layerwise.run.data), AdamW and LR
schedule (layerwise.run.optim) in each pair:
- `single`: a plain loop (zero_grad, forward, loss, backward, step, scheduler) against
  `train.py strategy=single` (layerwise.run.fit.train in this process: Lightning, callbacks, evidence);
- `ddp`: torch DDP on gloo in 2 forked ranks, each its slice of the global batch, against
  `train.py strategy=ddp` (2 ranks forked by the framework's launcher);
- `watchdog`: the cost of the flight record, the watchdog and the straggler check (issue 33,
  docs/faults.md): `train.py strategy=modular_pipeline` (2 ranks, the most operations per step)
  with `trainer.collective_timeout_s=0 trainer.straggler_window=0` (all off) in the "hand" column
  against the defaults (all on) in the "framework" column.
A step's cost is read from per-step wall-clock timestamps (rank 0's step starts; the framework's
are taken by a callback added to the Trainer), which leaves start-up and the end of the run out:
each variant runs 2 + N + 1 steps and the N intervals from step 3 to step N + 2 are measured.
- `mean`: their mean, everything a steady run pays per step: Lightning's loop, the evidence, the
  sampled steps' memory meter (N a multiple of trainer.measure_every_n_steps, default 50, keeps
  their share at its steady 1 in 50), logging, the data;
- `median`, `p10`: the typical and a fast step; on a machine other processes load, the 10th
  percentile is the steadiest estimate of an undisturbed step.
(Timing N and 2N steps and taking the difference measured start-up noise more than steps: W&B's
and the ranks' start vary by seconds.)
The variants alternate within each repeat so they share the machine's load; medians over repeats
are printed with the median of the repeats' ratios framework / hand and the 1-minute load average.
The first losses are printed too: both sides of a pair compute the same thing. Validation is off
(limit_val_batches=0); the logger is train.py's default (W&B offline) unless overridden.

Where a step's time goes: each step's timestamps split it into phases, medians (ms) over the
measured steps of all repeats — `forward` (hand: batch, zero_grad, forward, loss; framework:
Lightning's training_step and the evidence exchange it issues), `backward`, `update` (optimizer
step; hand: and the LR schedule; framework: and every callback's step end), `between` (framework
only: Lightning's loop, LR schedule, the next batch, the step-start hooks). Forward and backward
are the model's own work, the same on both sides up to the machine's noise; `update` and
`between` hold the framework's own per-step cost, which this noise hardly touches.
"""

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import json  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import layerwise.run.fit  # noqa: E402
from layerwise.run import data as data_lib  # noqa: E402
from layerwise.config.store import register_schemas  # noqa: E402
from layerwise.run.launch import free_port  # noqa: E402
from layerwise.run.optim import build_optimizer, build_scheduler  # noqa: E402
from layerwise.run.task import model_arguments, objective_of  # noqa: E402
from layerwise.preflight import validate  # noqa: E402
from models import build_model  # noqa: E402

CONFIG_DIRECTORY = str(Path(__file__).resolve().parent.parent / "conf")
RANKS = 2
SIDES = ("hand", "framework")
MEASURES = ("mean", "median", "p10")
WARM_UP = 2  # first steps left out of the per-step intervals (allocations, optimizer state)
PHASES = ("forward", "backward", "update", "between")
STAMPS = ("start", "backward", "update", "end")  # a step's timestamps: each phase ends at the next
os.environ.setdefault("WANDB_SILENT", "true")  # train.py's default logger is W&B offline: keep its banner quiet


# ----- the hand-written side

def hand_loop(cfg, corpus, steps: int, data_rank: int = 0, data_degree: int = 1, wrap=None) -> tuple:
    """The whole training loop a user would write by hand: (first step's loss, each step's
    timestamps {start, backward, update, end})."""
    objective = objective_of(cfg.model)
    model = build_model(cfg.model.architecture,
                        **model_arguments(cfg.model, data_lib.model_vocab_size(corpus, objective), cfg.seed))
    trained = wrap(model) if wrap else model
    optimizer = build_optimizer(cfg.optimizer, model.named_parameters())
    scheduler = build_scheduler(optimizer, cfg.optimizer, cfg.trainer.max_steps)
    batches = iter(data_lib.TrainBatches(corpus, global_batch_size=cfg.data.global_batch_size,
                                         sequence_length=cfg.data.sequence_length, seed=cfg.seed,
                                         objective=objective, data_rank=data_rank, data_degree=data_degree))
    first_loss, stamps = None, []
    for _ in range(steps):
        stamp = {"start": time.perf_counter()}
        batch = next(batches)
        optimizer.zero_grad()
        loss = model.loss(trained(batch["tokens"]), batch["targets"])
        stamp["backward"] = time.perf_counter()
        loss.backward()
        stamp["update"] = time.perf_counter()
        optimizer.step()
        scheduler.step()
        stamp["end"] = time.perf_counter()
        stamps.append(stamp)
        first_loss = float(loss.detach()) if first_loss is None else first_loss
    return first_loss, stamps


def hand_ddp_rank(rank: int, port: int, cfg, corpus, steps: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # as the framework's launcher does: the ranks share the cores
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    bucket_mb = cfg.strategy.get("bucket_mb", 25.0)  # the same buckets as the framework's DDP
    wrap = lambda model: torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)  # noqa: E731
    results.put((rank, hand_loop(cfg, corpus, steps, data_rank=rank, data_degree=RANKS, wrap=wrap)))
    dist.destroy_process_group()


def hand_ddp(cfg, corpus, steps: int) -> tuple:
    """2 forked ranks, torch DDP on gloo: (first step's loss averaged over ranks, rank 0's step stamps)."""
    context = multiprocessing.get_context("fork")
    results, port = context.Queue(), free_port()
    ranks = [context.Process(target=hand_ddp_rank, args=(rank, port, cfg, corpus, steps, results))
             for rank in range(RANKS)]
    for process in ranks:
        process.start()
    by_rank = dict(results.get(timeout=600) for _ in ranks)
    for process in ranks:
        process.join()
        assert process.exitcode == 0, f"a hand-written DDP rank exited with {process.exitcode}"
    return sum(loss for loss, _ in by_rank.values()) / RANKS, by_rank[0][1]


# ----- the framework side

class StepStamps(pl.Callback):
    """Rank 0 writes each training step's timestamps (STAMPS) to `step_stamps.json`. Added last,
    so its step start comes after and its step end after every other callback's."""

    def __init__(self, path: Path):
        self.path, self.stamps = path, []

    def on_train_batch_start(self, trainer, module, batch, batch_index):
        self.stamps.append({"start": time.perf_counter()})

    def on_before_backward(self, trainer, module, loss):
        self.stamps[-1]["backward"] = time.perf_counter()

    def on_after_backward(self, trainer, module):
        self.stamps[-1]["update"] = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
        self.stamps[-1]["end"] = time.perf_counter()

    def on_train_end(self, trainer, module):
        if trainer.is_global_zero:
            self.path.write_text(json.dumps(self.stamps))
            communicator = trainer.strategy.communicator()
            recorder = communicator.recorder if communicator is not None else None
            if recorder is not None:  # the flight record's operations per step (the watchdog pair)
                self.path.with_name("operations.json").write_text(json.dumps(
                    {"operations": recorder._index, "steps": len(self.stamps)}))


def build_trainer_with_step_stamps(cfg, run_directory, *arguments):
    """layerwise.run.fit.build_trainer, plus the StepStamps callback (forked ranks inherit the patch)."""
    trainer = BUILD_TRAINER(cfg, run_directory, *arguments)
    trainer.callbacks.append(StepStamps(Path(run_directory) / "step_stamps.json"))
    return trainer


BUILD_TRAINER = layerwise.run.fit.build_trainer
layerwise.run.fit.build_trainer = build_trainer_with_step_stamps


def framework_unwatched(cfg, corpus, steps: int) -> tuple:
    """`framework` with no flight record, watchdog or straggler check (the watchdog pair's baseline)."""
    cfg.trainer.collective_timeout_s, cfg.trainer.straggler_window = 0, 0
    return framework(cfg, corpus, steps)


STRATEGY_OF_PAIR = {"watchdog": "modular_pipeline"}
OPERATIONS_PER_STEP = []  # rank 0's recorded operations per step, one per run with the record on


def record_cost(repeats: int = 7, calls: int = 20000) -> float:
    """Seconds the flight record adds to one operation (issue, a tracked handle, its recorded
    wait), the median of `repeats` timings of `calls` operations, against the bare handle."""
    from parallel.flight import FlightRecorder

    class Done:  # a completed work handle: only the record's own cost is timed
        def wait(self):
            return True

        def is_completed(self):
            return True

    def bare(work):
        for _ in range(calls):
            work.wait()

    def recorded(work):
        recorder = FlightRecorder()
        for _ in range(calls):
            recorder.track(recorder.issue("send", "pipeline", (0, 1), peer=1, nbytes=4), work).wait()
    costs = []
    for _ in range(repeats):
        start = time.perf_counter()
        bare(Done())
        middle = time.perf_counter()
        recorded(Done())
        costs.append((time.perf_counter() - middle - (middle - start)) / calls)
    return statistics.median(costs)


def framework(cfg, corpus, steps: int) -> tuple:
    """train.py's run (compose and validate done): (first step's loss, rank 0's step stamps)."""
    with tempfile.TemporaryDirectory() as directory:
        summary = layerwise.run.fit.train(cfg, Path(directory), validate(cfg))
        stamps = json.loads((Path(directory) / "step_stamps.json").read_text())
        operations = Path(directory) / "operations.json"
        if operations.exists():
            counted = json.loads(operations.read_text())
            OPERATIONS_PER_STEP.append(counted["operations"] / counted["steps"])
    assert summary["status"] == "completed" and summary["steps"] == steps
    return summary["losses"][0], stamps


# ----- measurement

def configured(strategy: str, steps: int, overrides: list):
    """The config train.py would compose (not the tests' strict one), for both sides of a pair: the
    hand loop reads model, data, optimizer and schedule from it."""
    from hydra import compose, initialize_config_dir
    register_schemas()
    with initialize_config_dir(config_dir=CONFIG_DIRECTORY, version_base="1.3"):
        return compose(config_name="config", overrides=[
            f"strategy={strategy}", f"trainer.max_steps={steps}", "trainer.limit_val_batches=0",
            "trainer.progress=none", *overrides])


def per_step(run, strategy: str, steps: int, overrides: list, corpus) -> tuple:
    """({"mean", "median", "p10"} seconds per step, {phase: its seconds in each measured step}, the
    first step's loss): see the module docstring."""
    loss, stamps = run(configured(STRATEGY_OF_PAIR.get(strategy, strategy), WARM_UP + steps + 1, overrides),
                       corpus, WARM_UP + steps + 1)
    measured = stamps[WARM_UP:]
    intervals = [later["start"] - earlier["start"] for earlier, later in zip(measured, measured[1:])]
    # a pipeline runs its backward inside training_step: no backward stamps, those phases stay empty
    phases = {phase: [step[end] - step[begin] for step in measured[:-1] if begin in step and end in step]
              for phase, begin, end in zip(PHASES, STAMPS, STAMPS[1:])}
    phases["between"] = [later["start"] - earlier["end"] for earlier, later in zip(measured, measured[1:])]
    return {"mean": statistics.fmean(intervals), "median": statistics.median(intervals),
            "p10": statistics.quantiles(intervals, n=10)[0]}, phases, loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="N: steps measured per run (after 2)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of the single pair (default: torch's, as train.py runs; "
                             "1 keeps timings steadier while other processes load the cores)")
    parser.add_argument("--pairs", default="single,ddp",
                        help="which pairs to run, comma-separated: single, ddp, watchdog")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both sides, e.g. model=gpt_small")
    arguments = parser.parse_args()
    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    corpus = layerwise.run.fit.load_corpus(configured("single", arguments.steps, arguments.overrides))
    pairs = {name: sides for name, sides in {"single": (hand_loop, framework), "ddp": (hand_ddp, framework),
                                             "watchdog": (framework_unwatched, framework)}.items()
             if name in arguments.pairs.split(",")}
    times = {(pair, side): [] for pair in pairs for side in SIDES}
    phases = {(pair, side): {phase: [] for phase in PHASES} for pair in pairs for side in SIDES}
    losses, load = {}, [os.getloadavg()[0]]
    for repeat in range(arguments.repeats):
        for pair, runs in pairs.items():
            for side, run in zip(SIDES, runs):
                seconds, split, losses[pair, side] = per_step(run, pair, arguments.steps,
                                                              arguments.overrides, corpus)
                times[pair, side].append(seconds)
                for phase in PHASES:
                    phases[pair, side][phase] += split[phase]
                print(f"repeat {repeat + 1} {pair:6s} {side:9s} " + ", ".join(
                    f"{measure} {seconds[measure]:.4f}" for measure in MEASURES)
                    + f" s/step (load {os.getloadavg()[0]:.2f})", flush=True)
        load.append(os.getloadavg()[0])
    report(arguments, pairs, times, losses, load)
    report_phases(pairs, phases)
    if "watchdog" in pairs:
        report_record_cost(times)


def report(arguments, pairs, times, losses, load) -> None:
    """Medians over repeats; the ratio is the median of each repeat's framework / hand (the two ran
    one after the other, so a repeat's ratio is the least disturbed by the machine's other load)."""
    print(f"\n{arguments.steps} steps measured per run, {arguments.repeats} repeats, overrides "
          f"{arguments.overrides or 'none'}, {torch.get_num_threads()} threads in single, 1 per ddp rank; "
          f"1-minute load average {min(load):.2f}-{max(load):.2f} on {os.cpu_count()} cores")
    print(f"{'pair':8s} {'measure':7s} {'hand s/step':>12s} {'framework s/step':>17s} {'ratio':>7s}  ratio range")
    for pair in pairs:
        for measure in MEASURES:
            hand, ours = ([t[measure] for t in times[pair, side]] for side in SIDES)
            ratios = [framework / by_hand for by_hand, framework in zip(hand, ours)]
            print(f"{pair:8s} {measure:7s} {statistics.median(hand):12.4f} {statistics.median(ours):17.4f} "
                  f"{statistics.median(ratios):7.3f}  {min(ratios):.3f}-{max(ratios):.3f}")
        print(f"{pair:8s} first step's loss: hand {losses[pair, 'hand']:.5f}, framework {losses[pair, 'framework']:.5f}")


def report_record_cost(times) -> None:
    """The record's cost by parts, which the machine's load hardly moves: the cost of one recorded
    operation × operations per step, over the median step with the watchdog on."""
    per_operation = record_cost()
    operations = statistics.median(OPERATIONS_PER_STEP)
    step = statistics.median(t["median"] for t in times["watchdog", "framework"])
    print(f"\nflight record: {1e6 * per_operation:.2f} µs per operation (median of 7 × 20000), "
          f"{operations:.1f} operations per step on rank 0, median step {step:.4f} s: "
          f"{100 * per_operation * operations / step:.3f}% of a step")


def report_phases(pairs, phases) -> None:
    """Median milliseconds per phase over every measured step of every repeat, both sides."""
    print("\nwhere a step's time goes: median ms per phase (see the module docstring)")
    print(f"{'pair':8s} {'side':9s} " + " ".join(f"{phase:>9s}" for phase in PHASES))
    for pair in pairs:
        for side in SIDES:
            print(f"{pair:8s} {side:9s} " + " ".join(
                f"{1e3 * statistics.median(phases[pair, side][phase] or [float('nan')]):9.2f}" for phase in PHASES))


if __name__ == "__main__":
    main()
