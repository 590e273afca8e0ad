"""Context parallelism in the cost model and plan mode (issue 57, items 4 and 5).

The exchange's bytes against hand counts (cost/traffic.py `context_traffic`, the formula the
strategies' counted bytes are compared against in tests/test_context_parallel.py); plan.json's
`context` and bytes from a config; a rank's shape, FLOPs and saved activations ÷ c (cost/context.py);
the search taking c > 1 where nothing else fits; plan mode's bytes equal to a CP run's counted ones.
The activation memory against measured runs is benchmarks/context_memory.py's (docs/plan.md).
"""

import pytest

from cost.traffic import context_step_traffic, context_traffic


# b=2 sequences of s=1024 tokens over c=4 ranks, 2 kv heads of 64: a K block is 2·256·2·64 = 65,536
# elements, 131,072 bytes in bf16.
BLOCK_BYTES = 2 * 256 * 2 * 64 * 2


def test_ring_moves_k_and_v_c_minus_1_hops_forward_and_3c_minus_2_in_all():
    forward = context_traffic("ring", 4, 2, 1024, 2, 64, element_bytes=2, backward=False)
    assert forward == {"send_recv": 2 * 3 * BLOCK_BYTES}  # K and V, 3 hops each
    both = context_traffic("ring", 4, 2, 1024, 2, 64, element_bytes=2)
    # + K/V round again (3 hops) + dK/dV home (4 hops): 2·(3 + 3 + 4) blocks = 2,621,440 B
    assert both == {"send_recv": 2 * (3 + 3 + 4) * BLOCK_BYTES} == {"send_recv": 2_621_440}


def test_all_gather_gathers_k_and_v_and_reduce_scatters_their_gradients():
    full = 4 * BLOCK_BYTES  # K of the whole sequence
    assert context_traffic("all_gather", 4, 2, 1024, 2, 64, element_bytes=2) == {
        "all_gather": 2 * 3 / 4 * full, "reduce_scatter": 2 * 3 / 4 * full}
    assert context_traffic("all_gather", 2, 1, 8, 1, 4, element_bytes=4, backward=False) == {
        "all_gather": 2 * 1 / 2 * (8 * 4 * 4)}


def test_one_context_rank_moves_nothing_and_a_step_multiplies_layers_and_micro_batches():
    assert context_traffic("ring", 1, 2, 1024, 2, 64) == {}
    assert context_traffic("all_gather", 1, 2, 1024, 2, 64) == {}
    step = context_step_traffic("ring", 2, 1, 16, 1, 8, layers=3, micro_batches=2)
    assert step == {"send_recv": 3 * 2 * 2 * (1 + 1 + 2) * (1 * 8 * 1 * 8 * 4)}


def test_full_recomputation_moves_the_forward_exchange_once_more():
    """A recomputed block's backward reruns its forward, exchange included: + the forward's bytes."""
    for comm in ("ring", "all_gather"):
        forward = context_traffic(comm, 4, 2, 1024, 2, 64, element_bytes=2, backward=False)
        plain = context_traffic(comm, 4, 2, 1024, 2, 64, element_bytes=2)
        recomputed = context_traffic(comm, 4, 2, 1024, 2, 64, element_bytes=2, recomputed=True)
        assert recomputed == plain + forward
    assert context_traffic("ring", 4, 2, 1024, 2, 64, element_bytes=2, recomputed=True) == {
        "send_recv": 2 * (3 + 3 + 3 + 4) * BLOCK_BYTES}


def test_an_unknown_exchange_is_named():
    with pytest.raises(ValueError, match="context_parallel_comm"):
        context_traffic("a2a", 2, 1, 16, 1, 8)


# ----- plan mode: a config with strategy.context_parallel priced from the config (layerwise/planning)

LLAMA_LONG = ["mode=plan", "model=llama3_8b", "model.max_sequence_length=131072", "hardware=dgx_h100",
              "data.global_batch_size=1", "data.sequence_length=131072", "data=token_bin",
              "data.vocab_size=128256", "logger=none"]


def planned(tmp_path, *overrides):
    from layerwise.planning.mode import plan
    from layerwise.preflight import validate
    from tests.ranks import compose_config
    cfg = compose_config(*LLAMA_LONG, *overrides)
    return cfg, plan(cfg, validate(cfg), tmp_path, charts=False)


@pytest.mark.parametrize("comm", ["ring", "all_gather"])
def test_plan_json_prices_the_exchange_from_the_config(tmp_path, comm):
    """ddp with c = 8 on one H100 node: a rank holds 131,072 / 8 tokens of the sequence; its bytes by
    kind are context_traffic's, 32 layers × 1 micro-batch, in bf16 (the only traffic besides the
    gradient all-reduce over the data × context group of 8)."""
    import json
    from cost.traffic import all_reduce, model_parameters
    from layerwise.planning.inputs import shape_of
    cfg, result = planned(tmp_path, "strategy=ddp", "strategy.context_parallel=8",
                          f"strategy.context_parallel_comm={comm}")
    written = json.loads((tmp_path / "plan.json").read_text())
    context = written["context"]
    assert written["layout"]["context"] == 8 and written["layout"]["data"] == 1
    assert context["context_parallel"] == 8 and context["context_parallel_comm"] == comm
    assert context["sequence_tokens_per_rank"] == 131072 // 8
    per_layer = context_traffic(comm, 8, 1, 131072, 8, 128, element_bytes=2)  # 8 kv heads of 128
    assert context["exchange_bytes_per_layer"] == pytest.approx(dict(per_layer), rel=1e-12)
    traffic = written["comm_bytes_per_step_by_pipeline_rank"][0]
    for kind, volume in per_layer.items():
        assert traffic[kind] == pytest.approx(32 * volume, rel=1e-12)
    gradients = all_reduce(model_parameters(shape_of(cfg), 32), 8)  # data × context: 8 ranks
    assert traffic["all_reduce"] == pytest.approx(gradients, rel=1e-9)
    forward, backward = context["exposed_exchange_s_per_micro_batch"].values()
    if comm == "ring":  # NVLink hops hide behind 1/8 of a layer's attention; the last dK/dV hop home does not
        assert forward == 0 and 0 < backward
    else:
        assert forward > 0 and backward > 0


def test_a_context_rank_computes_its_tokens_and_one_cth_of_the_attention():
    """The workload's shape is the rank's s/c tokens; the forward FLOPs are the model's over c (the
    attention's 4·s·h per token against the whole sequence's keys); a block's saved activations ÷ c,
    plus the projection's copy of the head-merged output (both exchanges) and all_gather's gathered K/V."""
    from cost.context import exchange_buffers, sharded_shape
    from cost.inputs import GptShape, Workload
    from cost.memory import block_saved_bytes
    from cost.step_time import forward_flops
    from models import describe_block
    from parallel.dims import Layout
    block = describe_block("llama", hidden=512, heads=8, kv_heads=2, ffn_hidden=1536)
    shape = GptShape(512, 4, 1000, 8192, 8192, block, False)
    whole = Workload(shape, 4, 8, Layout(), 4, 2, activation_bytes=2)
    for c in (2, 4, 8):
        split = Workload(sharded_shape(shape, c), 4, 8, Layout(context=c), 4, 2, activation_bytes=2)
        assert split.shape.length == 8192 // c
        assert forward_flops(split, 0, 2) == pytest.approx(forward_flops(whole, 0, 2) / c, rel=1e-12)
        tokens = 2 * split.shape.length
        copy = tokens * 8 * 64 * 2  # the output projection's head-merged copy of the exchange's output (8 heads of 64)
        assert block_saved_bytes(split, tokens, True) == pytest.approx(block_saved_bytes(whole, 2 * 8192, True) / c + copy)
        assert exchange_buffers(split) == 3 * 2 * (2 * 8192 // c * 2 * 64 * 2)  # ring: 2 K/V blocks + dK/dV
        gathered = Workload(split.shape, 4, 8, Layout(context=c), 4, 2, activation_bytes=2, context_comm="all_gather")
        assert block_saved_bytes(gathered, tokens, True) - block_saved_bytes(split, tokens, True) == \
            tokens * (c - 1) * 2 * 2 * 64 * 2  # the gathered K/V of the other c − 1 ranks (2 kv heads of 64)
    with pytest.raises(ValueError, match="2·strategy.context_parallel"):
        sharded_shape(GptShape(512, 4, 1000, 8190, 8192, block, False), 4)


def test_the_search_takes_context_parallelism_where_nothing_else_fits(tmp_path):
    """Llama 3 8B (vocabulary 32,000), one 524,288-token sequence on 16 H100s cut to 45 GB: without
    context parallelism no layout fits (the smallest, a 1-D q8 pipeline with recomputation, needs
    48.1 GiB with the margin: a tensor block stops at one node and at the 8 kv heads); with c up to 16
    the search ranks layouts with c > 1 first (the smallest 32.6 GiB), and its closed form agrees
    with the full plan path."""
    from layerwise.planning.search import search
    from layerwise.preflight import validate
    from tests.ranks import compose_config
    common = [*LLAMA_LONG, "model.max_sequence_length=524288", "data.sequence_length=524288", "data.vocab_size=32000",
              "hardware.nodes=2", "hardware.device_memory_bytes=4.5e10", "plan.search=true", "plan.search_top=3",
              "plan.search_replan=1"]
    without = compose_config(*common, "plan.search_max_context=1")
    assert search(without, validate(without), tmp_path / "without")["fitting"] == 0
    allowed = compose_config(*common, "plan.search_max_context=16")
    result = search(allowed, validate(allowed), tmp_path / "with")
    assert result["fitting"] > 0 and all(row["context_parallel"] > 1 for row in result["top"])
    replanned = result["replanned"][0]
    assert replanned["simulated_step_time_s"] == pytest.approx(replanned["closed_form_step_time_s"], rel=0.01)
    assert replanned["planned_worst_role_bytes"] == pytest.approx(replanned["closed_form_worst_role_bytes"], rel=0.01)


@pytest.mark.parametrize("strategy,comm,recompute", [("modular_pipeline", "ring", "none"), ("ddp", "all_gather", "none"),
                                                     ("modular_pipeline", "all_gather", "full")])
def test_planned_bytes_equal_a_context_parallel_runs_counted_bytes(tmp_path, strategy, comm, recompute):
    """llama_tiny, c = 2 on 2 forked ranks, 256 tokens: plan.json's bytes by kind equal the run's counted
    ones (summary.json comm_bytes_per_step) exactly — the exchange (`context_traffic` × 4 layers × the
    micro-batches; under full recomputation each layer's forward exchange once more, rerun in its
    backward) and the gradients' all-reduce over the data × context group."""
    from layerwise.planning.mode import plan
    from layerwise.preflight import validate
    from layerwise.run.fit import train
    from tests.ranks import compose_config
    stage = ["strategy.pipeline_degree=1", "strategy.layers_per_stage=4", "strategy.micro_batches=2"] \
        if strategy == "modular_pipeline" else []
    common = ["model=llama_tiny", f"strategy={strategy}", *stage, "logger=none", "trainer.progress=none",
              "trainer.limit_val_batches=0", "data.global_batch_size=2", "data.sequence_length=256",
              "hardware.devices_per_node=2", "strategy.context_parallel=2", f"strategy.context_parallel_comm={comm}",
              f"strategy.activation_recompute={recompute}"]
    cfg = compose_config(*common, "mode=plan")
    predicted = plan(cfg, validate(cfg), tmp_path / "plan", charts=False)["comm_bytes_per_step_by_pipeline_rank"][0]
    cfg = compose_config(*common, "trainer.max_steps=2", "trainer.charts=false", "data.max_bytes=2000000")
    measured = train(cfg, tmp_path / "run", validate(cfg))["comm_bytes_per_step"]
    assert {kind: volume for kind, volume in predicted.items() if volume} == \
        {kind: volume for kind, volume in measured.items() if volume}
    assert predicted["send_recv" if comm == "ring" else "all_gather"] > 0
