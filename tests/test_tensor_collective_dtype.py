"""16-bit tensor collectives (strategy.tensor_collective_dtype, issue 56) and 16-bit data-parallel
gradient reductions (strategy.reduction_dtype).

The 1-D grid under bf16-mixed: with `compute` (the default, Megatron-LM's) its partial sums are
all-reduced — with sequence parallelism reduce-scattered — in bf16, with `fp32` in fp32 (today's
path). Each equals `single` under bf16-mixed within tolerances.BF16_COLLECTIVE_*; the bytes of the
partial sums halve, counted. The pipelines' data-parallel reduction with `reduction_dtype=compute`
moves bf16 gradients (the bucket all-reduce, and the distributed optimizer's reduce-scatter), equal
to single within the same bound, bytes halved. Under 32-true neither switch changes anything
(`wire_dtype`, `on_wire`: fp32 either way).
"""

import pytest
import torch

from parallel.comm import Group
from strategies.buckets import on_wire
from strategies.tensor_parallel.collectives import wire_dtype
from tests.references import SgdComparison, SgdRun, bf16_adamw_against_single, sgd_reference
from tests.tolerances import (BF16_COLLECTIVE_GRADIENT_RTOL, BF16_COLLECTIVE_GRADIENT_SCALE_ATOL, EXACT_RTOL,
                              assert_same_with_bf16_messages)

BF16 = "hardware.precision=bf16-mixed"
TP = ["strategy=tp_1d", "strategy.tensor_grid=2", "hardware.devices_per_node=2"]
TENSOR = {"compute": [*TP, "strategy.tensor_collective_dtype=compute"],
          "fp32": [*TP, "strategy.tensor_collective_dtype=fp32"],
          "sequence_compute": [*TP, "strategy.tensor_collective_dtype=compute", "strategy.sequence_parallel=true"]}
PIPE = ["strategy=modular_pipeline", "strategy.pipeline_degree=2", "strategy.data_degree=2",
        "hardware.devices_per_node=4", "strategy.micro_batches=2"]
REDUCTION = {"fp32": [*PIPE, "strategy.reduction_dtype=fp32"],
             "compute": [*PIPE, "strategy.reduction_dtype=compute"],
             "sharded_compute": [*PIPE, "strategy.reduction_dtype=compute", "strategy.distributed_optimizer=true"]}


def within(comparison, name):
    return assert_same_with_bf16_messages(comparison, name, BF16_COLLECTIVE_GRADIENT_RTOL,
                                          BF16_COLLECTIVE_GRADIENT_SCALE_ATOL)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return sgd_reference(tmp_path_factory, "strategy=single", BF16)


@pytest.fixture(scope="module")
def tensor_runs(tmp_path_factory):
    return {name: SgdRun(tmp_path_factory.mktemp(f"tensor_{name}"), *overrides, BF16)
            for name, overrides in TENSOR.items()}


@pytest.fixture(scope="module")
def reduction_runs(tmp_path_factory):
    return {name: SgdRun(tmp_path_factory.mktemp(f"reduction_{name}"), *overrides, BF16)
            for name, overrides in REDUCTION.items()}


def test_bf16_tensor_collectives_equal_single_under_sgd(tensor_runs, reference):
    for name in ("compute", "sequence_compute", "fp32"):
        within(SgdComparison(tensor_runs[name], reference), f"tp_1d {name}")


def test_bf16_tensor_collectives_halve_the_partial_sums_bytes(tensor_runs):
    """Without sequence parallelism the grid's all-reduces are the partial sums (4L + 1 activations
    of rows × s × h: two forward, two backward per block, the head's input gradient) plus the
    vocabulary-parallel loss's fp32 scalars: fp32 − compute = half the partial sums' fp32 bytes.
    With it, every reduce-scatter is one of those partial sums, (t − 1)/t of it each, in 2 bytes."""
    cfg = tensor_runs["compute"].cfg
    fp32, compute = (tensor_runs[name].summary["comm_bytes_per_step"] for name in ("fp32", "compute"))
    t, layers = 2, cfg.model.layers
    activation = cfg.data.global_batch_size * cfg.data.sequence_length * cfg.model.hidden
    partial_sums_fp32 = (4 * layers + 1) * 2 * (t - 1) / t * activation * 4
    print(f"tp_1d all_reduce fp32 {fp32['all_reduce']:.0f} -> compute {compute['all_reduce']:.0f} B/step "
          f"(partial sums {partial_sums_fp32:.0f} -> {partial_sums_fp32 / 2:.0f})")
    assert fp32["all_reduce"] - compute["all_reduce"] == pytest.approx(partial_sums_fp32 / 2, rel=EXACT_RTOL)
    sequence = tensor_runs["sequence_compute"].summary["comm_bytes_per_step"]
    reduce_scatter_fp32 = (4 * layers + 1) * (t - 1) / t * activation * 4  # 557,056 B before (b95c261)
    print(f"sequence-parallel reduce_scatter fp32 {reduce_scatter_fp32:.0f} -> compute "
          f"{sequence['reduce_scatter']:.0f} B/step")
    assert sequence["reduce_scatter"] == pytest.approx(reduce_scatter_fp32 / 2, rel=EXACT_RTOL)


def test_bf16_gradient_reduction_equals_single_and_halves_its_bytes(reduction_runs, reference):
    for name in ("compute", "sharded_compute"):
        within(SgdComparison(reduction_runs[name], reference), f"pp2 x dp2 {name}")
    fp32, compute, sharded = (reduction_runs[name].summary["comm_bytes_per_step"]
                              for name in ("fp32", "compute", "sharded_compute"))
    print(f"pp2 x dp2 all_reduce fp32 {fp32['all_reduce']:.0f} -> compute {compute['all_reduce']:.0f}; distributed "
          f"optimizer reduce_scatter {sharded['reduce_scatter']:.0f} + all_gather {sharded['all_gather']:.0f} B/step")
    assert compute["all_reduce"] == pytest.approx(fp32["all_reduce"] / 2, rel=EXACT_RTOL)  # every one a bucket
    # a reduce-scatter moves half an all-reduce's bytes (6d94410: 83,584 B in fp32), now in bf16;
    # the all-gather still moves the fp32 weights
    assert sharded["reduce_scatter"] == pytest.approx(fp32["all_reduce"] / 4, rel=EXACT_RTOL)
    assert sharded["all_gather"] == pytest.approx(fp32["all_reduce"] / 2, rel=EXACT_RTOL)


def test_both_in_bf16_equal_single_under_adamw(tmp_path_factory):
    """pp1 × 1-D t2 × dp2 with both switches on, 3 AdamW steps against single's traced update:
    losses within BF16_LOSS_RTOL, parameters within adam_tolerance at the gradients' bf16 bound."""
    actual = bf16_adamw_against_single(tmp_path_factory, [
        "strategy=modular_pipeline", "strategy.pipeline_degree=1", "strategy.tensor_parallel=1d", "strategy.tensor_grid=2",
        "strategy.data_degree=2", "hardware.devices_per_node=4", "strategy.tensor_collective_dtype=compute",
        "strategy.reduction_dtype=compute"], rounding=BF16_COLLECTIVE_GRADIENT_SCALE_ATOL)
    print(f"all_reduce {actual['comm_bytes_per_step']['all_reduce']:.0f} B/step")



def test_thirty_two_true_moves_fp32_either_way():
    """Outside autocast the wire dtype is fp32 whatever the switch; a reduction never widens."""
    value = torch.ones(4)
    assert wire_dtype(value, True) == wire_dtype(value, False) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert wire_dtype(value, True) == torch.bfloat16 and wire_dtype(value, False) == torch.float32
    assert wire_dtype(value.double(), True) == torch.float64
    pair, one = Group("data", (0, 1)), Group("data", (0,))
    assert on_wire(value, torch.float32, pair) is value
    assert on_wire(value, torch.bfloat16, one) is value  # nothing is reduced: nothing is rounded
    assert on_wire(value, torch.bfloat16, pair).dtype == torch.bfloat16
    assert on_wire(value.bfloat16(), torch.float32, pair).dtype == torch.bfloat16  # bf16-true: never widened
