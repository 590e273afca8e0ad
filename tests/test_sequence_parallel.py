"""Sequence parallelism and overlapped tensor collectives in the 1-D grid (issue 56;
strategies/tensor_parallel/sequence.py, docs/strategies/three_d.md "Sequence parallelism").

Every layout reproduces `single` under plain SGD (losses, first-step gradients, parameters: the
oracle that sees a gradient's scale, references.SgdComparison) and, for one tp_1d and one pipeline
layout, under AdamW; the bytes it counts equal, kind by kind, the formula below (each all-reduce of an
activation replaced by an all-gather and a reduce-scatter of the same total bytes, plus the partial
gradients of the pieces the sequence shard makes replicated, summed once per step). Overlapped
collectives are bit-identical to the unchunked ones (same products per row, same sums). The stash of
the blocks per rank is measured with the meter with and without sequence parallelism.
Ids: p2 / p4 = 1-D over 2 / 4 tensor ranks, pp2 = 2 pipeline ranks, sp = sequence_parallel, overlap = tensor_overlap.
Dropout: 0 in every equality case but `dropout`, where masks are drawn as `single` draws them.
"""

import gc
import re

import pytest
import torch
import torch.distributed as dist

from cost.traffic import all_gather, all_reduce
from layerwise.config.errors import ConfigError
from layerwise.planning.inputs import training_plan_of
from layerwise.preflight import validate
from layerwise.run.fit import train
from parallel.comm import KINDS
from parallel.dims import Layout
from parallel.layout import ParallelLayout
from parallel.memory import ComputeMemoryMeter
from strategies.schedule import FORWARD, REDUCE_GRADIENT, SEND_ACTIVATION, SEND_GRADIENT
from strategies.tensor_parallel import parallelize_1d
from strategies.tensor_parallel.grids import layout_arguments
from tests.ranks import QUICK, compose_config, run_on_ranks
from tests.references import (LLAMA, LLAMA_REFERENCE, SgdComparison, SgdRun, consolidated_parameters,
                              sgd_reference, tracing_optimizer)
from tests.tolerances import EXACT_RTOL, OptimizerTrace, assert_same_losses, assert_same_parameters

TP = ["strategy=tp_1d", "strategy.tensor_grid=2"]
PP = ["strategy=modular_pipeline", "strategy.tensor_parallel=1d", "strategy.tensor_grid=2",
      "hardware.devices_per_node=4"]
SP, OVERLAP = ["strategy.sequence_parallel=true"], ["strategy.sequence_parallel=true", "strategy.tensor_overlap=true"]
CASES = {  # id -> (overrides, world size, reference overrides)
    "tp_1d_p4_sp_overlap": (["strategy=tp_1d", "strategy.tensor_grid=4", "hardware.devices_per_node=4",
                             "model.heads=4", *OVERLAP], 4, ("strategy=single", "model.heads=4")),
    "llama_tp_1d_p2_sp_overlap": ([*TP, *OVERLAP, *LLAMA], 2, LLAMA_REFERENCE),
    "pp2_p2_sp": ([*PP, *SP], 4, ()),
    "llama_pp2_p2_sp_overlap": ([*PP, *OVERLAP, *LLAMA], 4, LLAMA_REFERENCE),
}
ADAM_CASES = {"tp_1d_p2_sp_overlap": [*TP, *OVERLAP], "pp2_p2_sp_overlap": [*PP, *OVERLAP]}  # GPT
BYTES = 4  # fp32 everywhere here


# ----------------------------------------------------------------------------- the bytes formula

# Pieces that act on the sequence shard and are whole on every tensor rank: their gradients are partial.
PARTIAL = re.compile(r"(norm[^.]*\.(weight|bias)|embed\..*|(attention\.proj|mlp\.fc_out)\.bias)$")


def sequence_parallel_bytes(cfg, parameters: dict, pipeline_rank: int) -> dict:
    """Logical bytes by kind one rank moves per step (cost/traffic.py's 1-D formula with sequence
    parallelism): per micro-batch and block 4 all-gathers and 4 reduce-scatters of the activation
    (rows × s × h), where 1-D Megatron makes 4 all-reduces (an all-reduce moves 2(t−1)/t, each of these
    (t−1)/t: the same bytes), and in the backward one more all-gather per gathered norm output (2), the
    column linears' saved shard gathered again for their weight gradients; the head one all-gather and
    one reduce-scatter in place of its input gradient's all-reduce, and its own second gather; the
    vocabulary-parallel loss 3 all-reduces of rows × s; once per stage and step the partial gradients
    (norms, row biases, tables) all-reduced over t; each boundary message [rows, s/t, h]."""
    t, s, h = cfg.strategy.tensor_grid, cfg.data.sequence_length, cfg.model.hidden
    if cfg.strategy.name == "tp_1d":
        stages, rows, steps = {0: (1, range(cfg.model.layers), True, True)}, cfg.data.global_batch_size, []
        sends = 0
    else:
        plan, lps = training_plan_of(cfg), cfg.strategy.layers_per_stage
        row = [action for action in plan.ranks[pipeline_rank] if action is not None]
        rows = cfg.data.global_batch_size // cfg.strategy.micro_batches
        stages = {stage: (sum(a.kind == FORWARD and a.stage == stage for a in row),
                          range(stage * lps, (stage + 1) * lps), stage == 0, stage == plan.stages - 1)
                  for stage in {a.stage for a in row if a.kind == FORWARD}}
        assert all(sum(a.kind == REDUCE_GRADIENT and a.stage == stage for a in row) == 1 for stage in stages)
        sends = sum(a.kind in (SEND_ACTIVATION, SEND_GRADIENT) for a in row)
    activation = rows * s * h
    traffic = dict.fromkeys(KINDS, 0.0)
    for forwards, blocks, embed, head in stages.values():
        replaced = forwards * (4 * len(blocks) + head)  # the all-reduces 1-D Megatron makes
        regathered = forwards * (2 * len(blocks) + head)  # one per gathered norm output
        traffic["all_gather"] += (replaced + regathered) * all_gather(activation, t)
        traffic["reduce_scatter"] += replaced * all_gather(activation, t)  # (t−1)/t of it too
        traffic["all_reduce"] += forwards * 3 * all_reduce(rows * s, t) if head else 0
        partial = sum(value.numel() for name, value in parameters.items() if PARTIAL.search(name) and (
            any(f".blocks.{b}." in name for b in blocks) or (embed and ".embed." in name)
            or (head and ".head.norm." in name)))
        traffic["all_reduce"] += all_reduce(partial, t)
    traffic["send_recv"] = sends * rows * s // t * h * BYTES
    traffic["broadcast"] = BYTES if cfg.strategy.name != "tp_1d" else 0.0
    return traffic


def assert_counted_bytes_equal_the_formula(case, cfg, summary, parameters):
    pipeline = 1 if cfg.strategy.name == "tp_1d" else cfg.strategy.pipeline_degree
    per_rank = [sequence_parallel_bytes(cfg, parameters, p) for p in range(pipeline)]
    predicted = {kind: max(traffic[kind] for traffic in per_rank) for kind in KINDS}
    counted = summary["comm_bytes_per_step"]
    print(f"{case}: counted {counted}\n  formula {predicted}")
    for kind in KINDS:
        assert counted[kind] == pytest.approx(predicted[kind], rel=EXACT_RTOL, abs=0), kind


# ----------------------------------------------------------------------------- equal to single

@pytest.mark.parametrize("case", list(CASES))
def test_sequence_parallel_equals_single_under_sgd_and_moves_the_formula(case, tmp_path, tmp_path_factory):
    overrides, world, reference = CASES[case]
    comparison = SgdComparison(SgdRun(tmp_path, *overrides), sgd_reference(tmp_path_factory, *reference))
    assert comparison.actual.summary["world_size"] == world
    comparison.check()
    actual = comparison.actual
    assert_counted_bytes_equal_the_formula(case, actual.cfg, actual.summary, actual.last)


def test_overlapped_collectives_are_bit_identical_to_unchunked(tmp_path):
    """Chunked gathers and reduce-scatters give every row the same products and the same sums: the
    weights after 3 SGD steps are equal to the bit (fp32, CPU; Llama: q, k, v read one overlapped
    gather, gate and up another, the head a third)."""
    runs = [SgdRun(tmp_path / name, *TP, *LLAMA, *options) for name, options in (("sp", SP), ("overlap", OVERLAP))]
    assert runs[0].summary["losses"] == runs[1].summary["losses"]
    for name, value in runs[0].last.items():
        assert torch.equal(value, runs[1].last[name]), name


def test_dropout_masks_are_singles_slices(tmp_path, tmp_path_factory):
    """With dropout 0.1 each rank drops with its slice of the mask `single` draws for the whole
    activation (ShardDropout): equal to single under SGD. Ranks drawing one mask each for their own
    shard from a shared generator would repeat one mask on every shard and fail this."""
    dropout = "model.dropout=0.1"
    comparison = SgdComparison(SgdRun(tmp_path, *TP, *SP, dropout), sgd_reference(tmp_path_factory, "strategy=single", dropout))
    comparison.check()


# ----------------------------------------------------------------------------- AdamW

ADAM_STEPS = 3
ADAM = ["model.layers=4", "data.global_batch_size=16", "trainer.limit_val_batches=0",
        f"trainer.val_check_interval={ADAM_STEPS}", f"trainer.max_steps={ADAM_STEPS}"]


def adam_run(directory, *overrides):
    cfg = compose_config(*QUICK, *ADAM, *overrides)
    return cfg, train(cfg, directory, validate(cfg))


@pytest.fixture(scope="module")
def adam_reference(tmp_path_factory):
    directory = tmp_path_factory.mktemp("single")
    with tracing_optimizer(directory):
        _, summary = adam_run(directory, "strategy=single")
    return summary, consolidated_parameters(directory, "single"), OptimizerTrace.load(directory)


@pytest.mark.parametrize("case", list(ADAM_CASES))
def test_sequence_parallel_equals_single_under_adamw(case, adam_reference, tmp_path):
    expected, parameters, trace = adam_reference
    cfg, summary = adam_run(tmp_path, *ADAM_CASES[case])
    assert summary["status"] == "completed"
    assert_same_losses(summary["losses"], expected["losses"])
    assert_same_parameters(consolidated_parameters(tmp_path, cfg.strategy.name), parameters, trace)


# ----------------------------------------------------------------------------- activation memory

HIDDEN, LENGTH, ROWS, LAYERS = 64, 64, 4, 2


def block_stash_on_rank(rank, sequence_parallel):
    """Bytes the blocks keep for the backward on this rank (the meter's live bytes after the blocks'
    forward, less before it), and the meter's peak over the whole forward and backward."""
    from models import build_model
    dist.init_process_group("gloo")
    layout = ParallelLayout(Layout(tensor_grid="1d", edge=2), rank=rank, **layout_arguments("1d", 2))
    model = build_model("gpt", vocab_size=64, sequence_length=LENGTH, layers=LAYERS, hidden=HIDDEN, heads=2,
                        seed=0, device="cpu")
    form = parallelize_1d(model, layout, "cpu", sequence_parallel=sequence_parallel)
    tokens = torch.randint(0, 64, (ROWS, LENGTH), generator=torch.Generator().manual_seed(0))
    with ComputeMemoryMeter() as meter:
        x = model.embed(tokens)
        gc.collect()  # what a reference cycle of an earlier test holds is not this forward's
        before = meter.live_bytes
        for block in model.blocks.values():
            x = block(x)
        gc.collect()
        stash = meter.live_bytes - before
        form.loss(model.head(x), tokens).backward()
    return stash, meter.peak_bytes


def test_sequence_parallel_divides_the_norm_regions_stash_by_t():
    """Per block and token, 1-D Megatron keeps the two norms' inputs and outputs (the column linears'
    input: 4h) and their statistics (LayerNorm's mean and 1/σ: 2·2) whole on every rank; sequence
    parallelism keeps 1/t of them (the column linears save the shard and gather it again in the
    backward). The split attention and MLP tensors are unchanged."""
    plain = run_on_ranks(block_stash_on_rank, 2, False)
    sharded = run_on_ranks(block_stash_on_rank, 2, True)
    tokens, t = ROWS * LENGTH, 2
    saved = LAYERS * tokens * (4 * HIDDEN + 2 * 2) * (1 - 1 / t) * BYTES
    for (plain_stash, plain_peak), (stash, peak) in zip(plain, sharded):
        print(f"blocks' stash per rank: {plain_stash} B without, {stash} B with sequence parallelism "
              f"(predicted saving {saved:.0f} B); peak {plain_peak} -> {peak} B")
        assert plain_stash - stash == saved


# ----------------------------------------------------------------------------- config errors

@pytest.mark.parametrize("overrides, message", [
    ([*TP, *SP, "data.sequence_length=31"], "data.sequence_length=31 is not divisible by the 2 tensor ranks of "
                                            "strategy.tensor_grid=2"),
    ([*TP, "strategy.tensor_overlap=true"], "strategy.tensor_overlap=true chunks the sequence-parallel"),
    (["strategy=tp_2d", "hardware.devices_per_node=4", *SP], "strategy.tensor_parallel=2d already splits it"),
    (["strategy=modular_pipeline", *SP], "strategy.tensor_parallel=none has no tensor grid"),
    (["strategy=pipefisher", "strategy.tensor_parallel=1d", "strategy.tensor_grid=2", "hardware.devices_per_node=4",
      "strategy.layers_per_stage=2", *SP], "pipefisher's K-FAC factors"),
    (["strategy=one_f_one_b", "strategy.schedule=zero_bubble_h1", "strategy.tensor_parallel=1d",
      "hardware.devices_per_node=4", *SP], "a column linear computes both in one autograd node"),
], ids=["length", "overlap_alone", "2d", "no_grid", "pipefisher", "split_backward"])
def test_bad_sequence_parallel_settings_are_named_before_launch(overrides, message):
    with pytest.raises(ConfigError) as error:
        validate(compose_config(*QUICK, *overrides))
    assert message in str(error.value)
    assert "Fix:" in str(error.value)
