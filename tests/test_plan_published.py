"""Plan mode against published Megatron-LM throughput (layerwise/reproduce/published.py, issues 31
and 56): each row is a `train.py mode=plan` configuration priced by plan mode's own workload of it
(what Megatron does that no switch of ours does is named, MEGATRON_ONLY), FLOPs are counted as each
source counts them, and every row is within ±10% of its published figure except the misses listed
with their reason."""

import math

import pytest
from omegaconf import OmegaConf

from cost.step_time import closed_form_step
from layerwise.config.store import compose
from layerwise.planning.inputs import device_of, workload_of
from layerwise.reproduce import published

FITTED_EFFICIENCY = 0.64  # fit_efficiency on the tuned rows (benchmarks/plan_vs_published.py prints it)
# Held-out rows outside ±10%, each with why (docs/plan.md, "Against published runs"):
NEWER_CODE = ("the same per-pipeline work as N21's row of that size (the same layout, batch per pipeline "
              "and micro-batch), published 8-9% faster a year later; the one large-product rate was fitted on "
              "N21's rows, so it prices K22's code as N21's (test_k22s_misses_are_n21s_layouts_run_faster)")
# Megatron-LM under --bf16 reduces its gradients in fp32 (megatron/training/arguments.py sets
# accumulate_allreduce_grads_in_fp32 unless --grad-reduce-in-bf16), as our default
# strategy.reduction_dtype=fp32 does: priced so, these two rows' reduce-scatters cost what the old
# MEGATRON_ONLY term (16-bit gradients on every row) halved, and they fall out (+7.0% -> -12.6%, -8.4% -> -11.1%)
BF16_GRADIENTS = ("under-predicted with the fp32 gradient reduce-scatter Megatron-LM's --bf16 runs do; within "
                  "±10% only if those gradients were reduced in 16 bits (strategy.reduction_dtype=compute)")
KNOWN_MISSES = {"K22 530B": NEWER_CODE, "K22 1T": NEWER_CODE, "M24 32B": BF16_GRADIENTS, "M24 314B": BF16_GRADIENTS,
                "K22 1T selective": "K22 1T's layout with selective recomputation, off as much as that full "
                                    "row (-13% both): " + NEWER_CODE}


@pytest.fixture(scope="module")
def base():
    return compose(["model=gpt3_175b", "hardware=dgx_a100_80g", "logger=none", f"plan.efficiency={FITTED_EFFICIENCY}"])


@pytest.fixture(scope="module")
def runs():
    return published.read_runs()


def test_the_csv_rows_are_consistent_layouts(runs):
    """t·p·d = GPUs, the batch splits into whole micro-batches, virtual stages divide the layers, and
    the split was fixed up front: Narayanan's even rows tuned, the rest held out."""
    assert len(runs) == 27
    for index, run in enumerate(runs):
        assert run.tensor_parallel * run.pipeline_parallel * run.data_parallel == run.gpus, run.name
        assert run.global_batch % (run.data_parallel * run.micro_batch) == 0, run.name
        assert run.layers % (run.pipeline_parallel * run.virtual_stages) == 0, run.name
        assert run.split == ("tune" if run.source == "N21" and index % 2 == 0 else "holdout"), run.name


def test_flops_are_counted_as_each_source_counts(runs):
    """Narayanan's eq. 3 on the 1T row; the README's 1.7B H100 row by hand:
    72 · 192 · 4096 · 24 · 2048² · (1 + 1/3 + 2/9) = 8.8665e15 FLOPs."""
    trillion = next(run for run in runs if run.name == "N21 1008.0B")
    b, s, l, h, v = 3072, 2048, 128, 25600, 51200
    assert published.counted_flops(trillion) == pytest.approx(96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h)))
    small = next(run for run in runs if run.name == "M24 1.7B")
    assert published.counted_flops(small) == pytest.approx(8.8665e15, rel=1e-4)


def test_the_table_is_plan_modes_closed_form(base, runs):
    """A row's predicted TFLOP/s is counted FLOPs over the closed form's step × GPUs; the closed form
    prices plan mode's workload of the row's configuration (`workload_of`, what train.py mode=plan
    prices) with only the named MEGATRON_ONLY terms on top."""
    run = next(run for run in runs if run.name == "N21 145.6B")
    row = published.predict(base, run)
    cfg, world = published.published_config(run, base.plan.efficiency)
    workload = workload_of(cfg, world)
    # an fp16 run: 16-bit partial sums (the default) and gradients (its command's strategy.reduction_dtype=compute)
    assert (workload.tensor_bytes, workload.reduction_bytes) == (2, 2)
    assert "strategy.tensor_collective_dtype=compute" in row["command"] and "strategy.reduction_dtype=compute" in row["command"]
    assert published.MEGATRON_ONLY == {}  # nothing of Megatron's is priced outside our switches
    step = closed_form_step(workload, device_of(cfg, world), "interleaved_one_f_one_b", 48)
    assert row["step_time_s"] == step["step_seconds"]
    assert row["predicted_tflops_per_gpu"] == pytest.approx(published.counted_flops(run) / (step["step_seconds"] * run.gpus) / 1e12)
    assert cfg.strategy.layers_per_stage == 5 and cfg.strategy.name == "interleaved_1f1b"  # run_table_1.sh: v = 2


def test_a_row_is_the_command_a_user_types(base, runs):
    """Each row's configuration is `python train.py` with `overrides_of`: it composes and passes
    train.py's validation (the strategy checks build the plan: checked here on rows whose plans are
    small), and its switches become the workload's fields through the one mapping: messages in the
    compute dtype (2 bytes under 16-mixed), scatter/gather on the 1-D grid between stages, sequence
    parallelism, the distributed optimizer and tensor overlap where the run used them, materialised
    scores without a flash kernel, selective recomputation as the core attention rerun."""
    by_name = {run.name: run for run in runs}
    k22 = published.predict(base, by_name["K22 22B selective"], checked=True)
    assert k22["command"].startswith("python train.py mode=plan model=gpt3_175b model.name=K22_22B_selective")
    for name in ("K22 22B selective", "M24 70B", "N21 145.6B"):
        cfg, world = published.published_config(by_name[name], 0.64, checked=name != "N21 145.6B")
        workload = workload_of(cfg, world)
        assert workload.message_bytes == 2
        if name == "K22 22B selective":
            assert workload.recompute_attention and workload.sequence_parallel and workload.attention_scores
            assert not workload.recompute and not workload.reduction_overlaps_backward
        if name == "M24 70B":
            assert workload.distributed_optimizer and workload.tensor_overlap and workload.sequence_parallel
            assert workload.reduction_overlaps_backward and not workload.attention_scores
            assert not workload.scatter_gather  # the sequence-parallel boundary is already the 1/t shard
        if name == "N21 145.6B":
            assert workload.scatter_gather and workload.attention_scores and workload.recompute
            assert not (workload.sequence_parallel or workload.distributed_optimizer or workload.tensor_overlap)


def test_every_published_row_is_within_ten_percent_but_the_listed_misses(base, runs):
    rows = published.validation_table(base, runs)
    misses = {row["run"]: row["error"] for row in rows if abs(row["error"]) > published.TOLERANCE}
    assert set(misses) == set(KNOWN_MISSES), misses
    for row in rows:
        assert math.isfinite(row["error"])
    stats = published.summary(rows)
    assert stats["tune"]["worst"] <= published.TOLERANCE
    assert [stats[source]["rows"] for source in ("N21", "M24", "K22")] == [10, 9, 8]
    assert stats["M24"]["within"] == 7 and stats["K22"]["within"] == 5


def test_an_h100_row_computes_at_the_a100_fit_times_its_measured_matmul_efficiency(base, runs):
    """dgx_h100.yaml's relative_matmul_efficiency is the ratio of two figures of one published table
    (largest measured bf16 matmul ÷ peak: H100 SXM 794.5 / 989, A100 SXM 271.2 / 312), not a fit. An
    H100 row's products run at the A100 fit × it; at the A100's efficiency the row misses by > 10%."""
    h100 = OmegaConf.load(published.ROOT / "conf/hardware/dgx_h100.yaml")
    assert h100.relative_matmul_efficiency == pytest.approx((794.5 / 989) / (271.2 / 312), abs=5e-4)
    run = next(run for run in runs if run.name == "M24 7.1B")
    assert abs(published.predict(base, run)["error"]) <= published.TOLERANCE
    config, world = published.published_config(run, base.plan.efficiency)
    assert device_of(config, world).efficiency == pytest.approx(FITTED_EFFICIENCY * 0.924)
    config.hardware.relative_matmul_efficiency = 1.0
    step = closed_form_step(published.priced_workload(config, world), device_of(config, world),
                            config.strategy.schedule, config.strategy.micro_batches)["step_seconds"]
    assert published.counted_flops(run) / (step * run.gpus) / 1e12 / run.published_throughput - 1 > published.TOLERANCE


def test_the_fitted_rate_comes_from_the_tuned_rows_only(base, runs):
    """Moving a held-out row's published figure does not move the fit; the fit is the one in use."""
    assert published.fit_efficiency(base, runs) == pytest.approx(FITTED_EFFICIENCY, abs=0.002)
    from dataclasses import replace
    moved = [replace(run, published_tflops_per_gpu=1.0, published_step_s=1.0) if run.split == "holdout" else run
             for run in runs]
    assert published.fit_efficiency(base, moved) == pytest.approx(FITTED_EFFICIENCY, abs=0.002)


def test_a_published_step_time_is_counted_as_throughput(base, runs):
    """K22 publishes seconds per iteration: its TFLOP/s per GPU are Narayanan's count over that time,
    so the error is the published step over the predicted one, less 1."""
    run = next(run for run in runs if run.name == "K22 22B")
    assert run.published_tflops_per_gpu == 0 and run.published_step_s == 1.42
    assert run.published_throughput == pytest.approx(published.counted_flops(run) / (1.42 * 8) / 1e12)
    row = published.predict(base, run)
    assert row["error"] == pytest.approx(1.42 / row["step_time_s"] - 1)


def test_k22s_misses_are_n21s_layouts_run_faster(base, runs):
    """K22's 530B and 1T rows run N21's 529.6B and 1T layouts per pipeline (tensor 8, the same
    pipeline, interleaving, micro-batch 1 and micro-batches per pipeline; N21 adds data parallelism).
    The model prices each pair within 1% (N21's reduction after the backward), while the published
    steps differ by 8-9%: the later code ran faster, which a rate fitted on N21 cannot see."""
    by_name = {run.name: run for run in runs}
    for n21, k22 in (("N21 529.6B", "K22 530B"), ("N21 1008.0B", "K22 1T")):
        older, newer = by_name[n21], by_name[k22]
        assert (older.layers, older.hidden, older.tensor_parallel, older.pipeline_parallel, older.virtual_stages,
                older.micro_batch) == (newer.layers, newer.hidden, newer.tensor_parallel, newer.pipeline_parallel,
                                       newer.virtual_stages, newer.micro_batch)
        assert older.micro_batches == newer.micro_batches
        predicted_older, predicted_newer = (published.predict(base, run)["step_time_s"] for run in (older, newer))
        assert predicted_older / predicted_newer == pytest.approx(1.0, abs=0.01)
        published_older = published.counted_flops(older) / (older.published_tflops_per_gpu * 1e12 * older.gpus)
        assert 0.07 < published_older / newer.published_step_s - 1 < 0.11


def test_selective_recomputation_reruns_only_the_core_attention(base, runs):
    """K22's selective rows (Korthikanti et al. 2022 §5): the forward is unchanged, and the backward
    carries one more forward of each block's core attention, counted here by hand on the 175B row's
    stage (4 blocks; per rank 96/8 heads of d = 128, s = 2048, micro-batch 1): Q·Kᵀ and scores·V are
    2·s·d·s FLOPs each per head, compute-bound on an A100 (their s·d + d·s + s·s 16-bit elements
    take less time over HBM), and the softmax and dropout pass over the scores' 5 bytes per head
    and position (Korthikanti §4.1's 5·a·s), written and read once."""
    from dataclasses import replace
    from cost.step_time import stage_seconds
    run = next(run for run in runs if run.name == "K22 175B selective")
    config, world = published.published_config(run, base.plan.efficiency)
    workload, device = published.priced_workload(config, world), device_of(config, world)
    assert workload.recompute_attention and not workload.recompute and workload.layers_per_stage == 4
    stages = workload.layers // workload.layers_per_stage
    forward, backward = stage_seconds(workload, device, 1, stages)
    plain_forward, plain_backward = stage_seconds(replace(workload, recompute_attention=False), device, 1, stages)
    s, d, heads = 2048, 128, 96 // 8
    products = 2 * heads * 2 * s * d * s / (device.flops_per_second * device.efficiency)
    assert 2 * (s * d + d * s + s * s) * 2 / device.memory_bandwidth < 2 * 2 * s * d * s / (device.flops_per_second * device.efficiency)
    scores = 2 * s * heads * s * 5 / device.memory_bandwidth
    assert forward == plain_forward
    assert backward - plain_backward == pytest.approx(4 * (products + scores), rel=1e-9)


def test_memory_bound_bytes_derive_from_the_block_description():
    """GPT's block reproduces Korthikanti et al. 2022 §4.1 (10h whole + 24h split + 5·a·s per token);
    a Llama block (RMSNorm, SwiGLU, RoPE, grouped-query attention, no dropout) counts its own: no
    masks, k and v kv_heads wide, SwiGLU's 3·ffn, RoPE's pass over q and k, 2 bytes of scores."""
    from cost.inputs import GptShape
    from cost.step_time import memory_bound_bytes_per_token
    from models import describe_block
    gpt = GptShape(hidden=1024, mlp_ratio=4, vocabulary=512, length=256, max_length=256)
    assert memory_bound_bytes_per_token(gpt, 16) == (10 * 1024, 24 * 1024, 5 * 16 * 256)
    block = describe_block("llama", hidden=1024, heads=16, kv_heads=4, ffn_hidden=2816)
    llama = GptShape(hidden=1024, mlp_ratio=4, vocabulary=512, length=256, max_length=256, block=block,
                     position_table=False)
    d = 1024 // 16
    split = 2 * ((16 + 2 * 4) * d + 1024 + 3 * 2816) + 2 * (16 + 4) * d
    assert memory_bound_bytes_per_token(llama, 16) == (8 * 1024, split, 2 * 16 * 256)


@pytest.fixture(scope="module")
def vtrain(base):
    runs = published.read_runs(published.VTRAIN_RUNS)
    return runs, published.validation_table(base, runs)


def test_vtrains_measured_runs_are_whole_held_out_layouts(vtrain):
    """109 rows of vTrain's ground truth (Megatron-DeepSpeed on A100 nodes of 8), each a consistent
    layout, all held out (the rate is still the one fitted on N21's tuned rows)."""
    runs, _ = vtrain
    assert len(runs) == 109 and {run.split for run in runs} == {"holdout"}
    assert len({run.name for run in runs}) == 109
    for run in runs:
        assert run.tensor_parallel * run.pipeline_parallel * run.data_parallel == run.gpus, run.name
        assert run.global_batch % (run.data_parallel * run.micro_batch) == 0, run.name
        assert run.layers % run.pipeline_parallel == 0 and run.published_step_s > 0, run.name


def test_vtrains_runs_are_predicted_as_docs_plan_md_says(vtrain):
    """docs/plan.md ("vTrain's measured runs"): 65 of 109 within ±10%, median |error| 8.2%. Held to
    at least 60 and below 9%, so a change that loses five rows or most of a point must say so."""
    _, rows = vtrain
    stats = published.summary(rows)["all"]
    assert stats["within"] >= 60 and stats["median"] < 0.09, stats


def test_tensor_groups_across_two_nodes_use_every_nic(vtrain):
    """vTrain measured tensor parallelism 16 over two 8-GPU nodes (6 rows) at 10.6-20.4 s. Priced at
    one GPU's NIC the model said 26-67 s (2.5-5× too slow); with NCCL's ring per NIC
    (`cost.step_time.link_bandwidth`) each is predicted within -10%..+40% of its measurement (the
    small micro-batches run slower than any product roofline says). The data-64 rows (8 members per
    node) within ±5%."""
    _, rows = vtrain
    across = [row for row in rows if " t16 " in row["run"]]
    assert len(across) == 6
    for row in across:
        assert -0.10 < row["error"] < 0.40, row
    wide = [row for row in rows if " t1 d64 " in row["run"]]
    assert len(wide) == 3 and all(abs(row["error"]) < 0.05 for row in wide), wide
