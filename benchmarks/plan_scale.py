"""Wall time of full-scale plans and of a search, on this machine (issue 16's numbers to show).

    .venv/bin/python benchmarks/plan_scale.py            # gpt3_175b and gpt_1t plans at 64-512 nodes, and a search
    .venv/bin/python benchmarks/plan_scale.py --nodes 64 --no-search

Each plan is the full path of `python train.py mode=plan` (compose, validate, the strategy's plan,
the simulator, every role's memory) without the figures: 1F1B × 1-D tensor grid 8 within a node,
pipeline 16 for gpt3_175b (96 layers, 6 per stage), 64 for gpt_1t (128 layers, 2 per stage), data = the rest,
full recomputation, global batch 1536 × 2048 tokens, two sequences per micro-batch (m = 1536 / (2·data)).
The search is gpt3_175b on 128 nodes (1024 GPUs), the same batch.
Prints the 1-minute load average with the timings: the machine may be shared.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from layerwise.planning.result import plan_result  # noqa: E402
from layerwise.planning.search import search  # noqa: E402
from layerwise.preflight import validate  # noqa: E402
from benchmarks.common import compose_config  # noqa: E402

# model -> pipeline degree (one stage per rank): GPT-3 as Narayanan et al. 2021 ran it at this scale;
# the 1T model needs 64, as they ran it (at 16 its first stage holds 140 GiB, at 32 82 GiB)
MODELS = {"gpt3_175b": 16, "gpt_1t": 64}
LAYERS = {"gpt3_175b": 96, "gpt_1t": 128}
BATCH, LENGTH, GRID = 1536, 2048, 8


def overrides(model: str, nodes: int) -> list:
    pipeline = MODELS[model]
    data = nodes * 8 // (pipeline * GRID)
    micro_batches = max(1, BATCH // (data * 2))  # two sequences per micro-batch where the batch allows
    return ["mode=plan", f"model={model}", "hardware=dgx_a100_80g", f"hardware.nodes={nodes}", "logger=none",
            "strategy=one_f_one_b", f"strategy.pipeline_degree={pipeline}", "strategy.tensor_parallel=1d",
            f"strategy.tensor_grid={GRID}", f"strategy.layers_per_stage={LAYERS[model] // pipeline}",
            f"strategy.micro_batches={micro_batches}", "strategy.activation_recompute=full",
            f"data.global_batch_size={BATCH}", f"data.sequence_length={LENGTH}"]


def time_plan(model: str, nodes: int) -> tuple:
    started = time.perf_counter()
    cfg = compose_config(*overrides(model, nodes))
    result = plan_result(cfg, validate(cfg))
    return time.perf_counter() - started, result, cfg.strategy.micro_batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--no-search", action="store_true")
    arguments = parser.parse_args()
    print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f}")
    print(f"{'model':10s} {'nodes':>5s} {'GPUs':>5s} {'p×t×d':>9s} {'m':>4s} {'plan s':>7s} {'step s':>8s} {'MFU':>6s} "
          f"{'bubble':>7s} {'largest role GiB':>17s} fits")
    for model in MODELS:
        for nodes in arguments.nodes:
            seconds, result, micro = time_plan(model, nodes)
            worst = max(role["peak_with_margin_bytes"] for role in result["roles"]) / 2 ** 30
            layout = f"{MODELS[model]}×{GRID}×{nodes * 8 // (MODELS[model] * GRID)}"
            print(f"{model:10s} {nodes:5d} {nodes * 8:5d} {layout:>9s} {micro:4d} {seconds:7.2f} {result['step_time_s']:8.2f} "
                  f"{result['mfu']:6.1%} {result['bubble_fraction']:7.1%} {worst:17.1f} "
                  f"{'yes' if all(role['fits'] for role in result['roles']) else 'NO'}", flush=True)
    print(f"load average (1 min) after the plans: {os.getloadavg()[0]:.2f}")
    if not arguments.no_search:
        cfg = compose_config("mode=plan", "plan.search=true", "model=gpt3_175b", "hardware=dgx_a100_80g",
                             "hardware.nodes=128", "logger=none", f"data.global_batch_size={BATCH}",
                             f"data.sequence_length={LENGTH}")
        started = time.perf_counter()
        with tempfile.TemporaryDirectory() as directory:
            search(cfg, validate(cfg), directory)
        print(f"search wall time (enumerate, evaluate, re-plan the top 3): {time.perf_counter() - started:.1f} s; "
              f"load average (1 min): {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
