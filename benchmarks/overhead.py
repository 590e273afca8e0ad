"""What the framework costs per step: hand-written PyTorch loops against train.py, side by side.

    .venv/bin/python benchmarks/overhead.py [--steps 50 --repeats 3] [overrides ...]

Two pairs, the same model (models.build_model), global batches (layerwise.data), AdamW and LR
schedule (layerwise.optim) in each pair:
- `single`: a plain loop (zero_grad, forward, loss, backward, step, scheduler) against
  `train.py strategy=single` (layerwise.run.train in this process: Lightning, callbacks, evidence);
- `ddp`: torch DDP on gloo in 2 forked ranks, each its slice of the global batch, against
  `train.py strategy=ddp` (2 ranks forked by the framework's launcher).
Seconds per step by wall clock, start-up excluded: every variant runs N and 2N steps, from a fresh
start each time, and (T(2N) − T(N)) / N is its cost per step in a steady run. The variants alternate
within each repeat so they share the machine's load; the medians over repeats are printed with
the ratio framework / hand and the load average (other processes on a 2-core machine show in it).
The first losses are printed too: both sides of a pair compute the same thing.
Validation is off (limit_val_batches=0): the comparison is of training steps.
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

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from layerwise import data as data_lib  # noqa: E402
from layerwise.launch import free_port  # noqa: E402
from layerwise.optim import build_optimizer, build_scheduler  # noqa: E402
from layerwise.run import load_corpus, train  # noqa: E402
from layerwise.task import model_arguments, objective_of  # noqa: E402
from layerwise.validate import validate  # noqa: E402
from models import build_model  # noqa: E402
from tests.harness import compose_config  # noqa: E402

RANKS = 2


# ----- the hand-written side

def hand_loop(cfg, corpus, steps: int, data_rank: int = 0, data_degree: int = 1, wrap=None) -> float:
    """The whole training loop a user would write by hand; returns the first step's loss."""
    objective = objective_of(cfg.model)
    model = build_model(cfg.model.architecture,
                        **model_arguments(cfg.model, data_lib.model_vocab_size(corpus, objective), cfg.seed))
    trained = wrap(model) if wrap else model
    optimizer = build_optimizer(cfg.optimizer, model.named_parameters())
    scheduler = build_scheduler(optimizer, cfg.optimizer, cfg.trainer.max_steps)
    batches = iter(data_lib.TrainBatches(corpus, global_batch_size=cfg.data.global_batch_size,
                                         sequence_length=cfg.data.sequence_length, seed=cfg.seed,
                                         objective=objective, data_rank=data_rank, data_degree=data_degree))
    first_loss = None
    for _ in range(steps):
        batch = next(batches)
        optimizer.zero_grad()
        loss = model.loss(trained(batch["tokens"]), batch["targets"])
        loss.backward()
        optimizer.step()
        scheduler.step()
        first_loss = float(loss) if first_loss is None else first_loss
    return first_loss


def hand_ddp_rank(rank: int, port: int, cfg, corpus, steps: int, losses) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # as the framework's launcher does: the ranks share the cores
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    wrap = lambda model: torch.nn.parallel.DistributedDataParallel(model)  # noqa: E731
    loss = hand_loop(cfg, corpus, steps, data_rank=rank, data_degree=RANKS, wrap=wrap)
    losses.put((rank, loss))
    dist.destroy_process_group()


def hand_ddp(cfg, corpus, steps: int) -> float:
    """2 forked ranks, torch DDP on gloo; returns the first step's loss, the mean over ranks."""
    context = multiprocessing.get_context("fork")
    losses, port = context.Queue(), free_port()
    ranks = [context.Process(target=hand_ddp_rank, args=(rank, port, cfg, corpus, steps, losses))
             for rank in range(RANKS)]
    for process in ranks:
        process.start()
    first = [losses.get(timeout=600)[1] for _ in ranks]
    for process in ranks:
        process.join()
        assert process.exitcode == 0, f"a hand-written DDP rank exited with {process.exitcode}"
    return sum(first) / RANKS


# ----- the framework side

def framework(cfg, corpus, steps: int) -> float:
    """train.py's run (compose and validate done); returns the first step's loss."""
    with tempfile.TemporaryDirectory() as directory:
        summary = train(cfg, Path(directory), validate(cfg))
    assert summary["status"] == "completed" and summary["steps"] == steps
    return summary["losses"][0]


# ----- measurement

def configured(strategy: str, steps: int, overrides: list):
    """One config for both sides of a pair: the hand loop reads model, data, optimizer, schedule."""
    return compose_config(f"strategy={strategy}", f"trainer.max_steps={steps}", "trainer.limit_val_batches=0",
                          "trainer.progress=none", *overrides)


def seconds_per_step(run, strategy: str, steps: int, overrides: list, corpus) -> tuple:
    """(T(2N) − T(N)) / N by wall clock, and the first step's loss."""
    elapsed = {}
    for count in (steps, 2 * steps):
        cfg = configured(strategy, count, overrides)
        start = time.perf_counter()
        loss = run(cfg, corpus, count)
        elapsed[count] = time.perf_counter() - start
    if os.environ.get("OVERHEAD_VERBOSE"):
        print(f"  {strategy} {run.__name__}: T({steps}) = {elapsed[steps]:.2f} s, "
              f"T({2 * steps}) = {elapsed[2 * steps]:.2f} s", flush=True)
    return (elapsed[2 * steps] - elapsed[steps]) / steps, loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="N: each variant runs N and 2N steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both sides, e.g. model=gpt_small")
    arguments = parser.parse_args()
    corpus = load_corpus(configured("single", arguments.steps, arguments.overrides))
    pairs = {"single": (hand_loop, framework), "ddp": (hand_ddp, framework)}
    times = {(pair, side): [] for pair in pairs for side in ("hand", "framework")}
    losses, load = {}, [os.getloadavg()[0]]
    for repeat in range(arguments.repeats):
        for pair, (hand, ours) in pairs.items():
            for side, run in (("hand", hand), ("framework", ours)):
                seconds, losses[pair, side] = seconds_per_step(run, pair, arguments.steps,
                                                               arguments.overrides, corpus)
                times[pair, side].append(seconds)
                print(f"repeat {repeat + 1} {pair:6s} {side:9s} {seconds:.4f} s/step "
                      f"(load {os.getloadavg()[0]:.2f})", flush=True)
        load.append(os.getloadavg()[0])
    print(f"\n{arguments.steps} and {2 * arguments.steps} steps, {arguments.repeats} repeats, "
          f"overrides {arguments.overrides or 'none'}; 1-minute load average {min(load):.2f}-{max(load):.2f} "
          f"on {os.cpu_count()} cores")
    print(f"{'pair':8s} {'hand s/step':>12s} {'framework s/step':>17s} {'ratio':>7s}   first losses (hand, framework)")
    for pair in pairs:
        hand, ours = (statistics.median(times[pair, side]) for side in ("hand", "framework"))
        print(f"{pair:8s} {hand:12.4f} {ours:17.4f} {ours / hand:7.3f}   "
              f"{losses[pair, 'hand']:.5f}, {losses[pair, 'framework']:.5f}")


if __name__ == "__main__":
    main()
