"""mode=calibrate: measure this machine and write the hardware profile plan mode prices with.

    python train.py mode=calibrate [calibrate.name=calibrated calibrate.directory=conf/hardware]

Five measurements, each fitted with the α–β model plan mode uses (time = fixed cost + work / rate):
1. matrix products: square fp32 (and bf16) products of edge 128 … 1024 in ONE thread, as every
   rank runs: time = `matmul_overhead_s` + 2n³ / `peak_flops` (least squares on relative error);
2. collectives: gloo all-reduce between `calibrate.world_sizes` forked ranks at 4 KB … 16 MB, each
   after a few ms of products as runs issue them (`after_compute`), sampled until the mean is stable:
   time = `collective_latency_s` + 2(n−1)/n · bytes / `intra_node_bandwidth` (ring all-reduce's
   bytes per rank), and send/recv pairs: time = latency + bytes / bandwidth; and a 1 MB all-gather
   posted before 1, 2 and 4 products, as ZeRO prefetches: the share of it they hide, `gather_overlap`;
3. host copies (`copy_` between two buffers, 1 … 64 MB): `host_device_bandwidth`;
4. the model group's own block (default gpt_tiny), forward and backward at 1 … 8 sequences: what the
   products above do not explain, per forward (÷ 3), is `block_overhead_s` + activation elements ×
   `activation_seconds_per_element` (norms, softmax, GELU, dropout, additions; on a CPU their dispatch);
   rounds of forked ranks until the block time's mean is stable; and the configured optimizer's step
   over 1 … 8 blocks: `optimizer_seconds_per_parameter`;
5. two tiny runs (`single`, 1F1B p2), run until their mean step is stable: the framework's own cost
   per step and per action.
The profile (`<directory>/<name>.yaml`, a `hardware=` option) keeps cpu.yaml's other fields;
`<name>.calibration.json` beside it holds every measurement and each fit's worst residual.
"""

import contextlib
import io
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from layerwise.run.launch import run_ranks
from layerwise.run.optim import build_optimizer
from models.transformer import build_block
from cost.inputs import GptShape
from parallel import compat
from parallel.dims import Layout

MATMUL_EDGES = (128, 256, 384, 512, 768, 1024)
QUICK_MATMUL_EDGES = (64, 128, 256)
COLLECTIVE_BYTES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
QUICK_COLLECTIVE_BYTES = (4 << 10, 64 << 10, 256 << 10)
COPY_BYTES = (1 << 20, 8 << 20, 64 << 20)
QUICK_COPY_BYTES = (1 << 20, 4 << 20)


# A timed sample of local work lasts at least this long: one call of a small product (~40 µs) sits
# inside the timer's and the scheduler's noise (5 single calls per size gave fits 70-100 GFLOP/s a
# minute apart, worst residual 31%, on an idle machine; issue 31).
SAMPLE_S = 0.02


def median_seconds(work, repeats: int, statistic=statistics.median, sample_s: float = 0.0,
                   clock=time.perf_counter) -> float:
    """The median (or `statistic`, e.g. min on a shared machine) seconds per call of `work()` over
    `repeats` samples after one warm-up call; a sample repeats the call until it lasts `sample_s`
    (the count is set once from one timed call, so every rank of a collective could not agree on
    it: collectives keep `sample_s` 0, one call per sample). `clock` reads seconds (a test passes
    one that only its work advances, so load cannot move the result)."""
    work()
    calls = 1
    if sample_s:
        start = clock()
        work()
        calls = max(1, math.ceil(sample_s / max(clock() - start, 1e-7)))
    times = []
    for _ in range(repeats):
        start = clock()
        for _ in range(calls):
            work()
        times.append((clock() - start) / calls)
    return statistic(times)


# A term priced by its mean over a step's many calls (a collective's wait, a block's time, a tiny run's
# step) is sampled until that mean is stable: on this 2-core machine a fixed number of samples is a draw
# from a wide distribution. Three calibrations in a row read gloo's all-reduce after compute as 3.91,
# 2.64 and 2.27 ms at 4 KB, a block's non-product rate as 361, 470 and 860 M elements/s, and the
# collective-bound layouts' predictions moved 28-75% with them while their runs moved at most 17%
# (docs/plan.md, "Why, measured"). 1,000 all-reduces of 4 KB after compute here: mean 2.26 ms, sd 2.36,
# tail to 16 ms, and means of 100 consecutive ones 1.58-2.79 ms (consecutive samples are correlated: a
# late-waking thread stays late a while), so the error is taken over batch means, not samples.
STABLE = 0.03  # stop when the batch means' standard error is this fraction of their mean


def relative_error(means: list) -> float:
    """The largest standard error of the mean ÷ mean over the components of `means` (one list of
    values per batch); infinite with fewer than 2 batches."""
    if len(means) < 2:
        return math.inf
    return max(statistics.stdev(column) / math.sqrt(len(column)) / max(abs(statistics.fmean(column)), 1e-12)
               for column in zip(*means))


def mean_until_stable(sample, batch: int, min_batches: int, max_batches: int, budget_s: float,
                      agree=bool) -> dict:
    """{"mean": [...], "relative_error", "samples"} of `sample()` (a list of seconds) drawn `batch` at a
    time until the batch means' `relative_error` is at most STABLE (after `min_batches`), or
    `max_batches` or `budget_s` seconds are spent (the error then says how far it got).
    `agree(done)` gives every rank of a collective the same decision (`rank_zero_decides`)."""
    means, start = [], time.perf_counter()
    while True:
        values = [sample() for _ in range(batch)]
        means.append([statistics.fmean(column) for column in zip(*values)])
        error = relative_error(means)
        done = len(means) >= max_batches or time.perf_counter() - start >= budget_s or \
            (len(means) >= min_batches and error <= STABLE)
        if agree(done):
            return {"mean": [statistics.fmean(column) for column in zip(*means)], "relative_error": error,
                    "samples": batch * len(means)}


def rounds_until_stable(measure_round, quick: bool) -> dict:
    """`mean_until_stable` over whole rounds (forked ranks or runs, each a list of seconds): at least
    3 and at most 12 rounds within 40 s (quick: 2, within 5 s); "samples" counts the rounds."""
    return mean_until_stable(measure_round, batch=1, min_batches=2 if quick else 3, max_batches=12,
                             budget_s=5 if quick else 40)


FLOOR_S = 1e-7  # a measured difference noise made ≤ 0 is clamped here (and left out of the fits)


def fit_fixed_plus_rate(work: list, seconds: list) -> tuple:
    """(fixed seconds, work per second) of time = fixed + work / rate, least squares on the
    relative error (each point weighted by 1/time², so small sizes count as much as large ones).
    A negative fixed cost (noise at small sizes) is clamped to 0 and the rate refitted. Points at
    the floor (`FLOOR_S`: a difference of two timings that noise made ≤ 0, clamped) are not
    measurements and are left out: at weight 1/FLOOR² they decided the fit alone (under load here,
    2 of 6 all-reduce rows were clamped and the fit read 5.9 PB/s + 0 µs)."""
    kept = [(x, t) for x, t in zip(work, seconds) if t > FLOOR_S]
    if len(kept) >= 2:
        work, seconds = [x for x, _ in kept], [t for _, t in kept]
    weights = [1.0 / t ** 2 for t in seconds]
    sw = sum(weights)
    sx = sum(w * x for w, x in zip(weights, work))
    sy = sum(w * y for w, y in zip(weights, seconds))
    sxx = sum(w * x * x for w, x in zip(weights, work))
    sxy = sum(w * x * y for w, x, y in zip(weights, work, seconds))
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    fixed = (sy - slope * sx) / sw
    if fixed < 0 or slope <= 0:
        fixed, slope = 0.0, sxy / sxx
    return fixed, 1.0 / slope


def worst_residual(work: list, seconds: list, fixed: float, rate: float) -> float:
    """The largest |predicted / measured − 1| of a fit over its own points (those above the floor)."""
    return max((abs((fixed + x / rate) / t - 1) for x, t in zip(work, seconds) if t > FLOOR_S), default=0.0)


def fitted(work: list, seconds: list) -> tuple:
    """(fixed seconds, work per second, worst residual) of `fit_fixed_plus_rate` on these points."""
    fixed, rate = fit_fixed_plus_rate(work, seconds)
    return fixed, rate, worst_residual(work, seconds, fixed, rate)


# ----- 1. matrix products

# A CPU without bf16 units (AVX2 here: 1.7 GFLOP/s in bf16) takes ~1.3 s per 1024³ product; once three
# edges are measured and a call takes this long, the larger edges are skipped (24 s of a 48 s calibration).
SLOW_CALL_S = 0.05


def measure_matmuls(dtype: torch.dtype, edges, repeats: int) -> list:
    """[(edge, FLOPs, seconds)] of one square product per edge, in one thread."""
    rows = []
    for edge in edges:
        if len(rows) >= 3 and rows[-1][2] > SLOW_CALL_S:  # the rate is known: larger edges would take minutes
            break
        # The products run on this machine's CPU, where every rank of hardware=cpu computes.
        a = torch.randn(edge, edge, dtype=dtype)  # host: the CPU being timed
        b = torch.randn(edge, edge, dtype=dtype)  # host: the CPU being timed
        rows.append((edge, 2.0 * edge ** 3, median_seconds(lambda: torch.mm(a, b), repeats, sample_s=SAMPLE_S)))
    return rows


# ----- 2. collectives between forked ranks

def _collective_rank(rank: int, world: int, sizes, repeats: int, budget_s: float) -> list:
    """One rank's timings (the launcher set the rendezvous and one thread, as for every run):
    (bytes, all-reduce seconds after compute, round-trip seconds or None, the mean's relative error,
    samples)."""
    dist.init_process_group("gloo", rank=rank, world_size=world)
    matrix = torch.randn(384, 384)  # host: the CPU being timed
    rows = []
    for size in sizes:
        buffer = torch.zeros(size // 4)  # host: gloo all-reduces host tensors
        dist.barrier()
        reduce = mean_until_stable(lambda: [after_compute(matrix, lambda: dist.all_reduce(buffer))], batch=20,
                                   min_batches=max(3, repeats), max_batches=200, budget_s=budget_s,
                                   agree=rank_zero_decides)
        dist.barrier()
        pair_seconds = median_seconds(lambda: _send_receive(buffer, rank), repeats) if world == 2 else None
        rows.append((size, reduce["mean"][0], pair_seconds, reduce["relative_error"], reduce["samples"]))
    return rows


def after_compute(matrix: torch.Tensor, collective) -> float:
    """Seconds of one collective issued after ~3 ms of matrix products, as a run issues them: back to
    back, gloo here is bimodal (~0.4 ms, or 3–5 ms when a waiting thread wakes late); after compute
    it costs ~2 ms even for 4 KB, which is what a tensor-parallel block pays. The products are not
    timed: the peer's products still running are part of the wait, as in a run."""
    products(matrix, 2)
    start = time.perf_counter()
    collective()
    return time.perf_counter() - start


def products(matrix: torch.Tensor, count: int) -> None:
    """`count` products of `matrix` with itself: the compute a collective is timed after or behind."""
    for _ in range(count):
        torch.mm(matrix, matrix)


def rank_zero_decides(done: bool) -> bool:
    """Rank 0's `done`, on every rank (a broadcast outside the timed calls): every rank of a collective
    must make the same number of calls."""
    flag = torch.tensor([float(done)])  # host: gloo
    dist.broadcast(flag, 0)
    return bool(flag.item())


def _send_receive(buffer: torch.Tensor, rank: int) -> None:
    """One message from rank 0 to rank 1 and one back: a round trip is two one-way sends."""
    if rank == 0:
        dist.send(buffer, 1)
        dist.recv(buffer, 1)
    else:
        dist.recv(buffer, 0)
        dist.send(buffer, 0)


def measure_collectives(world: int, sizes, repeats: int, budget_s: float) -> list:
    """[(bytes, all-reduce seconds, round-trip seconds or None, relative error, samples)] measured by
    rank 0 of `world` gloo ranks forked by the run's own launcher (which leaves no rank behind); each
    size sampled until its mean is stable or `budget_s` is spent."""
    return run_ranks(_collective_rank, world, world, sizes, repeats, budget_s, timeout=600)[0]


GATHER_BYTES = 1 << 20  # a ZeRO stage of gpt_tiny gathers 0.76-1.01 MiB of fp32 parameters (one block per stage)
BEHIND_PRODUCTS = (1, 2, 4)  # products of edge 384 behind the posted gather: ~1.5-6 ms, around its ~3 ms


def _gather_overlap_rank(rank: int, world: int, budget_s: float) -> list:
    """One rank's (products behind, their seconds, the gather's seconds alone, the posted gather's
    exposed seconds, relative error, samples) per count of products behind it: ZeRO's prefetch
    (strategies/schedule/zero.py) posts a gather, computes, then waits for it."""
    dist.init_process_group("gloo", rank=rank, world_size=world)
    matrix = torch.randn(384, 384)  # host: the CPU being timed
    gathered, shard = torch.zeros(GATHER_BYTES // 4), torch.zeros(GATHER_BYTES // 4 // world)  # host: gloo

    def posted(count: int) -> None:
        work = compat.all_gather_single(gathered, shard, async_op=True)
        products(matrix, count)
        work.wait()
    rows = []
    for count in BEHIND_PRODUCTS:
        dist.barrier()
        sample = mean_until_stable(
            lambda: [after_compute(matrix, lambda: products(matrix, count)),
                     after_compute(matrix, lambda: compat.all_gather_single(gathered, shard)),
                     after_compute(matrix, lambda: posted(count))],
            batch=10, min_batches=3, max_batches=60, budget_s=budget_s, agree=rank_zero_decides)
        alone, gather, both = sample["mean"]
        rows.append((count, alone, gather, max(0.0, both - alone), sample["relative_error"], sample["samples"]))
    return rows


def hidden_share(rows: list) -> float:
    """The share of a posted gather that compute behind it hides (`cost.step_time.exposed_gather`):
    per row (gather − exposed) ÷ min(compute, gather), each clamped to [0, 1], their mean."""
    shares = [min(1.0, max(0.0, (gather - exposed) / min(alone, gather))) for _, alone, gather, exposed, *_ in rows]
    return statistics.fmean(shares)


def measure_gather_overlap(world: int, budget_s: float) -> list:
    """`_gather_overlap_rank`'s rows, as rank 0 of `world` forked gloo ranks measured them."""
    return run_ranks(_gather_overlap_rank, world, world, budget_s, timeout=600)[0]


# ----- 3. host copies

def measure_copies(sizes, repeats: int) -> list:
    """[(bytes, seconds)] of copy_ between two host buffers."""
    rows = []
    for size in sizes:
        source, target = torch.ones(size // 4), torch.empty(size // 4)  # host: host-to-host copies
        rows.append((size, median_seconds(lambda: target.copy_(source), repeats, sample_s=SAMPLE_S)))
    return rows


# ----- 4. a block's non-product work, and the optimizer step

def model_blocks(cfg, count: int) -> list:
    """`count` of the model group's blocks, built as the model builds them, on this CPU."""
    model = cfg.model
    return [build_block(hidden=model.hidden, heads=model.heads, mlp_ratio=model.mlp_ratio, dropout=model.dropout,
                        causal=model.architecture == "gpt", seed=0, index=index, layers=count, device="cpu")
            for index in range(count)]


def block_seconds(cfg, rows_per_micro_batch, repeats: int, blocks: int = 2) -> list:
    """[(rows, seconds)] of a stage of `blocks` of the model's blocks (a stage, so caches hold what they
    hold between blocks in a run), forward + backward of a micro-batch of `rows` sequences, ÷ 3 ÷
    `blocks`: a block forward's share, the backward charged 2× like the products (cost/step_time.py)."""
    model, length = cfg.model, min(cfg.data.sequence_length, cfg.model.max_sequence_length)
    stage = torch.nn.Sequential(*model_blocks(cfg, blocks))
    measured = []
    for rows in rows_per_micro_batch:
        x = torch.randn(rows, length, model.hidden, requires_grad=True)  # host: the CPU being timed
        seconds = median_seconds(lambda: stage.train()(x).sum().backward(), repeats, sample_s=SAMPLE_S)
        measured.append((rows, seconds / 3 / blocks))
    return measured


def block_rows(cfg, products: dict, measured: list) -> list:
    """[(activation elements, seconds)]: each `block_seconds` row less its products' modelled time
    (at the calibrated rate and fixed cost), against the elements a block saves as priced."""
    from cost.step_time import PRODUCTS_PER_BLOCK, forward_flops
    from cost.inputs import Workload
    from cost.memory import block_saved_bytes
    model, length = cfg.model, min(cfg.data.sequence_length, cfg.model.max_sequence_length)
    priced = []
    for rows, seconds in measured:
        workload = Workload(GptShape(model.hidden, model.mlp_ratio, 1, length, length), 1, model.heads,
                            Layout(1, 1), 1, rows)
        modelled = forward_flops(workload, 0, 2) / products["flops_per_second"] + \
            PRODUCTS_PER_BLOCK * products["overhead_s"]
        elements = block_saved_bytes(workload, rows * length, flash=True) / workload.activation_bytes  # as priced
        priced.append((elements, max(seconds - modelled, FLOOR_S)))
    return priced


def optimizer_rows(cfg, block_counts, repeats: int) -> list:
    """[(parameters, seconds)] of the configured optimizer's step over 1 … n of the model's blocks."""
    measured = []
    for count in block_counts:
        named = [(f"{i}.{name}", p) for i, b in enumerate(model_blocks(cfg, count)) for name, p in b.named_parameters()]
        for _, parameter in named:
            parameter.grad = torch.randn_like(parameter)  # host: the CPU being timed
        optimizer = build_optimizer(cfg.optimizer, named)
        measured.append((sum(p.numel() for _, p in named), median_seconds(optimizer.step, repeats, sample_s=SAMPLE_S)))
    return measured


# ----- 5. the framework's own costs: per step and per action

# Two tiny runs of the model group, where the framework's costs are most of the step: one stage and
# one action pair per step (`single`), and a 2-stage 1F1B pipeline of 4 micro-batches (~50 actions).
FRAMEWORK_RUNS = (("strategy=single", "hardware.devices_per_node=1"),
                  ("strategy=one_f_one_b", "strategy.layers_per_stage=1", "hardware.devices_per_node=2"))
TINY_RUN = ("model.layers=2", "data.global_batch_size=4", "data.sequence_length=8", "logger=none",
            "trainer.progress=none", "trainer.limit_val_batches=0", "trainer.charts=false",
            "trainer.measure_every_n_steps=1000")  # the meter samples the first 2 steps and the last only


def framework_configs(cfg, profile: dict, overrides, steps: int) -> tuple:
    """(plan config, the same with 1 ms per action, run config) of one tiny run, priced with
    `profile` with its step and action costs 0."""
    from layerwise.config.store import compose

    def config(*more):
        composed = compose([f"model={cfg.model.name}", *overrides, *TINY_RUN, f"trainer.max_steps={steps}", *more])
        composed.hardware = OmegaConf.merge(composed.hardware, {**profile, "step_overhead_s": 0.0,
                                                                "action_overhead_s": 0.0})
        return composed
    planned, charged, run = config("mode=plan"), config("mode=plan"), config()
    charged.hardware.action_overhead_s = 1e-3
    return planned, charged, run


def framework_price(planned, charged) -> tuple:
    """(predicted step without the framework's costs, d predicted / d action cost) of a tiny run."""
    from layerwise.config.validate import world_size
    from layerwise.planning.result import plan_result
    world = world_size(planned)  # FRAMEWORK_RUNS are fixed, valid configs: no preflight (a floor above tools)
    predicted = plan_result(planned, world)["step_time_s"]
    return predicted, (plan_result(charged, world)["step_time_s"] - predicted) / 1e-3


def framework_step(run) -> float:
    """The measured median step of one tiny run."""
    from layerwise.config.validate import world_size
    from layerwise.run.fit import train
    with tempfile.TemporaryDirectory() as directory, contextlib.redirect_stdout(io.StringIO()):
        return train(run, Path(directory), world_size(run))["step_time_s_median"]


def calibrate_framework(cfg, profile: dict, quick: bool, say) -> dict:
    """Solve the two tiny runs' unpriced seconds (measured − predicted) = step cost + actions × action
    cost for both (clamped at 0), their measured steps averaged over runs until stable."""
    configs = [framework_configs(cfg, profile, overrides, 8 if quick else 14) for overrides in FRAMEWORK_RUNS]
    prices = [framework_price(planned, charged) for planned, charged, _ in configs]
    steps = rounds_until_stable(lambda: [framework_step(run) for *_, run in configs], quick)
    rows = [(measured, *price) for measured, price in zip(steps["mean"], prices)]
    (single, single_priced, single_actions), (pipeline, pipeline_priced, pipeline_actions) = rows
    action = max(0.0, ((pipeline - pipeline_priced) - (single - single_priced)) / (pipeline_actions - single_actions))
    step = max(0.0, single - single_priced - action * single_actions)
    say(f"the framework's own costs: {step * 1e3:.2f} ms per step + {action * 1e6:.0f} µs per action "
        f"(tiny runs: {single * 1e3:.1f} ms and {pipeline * 1e3:.1f} ms measured over {steps['samples']} runs each, "
        f"±{steps['relative_error']:.1%}; {single_priced * 1e3:.1f} ms and {pipeline_priced * 1e3:.1f} ms priced "
        "without them)")
    return {"rows": rows, "step_overhead_s": step, "action_overhead_s": action,
            "relative_error": steps["relative_error"], "runs": steps["samples"]}


# ----- every core at once, as runs compute

def _measure_rank(rank: int, measure, *arguments) -> list:
    return measure(*arguments)


def on_every_core(measure, *arguments) -> list:
    """`measure(*arguments)`'s rows measured on every core at once (one forked rank each, one thread,
    as runs place their ranks), each row's seconds averaged over the ranks: ranks that compute side by
    side share the memory bandwidth and caches, which a lone process does not see (element-wise work
    measured alone was ~15% faster than inside a 2-rank run)."""
    by_rank = run_ranks(_measure_rank, os.cpu_count() or 1, measure, *arguments, timeout=600)
    shortest = min(by_rank, key=len)  # a rank may stop at a smaller edge (`SLOW_CALL_S`)
    return [(*row[:-1], statistics.mean(rows[index][-1] for rows in by_rank)) for index, row in enumerate(shortest)]


# ----- the profile

def calibrate(cfg) -> dict:
    """Measure, fit, write `<directory>/<name>.yaml` and `<name>.calibration.json`; returns the profile."""
    settings = cfg.calibrate
    repeats = max(3, settings.repeats)

    def say(message: str) -> None:
        if not settings.silent:
            print(f"[layerwise] {message}", flush=True)
    threads = torch.get_num_threads()  # everything is timed in one thread, as a run's ranks compute
    try:
        torch.set_num_threads(1)
        profile, measurements = _measure(cfg, settings, repeats, say)
    finally:  # a caller that goes on to train (benchmarks/plan_vs_measured.py) keeps its threads
        torch.set_num_threads(threads)
    return write_profile(Path(settings.directory), settings.name, profile, measurements, say)


def _measure(cfg, settings, repeats: int, say) -> tuple:
    """(the profile's fields, every measurement) of mode=calibrate."""
    measurements = {f"matmul_{name}": calibrate_matmuls(dtype, settings.quick, repeats, say)
                    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    for world in settings.world_sizes:
        measurements[f"collectives_world_{world}"] = calibrate_collectives(world, settings.quick, repeats, say)
    measurements["gather_overlap"] = calibrate_gather_overlap(settings.world_sizes[0], settings.quick, say)
    measurements["host_copies"] = calibrate_copies(settings.quick, repeats, say)
    measurements["blocks"] = calibrate_blocks(cfg, measurements["matmul_fp32"], settings.quick, repeats, say)
    measurements["optimizer"] = calibrate_optimizer(cfg, settings.quick, repeats, say)
    profile = profile_from(cfg.hardware, settings.name, measurements,
                           measurements[f"collectives_world_{settings.world_sizes[0]}"])
    measurements["framework"] = calibrate_framework(cfg, profile, settings.quick, say)
    profile.update(step_overhead_s=measurements["framework"]["step_overhead_s"],
                   action_overhead_s=measurements["framework"]["action_overhead_s"])
    return profile, measurements


def calibrate_matmuls(dtype: torch.dtype, quick: bool, repeats: int, say) -> dict:
    rows = on_every_core(measure_matmuls, dtype, QUICK_MATMUL_EDGES if quick else MATMUL_EDGES, repeats)
    overhead, rate, residual = fitted([r[1] for r in rows], [r[2] for r in rows])
    say(f"matrix products {dtype}: {rate / 1e9:.1f} GFLOP/s + {overhead * 1e6:.0f} µs each "
        f"(worst fit residual {residual:.0%})")
    return {"rows": rows, "overhead_s": overhead, "flops_per_second": rate, "worst_residual": residual}


def calibrate_collectives(world: int, quick: bool, repeats: int, say) -> dict:
    rows = measure_collectives(world, QUICK_COLLECTIVE_BYTES if quick else COLLECTIVE_BYTES, repeats,
                               budget_s=1.0 if quick else 8.0)
    work = [2 * (world - 1) / world * r[0] for r in rows]  # ring all-reduce: bytes each rank sends
    latency, bandwidth, residual = fitted(work, [r[1] for r in rows])
    entry = {"rows": rows, "all_reduce_latency_s": latency, "all_reduce_bandwidth": bandwidth,
             "worst_residual": residual, "table": sorted(zip(work, [r[1] for r in rows])),
             "worst_relative_error": max(r[3] for r in rows)}
    if world == 2:  # a round trip is two one-way messages
        entry["send_latency_s"], entry["send_bandwidth"] = fit_fixed_plus_rate(
            [r[0] for r in rows], [r[2] / 2 for r in rows])
    say(f"gloo all-reduce, {world} ranks: {bandwidth / 1e9:.2f} GB/s per rank + {latency * 1e6:.0f} µs "
        f"(worst fit residual {entry['worst_residual']:.0%}; {min(r[4] for r in rows)}-{max(r[4] for r in rows)} "
        f"samples per size, worst standard error ±{entry['worst_relative_error']:.1%})")
    return entry


def calibrate_gather_overlap(world: int, quick: bool, say) -> dict:
    rows = measure_gather_overlap(world, budget_s=0.5 if quick else 4.0)
    share = hidden_share(rows)
    say(f"posted gloo gather of {GATHER_BYTES >> 20} MB, {world} ranks: compute behind it hides {share:.0%} of it ("
        + "; ".join(f"{exposed * 1e3:.1f} of {gather * 1e3:.1f} ms exposed behind {alone * 1e3:.1f} ms of products"
                    for _, alone, gather, exposed, *_ in rows) + ")")
    return {"rows": rows, "hidden_share": share}


def calibrate_copies(quick: bool, repeats: int, say) -> dict:
    rows = measure_copies(QUICK_COPY_BYTES if quick else COPY_BYTES, repeats)
    overhead, bandwidth = fit_fixed_plus_rate([r[0] for r in rows], [r[1] for r in rows])
    say(f"host copies: {bandwidth / 1e9:.1f} GB/s")
    return {"rows": rows, "overhead_s": overhead, "bandwidth": bandwidth}


def calibrate_blocks(cfg, products: dict, quick: bool, repeats: int, say) -> dict:
    """Rounds of `block_seconds` on every core (each round its own forked ranks: rounds differed by up to
    ±25% at one sequence here, more than samples within a round) until their mean is stable."""
    sizes = (1, 2) if quick else (1, 2, 4, 8)
    rounds = rounds_until_stable(lambda: [r[1] for r in on_every_core(block_seconds, cfg, sizes, repeats)], quick)
    rows = block_rows(cfg, products, list(zip(sizes, rounds["mean"])))
    overhead, rate, residual = fitted([r[0] for r in rows], [r[1] for r in rows])
    say(f"{cfg.model.name} block besides its products: {overhead * 1e6:.0f} µs + {1e9 / rate:.1f} ns per "
        f"activation element, per forward (worst fit residual {residual:.0%}; {rounds['samples']} rounds, "
        f"block time ±{rounds['relative_error']:.1%})")
    return {"rows": rows, "overhead_s": overhead, "elements_per_second": rate,
            "relative_error": rounds["relative_error"], "rounds": rounds["samples"]}


def calibrate_optimizer(cfg, quick: bool, repeats: int, say) -> dict:
    rows = on_every_core(optimizer_rows, cfg, (1, 2) if quick else (1, 2, 4, 8), repeats)
    overhead, rate = fit_fixed_plus_rate([r[0] for r in rows], [r[1] for r in rows])
    say(f"{cfg.optimizer.name} step: {1e9 / rate:.2f} ns per parameter + {overhead * 1e6:.0f} µs")
    return {"rows": rows, "overhead_s": overhead, "parameters_per_second": rate}


def profile_from(hardware, name: str, measurements: dict, collectives: dict) -> dict:
    """The hardware profile: the measured rates over the base profile's other fields. Gloo's
    loopback is the only link here, so intra- and inter-node bandwidths are both its measure."""
    base = OmegaConf.to_container(hardware, resolve=True)
    base.update(name=name, peak_flops={dtype: measurements[f"matmul_{dtype}"]["flops_per_second"]
                                       for dtype in ("fp32", "bf16")},
                matmul_overhead_s=measurements["matmul_fp32"]["overhead_s"],
                collective_latency_s=collectives["all_reduce_latency_s"],
                collective_seconds_by_bytes=[[sent, seconds] for sent, seconds in collectives["table"]],
                intra_node_bandwidth=collectives["all_reduce_bandwidth"],
                inter_node_bandwidth=collectives["all_reduce_bandwidth"],
                host_device_bandwidth=measurements["host_copies"]["bandwidth"],
                block_overhead_s=measurements["blocks"]["overhead_s"],
                activation_seconds_per_element=1.0 / measurements["blocks"]["elements_per_second"],
                optimizer_seconds_per_parameter=1.0 / measurements["optimizer"]["parameters_per_second"],
                compute_units_per_node=os.cpu_count(), overlaps_communication=False,  # gloo uses the cores
                gather_overlap=measurements["gather_overlap"]["hidden_share"],
                matmul_efficiency=1.0,  # peak_flops above is the achieved rate: plan mode needs no plan.efficiency
                point_to_point_latency_s=max(collectives.get("send_latency_s", 0.0), 1e-6))  # 0 would mean "unset"
    return base


def write_profile(directory: Path, name: str, profile: dict, measurements: dict, say) -> dict:
    """Write the profile YAML (with the schema default the hardware group uses) and the raw JSON,
    each atomically (a temporary file renamed)."""
    directory.mkdir(parents=True, exist_ok=True)
    body = OmegaConf.to_yaml(OmegaConf.create(profile))
    text = ("# Written by `python train.py mode=calibrate`: measured on this machine "
            f"({time.strftime('%Y-%m-%d %H:%M')}, load {os.getloadavg()[0]:.2f}); see {name}.calibration.json\n"
            "defaults:\n  - /schema_hardware_hardware@_here_\n  - _self_\n" + body)
    for path, content in ((directory / f"{name}.yaml", text),
                          (directory / f"{name}.calibration.json", json.dumps(measurements, indent=2))):
        temporary = path.with_suffix(path.suffix + ".tmp")
        temporary.write_text(content)
        os.replace(temporary, path)
    say(f"hardware profile written to {directory / (name + '.yaml')}: use hardware={name} "
        "(its peak is the achieved rate: matmul_efficiency 1, plan.efficiency is not read)")
    return profile
