"""Context parallelism (strategy.context_parallel = c) in the strategies equals `single`.

Each case trains on forked gloo ranks with the strict point-to-point order check on (tests/ranks.py
QUICK) and is compared with the one-process reference under plain SGD (references.SgdComparison:
losses of every step, the first step's gradients recovered from the weights, the parameters after 3
steps) and, for the cases AdamW lists, under AdamW (losses, parameters within the traced update's
bound). The c ranks of a sequence read the same rows, keep their head and tail chunks and exchange
keys and values (strategies/context_parallel.py); the gradients are averaged over data × context
(strategies/context_layout.py). Ids: c{c} context ranks (ring unless `ag`: all_gather), dp{d} data
replicas, pp{p} pipeline ranks, p{t} 1-D tensor ranks, sp sequence parallelism, full: full activation
recomputation.
"""

import pytest

from layerwise.preflight import validate
from layerwise.run.fit import train
from tests.ranks import QUICK, compose_config
from tests.references import (LLAMA, LLAMA_REFERENCE, SgdComparison, SgdRun, consolidated_parameters, sgd_reference,
                              tracing_optimizer)
from tests.tolerances import OptimizerTrace, assert_same_losses, assert_same_parameters

ALL_GATHER = "strategy.context_parallel_comm=all_gather"
# (overrides, world size, reference overrides). QUICK's rows are 32 positions: 2c chunks of 8 (c = 2)
# or 4 (c = 4) tokens per rank and head/tail.
CASES = {
    "ddp_c4_ag": (["strategy=ddp", "strategy.context_parallel=4", ALL_GATHER, "hardware.devices_per_node=4"], 4, ()),
    "ddp_c2_dp2": (["strategy=ddp", "strategy.context_parallel=2", "hardware.devices_per_node=4"], 4, ()),
    # with full recomputation: each block reruns its forward, exchange included, in its backward (one
    # micro-batch: the key side and positions it reads are still this step's)
    "ddp_c4_full": (["strategy=ddp", "strategy.context_parallel=4", "strategy.activation_recompute=full",
                     "hardware.devices_per_node=4"], 4, ()),
    # 8 ranks: data 2 × pipeline 2 × context 2, the distributed optimizer's slices over data × context
    "modular_pipeline_pp2_c2_dp2_distopt": (["strategy=modular_pipeline", "strategy.pipeline_degree=2",
                                             "strategy.context_parallel=2", "strategy.distributed_optimizer=true",
                                             "hardware.devices_per_node=8"], 8, ()),
    # ZeRO-3 shards over the data_context group (2 × 2), one stage per rank pair
    "zero_layered_c2_dp2_ag": (["strategy=zero_layered", "strategy.context_parallel=2", ALL_GATHER,
                                "hardware.devices_per_node=4"], 4, ()),
    "tp_1d_p2_c2_sp": (["strategy=tp_1d", "strategy.tensor_grid=2", "strategy.context_parallel=2",
                        "strategy.sequence_parallel=true", "hardware.devices_per_node=4"], 4, ()),
    # Llama with GQA (4 query heads sharing 2 kv heads: only the kv heads travel), RoPE at the chunks' positions
    "llama_ddp_c2_ag_dp2": (["strategy=ddp", "strategy.context_parallel=2", ALL_GATHER, "hardware.devices_per_node=4",
                             *LLAMA], 4, LLAMA_REFERENCE),
    "llama_one_f_one_b_pp2_c2": (["strategy=one_f_one_b", "strategy.context_parallel=2",
                                  "hardware.devices_per_node=4", *LLAMA], 4, LLAMA_REFERENCE),
}
# AdamW: one ring case (GPT, pipeline × data × context, the distributed optimizer) and one all_gather
# case (Llama GQA, ddp); the SGD comparison above is the one that sees a wrong gradient scale.
ADAMW = ["modular_pipeline_pp2_c2_dp2_distopt", "llama_ddp_c2_ag_dp2"]


@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_equals_single_under_sgd(case, tmp_path, tmp_path_factory):
    overrides, world, reference = CASES[case]
    comparison = SgdComparison(SgdRun(tmp_path, *overrides), sgd_reference(tmp_path_factory, *reference))
    summary = comparison.actual.summary
    assert summary["world_size"] == world and summary["layout"]["context"] == context_of(overrides), summary["layout"]
    comparison.check()


def context_of(overrides) -> int:
    return next(int(o.split("=")[1]) for o in overrides if o.startswith("strategy.context_parallel="))


STEPS = 3
ADAMW_MODEL = ["model.layers=4", "data.global_batch_size=16", "trainer.limit_val_batches=0",
               f"trainer.val_check_interval={STEPS}", f"trainer.max_steps={STEPS}"]


@pytest.fixture(scope="module")
def adamw_references(tmp_path_factory):
    """`reference(llama)`: the one-process AdamW run (traced) of the GPT or of llama_tiny, made once."""
    cache = {}

    def reference(llama: bool):
        if llama not in cache:
            directory = tmp_path_factory.mktemp("single_adamw")
            cfg = compose_config(*QUICK, *ADAMW_MODEL, "strategy=single", *(LLAMA if llama else ()))
            with tracing_optimizer(directory):
                summary = train(cfg, directory, validate(cfg))
            cache[llama] = summary, consolidated_parameters(directory, "single"), OptimizerTrace.load(directory)
        return cache[llama]
    return reference


@pytest.mark.parametrize("case", ADAMW)
def test_context_parallel_equals_single_under_adamw(case, adamw_references, tmp_path):
    overrides, world, reference = CASES[case]
    expected, expected_parameters, trace = adamw_references(bool(reference))
    cfg = compose_config(*QUICK, *ADAMW_MODEL, *overrides)
    summary = train(cfg, tmp_path, validate(cfg))
    assert summary["status"] == "completed" and summary["world_size"] == world, summary.get("error")
    assert_same_losses(summary["losses"], expected["losses"])
    assert_same_parameters(consolidated_parameters(tmp_path, cfg.strategy.name), expected_parameters, trace)


# Portable checkpoints across c: the c ranks of a sequence hold equal parameters, saved once
# (DCP's dedup); ZeRO's shards over data × context are pieces at their offsets. One chain resumes
# single's step-1 checkpoint under zero_layered c2 dp2 (c 1 -> 2) and that under ddp dp2 (c 2 -> 1).
RESUME_CHAIN = [("zero_layered_c2_dp2", CASES["zero_layered_c2_dp2_ag"][0]), ("ddp_dp2", ["strategy=ddp"])]


def test_resume_moves_between_context_degrees(tmp_path):
    from tests.references import SGD_OVERRIDES
    from tests.test_resume_matrix import assert_within_tolerance, run, walk_chain
    reference = tmp_path / "single"
    summary = run(reference, SGD_OVERRIDES, len(RESUME_CHAIN) + 1, "strategy=single",
                  save_steps=range(len(RESUME_CHAIN) + 2))
    rows = walk_chain(tmp_path, (reference, summary), RESUME_CHAIN, SGD_OVERRIDES)
    assert_within_tolerance(rows)


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """tests/test_packing.py's short EOS-ended documents (several per 32-token row) and their tokenizer."""
    from tests import test_packing
    return test_packing.short_documents.__wrapped__(tmp_path_factory)


def test_packed_rows_under_a_context_parallel_pipeline_equal_single(short_documents, tmp_path_factory):
    """data.packing composes with c: 1F1B p2 × c2 (m = 4 micro-batches of packed rows, each cut to its
    chunks with its own documents and key side, interleaved forwards and backwards) equals packed
    `single` under SGD."""
    packed = [*short_documents, "data.packing=true"]
    single = SgdRun(tmp_path_factory.mktemp("packed_single"), "strategy=single", *packed, initial=True)
    pipeline = SgdRun(tmp_path_factory.mktemp("packed_cp"), "strategy=one_f_one_b", "strategy.context_parallel=2",
                      "hardware.devices_per_node=4", *packed)
    assert pipeline.summary["layout"]["context"] == 2
    SgdComparison(pipeline, single).check()


def test_recomputed_packed_rows_under_a_context_parallel_pipeline_equal_single(short_documents, tmp_path_factory):
    """Full recomputation with micro-batches in flight: Llama GQA, 1F1B p2 × c2, m = 4 micro-batches of
    packed rows, every block rerun in its backward (its ring exchange included). A micro-batch's
    backward runs after later micro-batches' forwards have set their own documents and key side on the
    model; the rerun must read those its forward read (strategies/recompute.py restores them), or
    RoPE's positions, the document masks and the key side are another micro-batch's. Equals packed
    `single` under SGD. (Unpacked rows would not show it: every micro-batch's positions and key side
    are then equal in value.)"""
    packed = [*short_documents, "data.packing=true", *LLAMA]
    single = SgdRun(tmp_path_factory.mktemp("packed_llama_single"), "strategy=single", *packed, initial=True)
    pipeline = SgdRun(tmp_path_factory.mktemp("packed_cp_full"), "strategy=one_f_one_b", "strategy.context_parallel=2",
                      "strategy.activation_recompute=full", "hardware.devices_per_node=4", *packed)
    assert pipeline.summary["layout"]["context"] == 2 and pipeline.cfg.strategy.micro_batches == 4
    SgdComparison(pipeline, single).check()
