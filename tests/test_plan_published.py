"""Plan mode against published Megatron-LM throughput (layerwise/reproduce/published.py, issue 31):
the table is plan mode's own closed form, FLOPs are counted as each source counts them, and every
row is within ±10% of its published figure except the misses listed with their reason."""

import math

import pytest

from cost.step_time import closed_form_step
from layerwise.config.store import compose
from layerwise.planning.search import Evaluator
from layerwise.reproduce import published

FITTED_EFFICIENCY = 0.64  # fit_efficiency on the tuned rows (benchmarks/plan_vs_published.py prints it)
# Held-out rows outside ±10%, each with why (docs/plan.md, "Against published runs"):
H100_LAYOUT = ("the README's H100 runs do not publish micro-batch, interleaving or recomputation: priced at "
               "micro-batch 1, no interleaving, no recomputation (assumed); a tensor-8 row, over-predicted: "
               "the one large-product rate was fitted on A100 rows")
KNOWN_MISSES = {"M24 32B": H100_LAYOUT, "M24 70B": H100_LAYOUT, "M24 119B": H100_LAYOUT}


@pytest.fixture(scope="module")
def base():
    return compose(["model=gpt3_175b", "hardware=dgx_a100_80g", "logger=none", f"plan.efficiency={FITTED_EFFICIENCY}"])


@pytest.fixture(scope="module")
def runs():
    return published.read_runs()


def test_the_csv_rows_are_consistent_layouts(runs):
    """t·p·d = GPUs, the batch splits into whole micro-batches, virtual stages divide the layers, and
    the split was fixed up front: Narayanan's even rows tuned, the rest held out."""
    assert len(runs) == 19
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
    """A row's predicted TFLOP/s is counted FLOPs over the closed form's step × GPUs, and the closed form
    is the search's Evaluator's own formula: without the run's software fields, its step equals the
    Evaluator's for that layout."""
    run = next(run for run in runs if run.name == "N21 145.6B")
    row = published.predict(base, run)
    evaluate = Evaluator(published.point_config(base, run), run.gpus)
    layout = published.point_of(run)
    step = closed_form_step(published.workload_of(evaluate, run), evaluate.device, layout.schedule,
                            layout.micro_batches, layout.breadth_first_micro_batches)
    assert row["step_time_s"] == step["step_seconds"]
    assert row["predicted_tflops_per_gpu"] == pytest.approx(published.counted_flops(run) / (step["step_seconds"] * run.gpus) / 1e12)
    plain = closed_form_step(evaluate.workload(layout), evaluate.device, layout.schedule, layout.micro_batches)
    assert plain["step_seconds"] == pytest.approx(evaluate(layout)["step_time_s"])
    assert layout.family == "interleaved_1f1b" and layout.layers_per_stage == 5  # run_table_1.sh: v = 2


def test_every_published_row_is_within_ten_percent_but_the_listed_misses(base, runs):
    rows = published.validation_table(base, runs)
    misses = {row["run"]: row["error"] for row in rows if abs(row["error"]) > published.TOLERANCE}
    assert set(misses) == set(KNOWN_MISSES), misses
    for row in rows:
        assert math.isfinite(row["error"])
    assert published.summary(rows)["tune"]["worst"] <= published.TOLERANCE


def test_the_fitted_rate_comes_from_the_tuned_rows_only(base, runs):
    """Moving a held-out row's published figure does not move the fit; the fit is the one in use."""
    assert published.fit_efficiency(base, runs) == pytest.approx(FITTED_EFFICIENCY, abs=0.002)
    from dataclasses import replace
    moved = [replace(run, published_tflops_per_gpu=1.0) if run.split == "holdout" else run for run in runs]
    assert published.fit_efficiency(base, moved) == pytest.approx(FITTED_EFFICIENCY, abs=0.002)


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
