"""L2L reproduction (layerwise/reproduce/l2l.py) and the relay terms it adds to cost/step_time.py.

Oracles: hand-computed bytes for a 4-wide model, the one simulator on the relay plan (the closed-form
step without overlap must equal its makespan), and the search's own boundary (fits at the answer,
not one above). The measured small-scale experiment is not run here (minutes): only its comparison.
"""

import pytest
from omegaconf import OmegaConf

from layerwise.reproduce import l2l
from cost.inputs import Device
from cost.relay import relay_host_memory, relay_memory, relay_stage_parameters, relay_step
from cost.step_time import stage_seconds
from strategies.schedule import simulate
from strategies.schedule.offload import relay_plan, transfer_cost

# h = 4, vocabulary 10, 8 positions, 2 blocks, micro-batches of 1 sequence × 2 tokens, fp32
TINY = dict(hidden=4, heads=1, layers=2, rows=1, sequence=2, vocabulary=10, activation_bytes=4, max_length=8)
CPU = Device(flops_per_second=1e9, efficiency=0.5, memory_bytes=1e9, intra_node_bandwidth=1e9,
             inter_node_bandwidth=1e9, devices_per_node=1)


def tiny(**changes):
    return l2l.workload(**{**TINY, **changes})


def test_relay_stages_are_embed_blocks_head():
    # embed: (10 + 8)·4; block: 12h² weights + 9h biases + 4h norms; head: 2h norm + h·V
    assert relay_stage_parameters(tiny()) == [72, 244, 244, 48]


def test_relay_memory_by_hand():
    # peak at block 2's backward: blocks 2 and 1 in flight, block 2's gradient, a recomputed block's
    # saved tensors and their gradients (2 × 64 per token × 2 tokens × 4 B), x, dy, dx pieces (3 × 8 × 4 B)
    constant = relay_memory(tiny(), 1, True, 4)
    assert constant == {"parameters": 1952, "gradients": 976, "optimizer": 0, "activations": 1024, "buffers": 96}
    # standard, m = 3: the stash holds the inputs of stages 1..2 and block 2's dy, 3 micro-batches each
    standard = relay_memory(tiny(), 3, False, 4)
    assert standard == {"parameters": 1952, "gradients": 976, "optimizer": 0, "activations": 1024 + 9 * 32,
                        "buffers": 0}


def test_constant_variant_is_flat_in_depth_and_micro_batches():
    reference = relay_memory(tiny(layers=2), 1, True, 2)
    for layers in (2, 24, 384):
        for micro_batches in (1, 8, 64):
            assert relay_memory(tiny(layers=layers), micro_batches, True, 2) == reference
    # the standard stash grows with both
    assert sum(relay_memory(tiny(layers=384), 8, False, 2).values()) > sum(reference.values())


def test_host_holds_sixteen_bytes_per_parameter_and_the_constant_stash():
    host = relay_host_memory(tiny(), 1, True)
    assert host["parameters"] + host["gradients"] + host["optimizer"] == 608 * 16
    assert host["activations"] == 4 * 1 * 8 * 4  # (L + 2) stage inputs × m × piece × 4 B
    assert relay_host_memory(tiny(), 1, False)["activations"] == 0


@pytest.mark.parametrize("constant", [False, True])
def test_step_without_overlap_adds_compute_and_every_copy(constant):
    step = relay_step(tiny(), CPU, 3, 1e6, 4, constant, overlap=False)
    assert step["step_seconds"] == pytest.approx(step["compute_seconds"] + step["transfer_seconds"])


def test_step_without_overlap_equals_the_simulated_relay_plan():
    load, micro_batches, bandwidth = tiny(), 3, 1e6
    stages = relay_stage_parameters(load)
    # F of one micro-batch per stage: the embedding lookup is free, a block's from plan mode's
    # stage_seconds, the head's from a model without blocks (one micro-batch: F + 3F)
    block = stage_seconds(l2l.workload(**{**TINY, "layers": 1}), CPU, 0, 2)[0]
    head = relay_step(tiny(layers=0), CPU, 1, 1e30, 4, False, overlap=False)["compute_seconds"] / 4
    per_stage = [0.0] + [block] * load.layers + [head]
    unit = relay_step(load, CPU, 1, 1e30, 4, False, overlap=False)
    assert unit["compute_seconds"] == pytest.approx(4 * sum(per_stage))
    cost = transfer_cost(lambda stage: stages[stage] * 4, bandwidth, lambda stage: per_stage[stage], 3.0)
    simulated = simulate(relay_plan(len(stages), micro_batches), cost).makespan
    assert relay_step(load, CPU, micro_batches, bandwidth, 4, False, overlap=False)["step_seconds"] == \
        pytest.approx(simulated)


def test_overlap_hides_copies_behind_compute_and_recompute_costs_a_third_more():
    load = tiny(rows=64)
    hidden = relay_step(load, CPU, 4, 1e15, 4, False)
    assert hidden["exposed_transfer_seconds"] == pytest.approx(0, abs=1e-9)
    # the same tokens through `single`: 3F against the relay's 4F
    assert hidden["compute_seconds"] == pytest.approx(4 / 3 * l2l.baseline_seconds(tiny(rows=256), CPU))
    slow_link = relay_step(load, CPU, 4, 1.0, 4, False)
    assert slow_link["step_seconds"] >= slow_link["transfer_seconds"]


def test_data_replicas_all_reduce_every_stage_in_buckets_exposed_as_the_updates():
    """Two data replicas: each stage's fp32 host gradient is all-reduced before its update, in
    buckets of at most bucket_bytes (stage bytes 288, 976, 976, 192: with 512-byte buckets 1, 2, 2,
    1 collectives, each the latency plus its share of 2(n − 1)/n · 4 B per parameter over the link).
    In place (no overlap) every reduction adds; with the worker thread only the last stage's
    (the embedding's) is exposed. The plan's R actions are counted with the framework's costs."""
    from dataclasses import replace

    from parallel.dims import Layout
    latency = replace(CPU, collective_latency_s=1e-3, action_overhead_s=1e-5)
    one, two = tiny(), replace(tiny(), layout=Layout(2, 1))
    assert two.layout.data == 2
    stages = relay_stage_parameters(two)
    reductions = [count * 1e-3 + parameters * 4 / 1e9 for parameters, count in zip(stages, (1, 2, 2, 1))]
    reduce_actions = 4  # one R per stage (strategies/schedule/offload.py add_host_transfers)
    for overlap, exposed in ((False, sum(reductions)), (True, reductions[0])):
        alone = relay_step(one, latency, 3, 1e6, 4, False, overlap=overlap, bucket_bytes=512)["step_seconds"]
        replicas = relay_step(two, latency, 3, 1e6, 4, False, overlap=overlap, bucket_bytes=512)["step_seconds"]
        assert replicas - alone == pytest.approx(exposed + reduce_actions * 1e-5, rel=1e-9)


def test_largest_finds_the_boundary():
    assert l2l.largest(lambda n: n <= 37) == 37
    assert l2l.largest(lambda n: n <= 1) == 1
    assert l2l.largest(lambda n: False) == 0
    assert l2l.largest(lambda n: True, limit=100) == 100


def test_host_schemes_for_fifty_billion():
    cfg = OmegaConf.create({"hardware": {"host_memory_bytes": 5.12e11}})
    rows = {row["bytes_per_parameter"]: row for row in l2l.host_scheme_rows(cfg)}
    assert rows[16]["fifty_billion_needs_GB"] == pytest.approx(800)
    assert not rows[16]["fits_512_GB"] and not rows[12]["fits_512_GB"] and rows[8]["fits_512_GB"]
    assert rows[16]["largest_model_B"] == pytest.approx(32)


def paper_cfg():
    from layerwise.config.store import compose
    return compose(["experiment=repro_l2l"])


def test_paper_scale_batches_fit_at_the_answer_and_not_above():
    cfg = paper_cfg()
    rows = {row["strategy"]: row for row in l2l.batch_rows(cfg, 128)}
    base = rows["single (baseline)"]["largest_batch"]
    memory = lambda batch: l2l.baseline_memory(l2l.paper_workload(cfg, batch, 128), False)  # noqa: E731
    assert l2l.fits(memory(base), cfg) and not l2l.fits(memory(base + 1), cfg)
    assert rows["l2l standard"]["largest_batch"] > base and rows["l2l standard"]["memory_ratio"] < 1
    assert rows["l2l standard"]["largest_batch"] % base == 0  # micro-batches of the baseline's batch


def test_paper_scale_finding(tmp_path):
    finding = l2l.at_paper_scale(paper_cfg(), tmp_path)
    assert len(finding.verdicts) == 5 and (tmp_path / finding.figures[0]).exists()
    depth = finding.tables["depth"]
    assert len({row["l2l_constant_GiB"] for row in depth}) == 1  # flat to the byte
    assert depth[-1]["layers"] == 384 and not depth[-1]["single_fits"]


def test_small_scale_comparison_and_verdicts():
    measured = {(2, "single"): (100.0, 1.0), (2, "l2l standard"): (40.0, 2.0), (2, "l2l constant"): (30.0, 2.5),
                (8, "single"): (400.0, 3.0), (8, "l2l standard"): (60.0, 6.0), (8, "l2l constant"): (30.6, 7.5)}
    predicted = {key: (bytes_ * 1.1, seconds / 10) for key, (bytes_, seconds) in measured.items()}
    rows = l2l.comparison_rows(measured, predicted)
    at = {(row["layers"], row["strategy"]): row for row in rows}
    assert at[8, "l2l standard"]["memory_ratio_measured"] == pytest.approx(0.15)
    assert at[8, "l2l standard"]["predicted_over_measured"] == pytest.approx(1.1)
    assert at[8, "l2l constant"]["throughput_ratio_measured"] == pytest.approx(0.4)
    verdicts = l2l.small_verdicts(rows)
    assert [v.verdict for v in verdicts] == ["reproduced", "refuted", "reproduced"]  # 0.15; 0.5; spread 2%
