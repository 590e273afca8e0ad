"""Expert parallelism (issue 58 items 2-3): the all-to-all dispatcher against a one-process reference,
the counted all-to-all and the strict collective-order check, and training runs equal to `single`.

Ids: e{e} experts split over e ranks, E{E} experts, dp{d} data ranks, pp{p} pipeline stages.
"""

import pytest
import torch
import torch.distributed as dist

from cost.traffic import expert_exchange_traffic
from parallel.comm import Communicator, IssuedCollective, PointToPointOrderError, first_collective_mismatch
from parallel.dims import Layout
from parallel.layout import ParallelLayout
from strategies.expert_parallel import AllToAllDispatcher, source_to_expert_order
from tests.ranks import run_on_ranks
from tests.references import SgdComparison, SgdRun, sgd_reference
from tests.tolerances import EXACT_RTOL, LOSS_RTOL, OPERATOR_RTOL, OPERATOR_SCALE_ATOL

HIDDEN = 6


def routed_rows(rank: int, experts: int, generator_seed: int = 0):
    """Rank `rank`'s routed slots, sorted by global expert: (rows [n, h], count per expert [E]);
    some experts get no row on some ranks (the empty splits are part of what is tested)."""
    generator = torch.Generator().manual_seed(generator_seed * 1000 + rank)
    counts = torch.randint(0, 4, (experts,), generator=generator)
    counts[rank % experts] = 0
    return torch.randn(int(counts.sum()), HIDDEN, generator=generator), counts


def expert_weights(experts: int) -> torch.Tensor:
    return torch.randn(experts, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(7))


def apply_experts(rows: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Rows grouped by expert (counts[j] rows of expert j, in order) through expert j's weights: a loop."""
    pieces = rows.split(counts.tolist())
    return torch.cat([piece @ weights[j] for j, piece in enumerate(pieces)]) if pieces else rows


def test_source_to_expert_order_groups_rows_by_local_expert():
    # 2 sources × 3 local experts; rows numbered in source order: s0 [e0: 2, e1: 0, e2: 1], s1 [e0: 1, e1: 2, e2: 0]
    counts = torch.tensor([[2, 0, 1], [1, 2, 0]])
    assert source_to_expert_order(counts).tolist() == [0, 1, 3, 4, 5, 2]
    assert source_to_expert_order(torch.zeros(2, 2, dtype=torch.long)).tolist() == []


def test_a_rank_builds_only_its_experts_with_the_whole_models_values():
    """apply_expert_parallel on the meta model, then materialise: member i of e holds experts
    [i·E/e, (i+1)·E/e) of every MoE block (`first` says so), bit-identical to the whole model's, and
    no block ever held more than its E/e experts off the meta device."""
    from types import SimpleNamespace

    from models import build_model
    from models.moe import moe_modules
    from strategies.expert_parallel import apply_expert_parallel, expert_parameters
    shape = dict(vocab_size=64, sequence_length=16, layers=2, hidden=32, heads=2, kv_heads=2, ffn_hidden=64,
                 experts=8, experts_per_token=2, seed=3)
    whole = build_model("llama", device="cpu", **shape)
    for index in range(4):
        model = build_model("llama", device="meta", **shape)
        apply_expert_parallel(model, SimpleNamespace(degrees=Layout(data=4, expert=4), index=lambda axis: index))
        assert all(parameter.shape[0] == 2 for parameter, _ in expert_parameters(model).values())  # on meta already
        model.materialise("cpu")
        for (name, layer), (_, reference) in zip(moe_modules(model), moe_modules(whole)):
            assert (layer.experts.first, layer.experts.count, layer.experts.total) == (2 * index, 2, 8), name
            for leaf in ("gate", "up", "down"):
                expected = getattr(reference.experts, leaf)[2 * index:2 * index + 2]
                torch.testing.assert_close(getattr(layer.experts, leaf), expected, rtol=0, atol=0)
            torch.testing.assert_close(layer.router.weight, reference.router.weight, rtol=0, atol=0)


def dispatch_on_rank(rank: int, world: int, experts: int):
    """Dispatch, a per-expert product, combine; forward and gradients against the reference."""
    dist.init_process_group("gloo")
    layout = ParallelLayout(Layout(data=world, expert=world), rank=rank)
    communicator = layout.communicator
    communicator.record_point_to_point()
    group = layout.group("expert")
    local = experts // world
    dispatcher = AllToAllDispatcher(group, communicator, experts)
    full = expert_weights(experts)
    weights = full[rank * local:(rank + 1) * local].clone().requires_grad_(True)
    x, counts = routed_rows(rank, experts)
    x.requires_grad_(True)
    received, local_counts = dispatcher.dispatch(x, counts)
    y = dispatcher.combine(apply_experts(received, local_counts, weights))
    probe = torch.randn(y.shape, generator=torch.Generator().manual_seed(100 + rank))
    (y * probe).sum().backward()
    # the reference: every rank's rows through the whole weights, in one process
    x_ref, w_ref = x.detach().clone().requires_grad_(True), full.clone().requires_grad_(True)
    y_ref = apply_experts(x_ref, counts, w_ref)
    (y_ref * probe).sum().backward()
    # the weight gradient sums every rank's rows: rebuild theirs here
    w_all = full.clone().requires_grad_(True)
    for other in range(world):
        x_other, counts_other = routed_rows(other, experts)
        probe_other = torch.randn((int(counts_other.sum()), HIDDEN), generator=torch.Generator().manual_seed(100 + other))
        (apply_experts(x_other, counts_other, w_all) * probe_other).sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)  # the same rows through the same product
    # backward products over other row blocks: only the order of their sums differs (one operator)
    for actual, expected in ((x.grad, x_ref.grad), (weights.grad, w_all.grad[rank * local:(rank + 1) * local])):
        torch.testing.assert_close(actual, expected, rtol=OPERATOR_RTOL,
                                   atol=OPERATOR_SCALE_ATOL * float(expected.abs().max()))
    sent = communicator.bytes_by_kind["all_to_all"]
    communicator.check_point_to_point_order()
    return sent, counts.tolist()


@pytest.mark.parametrize("world,experts", [(2, 4), (4, 8)], ids=["e2_E4", "e4_E8"])
def test_dispatch_and_combine_equal_the_one_process_experts(world, experts):
    """Rows land on the member holding their expert, grouped by local expert, and come back in order;
    the gradients of the rows and of the experts equal one process's (the inverse all-to-all).
    Bytes: a rank sends its rows for other members' experts (dispatch, and the combine's backward)
    and the rows it got from other members (the combine, and the dispatch's backward), plus the
    counts' all-to-all (e-1 of e·(E/e) int64)."""
    results = run_on_ranks(dispatch_on_rank, world, world, experts)
    local = experts // world
    counts = [torch.tensor(c) for _, c in results]
    for rank, (sent, _) in enumerate(results):
        mine = slice(rank * local, (rank + 1) * local)
        to_others = int(counts[rank].sum() - counts[rank][mine].sum())
        from_others = sum(int(counts[other][mine].sum()) for other in range(world) if other != rank)
        assert sent == 2 * (to_others + from_others) * HIDDEN * 4 + (world - 1) * local * 8, (rank, sent)
        assert sent == expert_exchange_traffic(to_others, from_others, HIDDEN, local, world)


def test_collective_order_check_catches_a_swapped_or_mismatched_all_to_all():
    ranks = (0, 1)
    a2a = lambda sends, receives: IssuedCollective("expert", ranks, "all_to_all", sum(sends), "torch.float32",  # noqa: E731
                                                   sends, receives)
    reduce = IssuedCollective("data", ranks, "all_reduce", 8, "torch.float32")
    agreed = [[a2a((2, 3), (2, 5)), reduce], [a2a((5, 1), (3, 1)), reduce]]
    assert first_collective_mismatch(agreed) is None
    wrong_sizes = [[a2a((2, 3), (2, 5))], [a2a((4, 1), (3, 1))]]
    assert "rank 1 sends 4 elements to rank 0, which expects 5" in first_collective_mismatch(wrong_sizes)
    # two groups keep their own orders (their own communicators): issued apart, nothing to match
    assert first_collective_mismatch([[a2a((2, 3), (2, 5)), reduce], [reduce, a2a((5, 1), (3, 1))]]) is None
    on_expert = IssuedCollective("expert", ranks, "all_reduce", 8, "torch.float32")
    swapped = [[a2a((2, 3), (2, 5)), on_expert], [on_expert, a2a((5, 1), (3, 1))]]
    message = first_collective_mismatch(swapped)
    assert "collective order mismatch on group expert [0, 1] at collective #0" in message
    missing = [[reduce, reduce], [reduce]]
    assert "rank 1 issued nothing" in first_collective_mismatch(missing)


def collectives_on_rank(rank: int):
    """Two asynchronous all-reduces of different sizes on one group, issued in the same order by both
    ranks, then an all-to-all: what the strict check records and passes (the refusals are unit-tested
    above on the records themselves)."""
    dist.init_process_group("gloo")
    layout = ParallelLayout(Layout(data=2), rank=rank)
    communicator = layout.communicator
    communicator.record_point_to_point()
    first, second = torch.ones(4), torch.ones(2)
    works = [communicator.all_reduce(first, layout.group("data"), async_op=True),
             communicator.all_reduce(second, layout.group("data"), async_op=True)]
    for work in works:
        work.wait()
    output = torch.empty(3)
    communicator.all_to_all(output, torch.arange(3.0) + 3 * rank, [1 + rank, 2 - rank], [1 + rank, 2 - rank],
                            layout.group("data"))
    try:
        communicator.check_point_to_point_order()
        ok = "passed"
    except PointToPointOrderError as error:
        ok = str(error)
    return ok


def test_strict_check_passes_collectives_issued_in_the_same_order():
    assert run_on_ranks(collectives_on_rank, 2) == ["passed", "passed"]


def test_a_communicator_without_peers_copies():
    communicator = Communicator()
    group = ParallelLayout(Layout(), rank=0).group("data")
    output = torch.empty(3, 2)
    assert communicator.all_to_all(output, torch.ones(3, 2), [3], [3], group) is None
    assert output.sum() == 6 and communicator.bytes_by_kind["all_to_all"] == 0


# ----- training runs equal to `single` -------------------------------------------------------------
#
# The MoE model of these runs: llama_tiny's block at the SGD size (references.SGD_MODEL: 4 blocks,
# 16 sequences) with every SwiGLU an MoE of E experts, k = 2 per token, dropless, the auxiliary loss
# on (model.aux_loss_coefficient's default). Each case names its reference's overrides.
MOE = ("model=llama_tiny", "model.heads=4", "model.kv_heads=2", "model.ffn_hidden=64", "model.experts_per_token=2")


def experts(count: int, router: str = "softmax_topk") -> tuple:
    return (*MOE, f"model.experts={count}", f"model.router={router}")


SGD_CASES = {
    # ddp: e = d (expert_data of one rank each), e < d (experts summed over expert_data pairs)
    "ddp_dp2_e2_E4": (["strategy=ddp", "hardware.devices_per_node=2", "strategy.expert_parallel=2"], 2, experts(4)),
    "ddp_dp4_e4_E8": (["strategy=ddp", "hardware.devices_per_node=4", "strategy.expert_parallel=4"], 4, experts(8)),
    "ddp_dp4_e2_E4_sigmoid": (["strategy=ddp", "hardware.devices_per_node=4", "strategy.expert_parallel=2"], 4,
                              experts(4, "sigmoid_bias")),
    # full recomputation: each block's forward, its token exchange included, reruns in the backward
    "ddp_dp2_e2_E4_recompute": (["strategy=ddp", "hardware.devices_per_node=2", "strategy.expert_parallel=2",
                                 "strategy.activation_recompute=full"], 2, experts(4)),
    # a pipeline of 2 stages × 2 replicas, the experts of each stage split over the replicas
    "modular_pipeline_pp2_dp2_e2_E4": (["strategy=modular_pipeline", "strategy.pipeline_degree=2",
                                        "hardware.devices_per_node=4", "strategy.expert_parallel=2"], 4, experts(4)),
    # DeepSeek's shape: block 0 dense, a shared expert beside the routed ones (replicated: reduced over data)
    "modular_pipeline_pp2_dp2_e2_E4_shared": (["strategy=modular_pipeline", "strategy.pipeline_degree=2",
                                               "hardware.devices_per_node=4", "strategy.expert_parallel=2"], 4,
                                              (*experts(4), "model.shared_experts=1", "model.moe_layers=[1,2,3]")),
    # ... under ZB-H1 (the split backward: the all-to-all's backward runs in I, the experts' W later)
    "zero_bubble_h1_pp2_dp2_e2_E8": (["strategy=one_f_one_b", "strategy.schedule=zero_bubble_h1",
                                      "hardware.devices_per_node=4", "strategy.expert_parallel=2"], 4, experts(8)),
    # ZeRO-3: the experts a flat shard of their own per stage, cut over expert_data (2 ranks here)
    # ... and ZBV (the V placement: two stages per rank, each exchanging its own tokens)
    "zbv_pp2_dp2_e2_E4": (["strategy=one_f_one_b", "strategy.schedule=zbv", "strategy.layers_per_stage=1",
                           "hardware.devices_per_node=4", "strategy.expert_parallel=2"], 4, experts(4)),
    # the distributed optimizer: split experts in buckets of their own, sliced over expert_data (2 ranks)
    "modular_pipeline_pp1_dp4_e2_E4_distributed_optimizer": (["strategy=modular_pipeline", "strategy.pipeline_degree=1",
                                                              "hardware.devices_per_node=4", "strategy.expert_parallel=2",
                                                              "strategy.distributed_optimizer=true"], 4, experts(4)),
    "zero_layered_dp4_e2_E4": (["strategy=zero_layered", "hardware.devices_per_node=4",
                                "strategy.expert_parallel=2"], 4, experts(4)),
    "zero_layered_pp2_dp2_e2_E8": (["strategy=zero_layered", "strategy.pipeline_degree=2",
                                    "hardware.devices_per_node=4", "strategy.expert_parallel=2"], 4, experts(8)),
}


@pytest.mark.parametrize("case", list(SGD_CASES))
def test_expert_parallel_equals_single_under_sgd(case, tmp_path, tmp_path_factory):
    """Losses (the auxiliary loss inside them), the first step's gradients and the parameters after
    3 SGD steps (references.SgdComparison; the expert bias is a buffer of the saved model, compared too)."""
    overrides, world, model = SGD_CASES[case]
    expected = sgd_reference(tmp_path_factory, "strategy=single", *model)
    comparison = SgdComparison(SgdRun(tmp_path, *overrides, *model), expected)
    assert comparison.actual.summary["world_size"] == world
    degree = next(int(o.split("=")[1]) for o in overrides if o.startswith("strategy.expert_parallel="))
    assert comparison.actual.summary["layout"]["expert"] == degree
    if "model.router=sigmoid_bias" in model:  # the bias moved (and is compared with the parameters)
        assert all(expected.last[name].abs().sum() > 0 for name in expected.last if name.endswith("expert_bias"))
    comparison.check()
    # the auxiliary loss (summary.json, its last step over every rank) and the loads: equal too
    actual, reference = comparison.actual.summary["experts"], expected.summary["experts"]
    print(f"aux loss {actual['aux_loss_final']!r} vs {reference['aux_loss_final']!r}; busiest expert / mean "
          f"{actual['expert_load_ratio_median']!r} vs {reference['expert_load_ratio_median']!r}")
    assert actual["aux_loss_final"] == pytest.approx(reference["aux_loss_final"], rel=LOSS_RTOL)
    assert actual["expert_load_ratio_median"] == reference["expert_load_ratio_median"]  # counts of slots: integers


def test_expert_gradients_divided_by_the_expert_data_ranks_instead_of_d_fail_the_comparison(
        tmp_path, tmp_path_factory, monkeypatch):
    """The SGD comparison sees the classic slip (each rank's expert gradient already sums its expert
    group's tokens, so it is divided by d, not by the d/e ranks it is summed over): a factor e."""
    import strategies.plain as plain
    from strategies.expert_parallel import sum_expert_gradients
    monkeypatch.setattr(plain, "sum_expert_gradients", lambda parameters, layout, replicas: sum_expert_gradients(
        parameters, layout, replicas // layout.degrees.expert))
    overrides, _, model = SGD_CASES["ddp_dp2_e2_E4"]
    comparison = SgdComparison(SgdRun(tmp_path, *overrides, *model),
                               sgd_reference(tmp_path_factory, "strategy=single", *model))
    worst, where = comparison.excess()["gradients"]
    print(f"gradients {worst:.3g} x their tolerance at {where}")
    assert worst > 1 and ".experts." in where
    with pytest.raises(AssertionError):
        comparison.check()


# ----- bytes: counted against the closed form with the routing the run saw -----------------------

class RoutingAndBytes:
    """A trainer callback (first, before the evidence's) writing, per training step, this rank's
    counted all_to_all bytes and every MoE layer's load (slots per global expert) to a JSON file."""

    def __new__(cls, directory):
        import json

        import lightning.pytorch as pl

        from models.moe import moe_modules

        class Callback(pl.Callback):
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
                rank = trainer.global_rank
                record = {"bytes": trainer.strategy.communicator().bytes_by_kind["all_to_all"],
                          "loads": [layer.load.tolist() for _, layer in moe_modules(module.model)]}
                with open(f"{directory}/routing{rank}.jsonl", "a") as file:
                    file.write(json.dumps(record) + "\n")
        return Callback()


@pytest.mark.parametrize("precision,element_bytes", [("32-true", 4), ("bf16-mixed", 2)])
def test_counted_all_to_all_bytes_equal_the_formula_with_the_routing_counts(precision, element_bytes, tmp_path,
                                                                            monkeypatch):
    """ddp, d = e = 2, E = 4, 2 steps: each step's counted all_to_all bytes of each rank equal
    cost/traffic.py expert_exchange_traffic summed over the MoE layers, with the rows each rank's
    tokens routed to the other rank's experts and the rows the other rank routed to its own, each
    row in the experts' compute dtype (bf16 under bf16-mixed)."""
    import json

    from cost.traffic import expert_exchange_traffic
    from layerwise.preflight import validate
    from layerwise.run.fit import train
    from tests.ranks import QUICK, add_callbacks, compose_config
    add_callbacks(monkeypatch.setattr, first=[RoutingAndBytes(tmp_path)])
    cfg = compose_config(*QUICK, *experts(4), "strategy=ddp", "strategy.expert_parallel=2", "trainer.max_steps=2",
                         "hardware.devices_per_node=2", f"hardware.precision={precision}")
    summary = train(cfg, tmp_path / "run", validate(cfg))
    assert summary["status"] == "completed", summary.get("error")
    records = [[json.loads(line) for line in (tmp_path / f"routing{rank}.jsonl").read_text().splitlines()]
               for rank in range(2)]
    hidden, local = cfg.model.hidden, 4 // 2
    for step in range(2):
        for rank in range(2):
            other = 1 - rank
            mine, theirs = slice(rank * local, (rank + 1) * local), slice(other * local, (other + 1) * local)
            expected = sum(expert_exchange_traffic(sum(load[theirs]), sum(records[other][step]["loads"][layer][mine]),
                                                   hidden, local, 2, element_bytes)
                           for layer, load in enumerate(records[rank][step]["loads"]))
            counted = records[rank][step]["bytes"]
            print(f"step {step + 1} rank {rank}: counted {counted:.0f} B, formula {expected:.0f} B")
            assert counted == pytest.approx(expected, rel=EXACT_RTOL)
    assert summary["comm_bytes_per_step"]["all_to_all"] > 0


# ----- AdamW --------------------------------------------------------------------------------------

ADAMW_STEPS = 3
ADAMW_CASES = {
    "ddp_dp4_e4_E8": ["strategy=ddp", "hardware.devices_per_node=4", "strategy.expert_parallel=4"],
    "modular_pipeline_pp2_dp2_e2_E8": ["strategy=modular_pipeline", "strategy.pipeline_degree=2",
                                       "hardware.devices_per_node=4", "strategy.expert_parallel=2"],
}


def adamw_run(directory, *overrides):
    from layerwise.preflight import validate
    from layerwise.run.fit import train
    from tests.ranks import QUICK, compose_config
    cfg = compose_config(*QUICK, *experts(8), "model.layers=4", "data.global_batch_size=16",
                         "trainer.limit_val_batches=0", f"trainer.val_check_interval={ADAMW_STEPS}",
                         f"trainer.max_steps={ADAMW_STEPS}", *overrides)
    summary = train(cfg, directory, validate(cfg))
    assert summary["status"] == "completed", summary.get("error")
    return summary


@pytest.fixture(scope="module")
def adamw_single(tmp_path_factory):
    from tests.references import tracing_optimizer
    directory = tmp_path_factory.mktemp("adamw_single")
    with tracing_optimizer(directory):
        return adamw_run(directory, "strategy=single"), directory


@pytest.mark.parametrize("case", list(ADAMW_CASES))
def test_expert_parallel_equals_single_under_adamw(case, adamw_single, tmp_path):
    """Losses of every step and the parameters after 3 AdamW steps, each element within the bound
    AdamW's update gives it (tolerances.adam_tolerance), against single's traced update."""
    from tests.references import consolidated_parameters
    from tests.tolerances import OptimizerTrace, assert_same_losses, assert_same_parameters
    expected, directory = adamw_single
    summary = adamw_run(tmp_path, *ADAMW_CASES[case])
    assert_same_losses(summary["losses"], expected["losses"])
    strategy = ADAMW_CASES[case][0].split("=")[1]
    actual, reference = consolidated_parameters(tmp_path, strategy), consolidated_parameters(directory, "single")
    trace = OptimizerTrace.load(directory)
    buffers = set(reference) - trace.names()  # the expert biases (softmax_topk: never moved), not optimised
    assert buffers and all(name.endswith("expert_bias") for name in buffers), buffers
    for name in buffers:
        torch.testing.assert_close(actual.pop(name), reference.pop(name), rtol=0, atol=0)
    assert_same_parameters(actual, reference, trace)


# ----- portable checkpoints: resume across e --------------------------------------------------------

# Each link resumes from the previous link's portable checkpoint under another e and runs one more
# AdamW step (tests/test_resume_matrix.py's chain): e2 -> e4, e4 -> ZeRO-3's e2 (experts in flat
# shards over expert_data), -> the distributed optimizer's e2 (AdamW's moments of the experts sliced
# over expert_data), -> a pipeline's e2, e2 -> 1 (single). The sigmoid_bias router's expert
# bias travels in the checkpoint too.
RESUME_CHAIN = [
    ("ddp_dp4_e2", ["strategy=ddp", "hardware.devices_per_node=4", "strategy.expert_parallel=2"]),
    ("ddp_dp4_e4", ["strategy=ddp", "hardware.devices_per_node=4", "strategy.expert_parallel=4"]),
    ("zero_layered_dp4_e2", ["strategy=zero_layered", "hardware.devices_per_node=4", "strategy.expert_parallel=2"]),
    ("distributed_optimizer_dp4_e2", ["strategy=modular_pipeline", "strategy.pipeline_degree=1",
                                      "hardware.devices_per_node=4", "strategy.expert_parallel=2",
                                      "strategy.distributed_optimizer=true"]),
    ("modular_pipeline_pp2_dp2_e2", ["strategy=modular_pipeline", "strategy.pipeline_degree=2",
                                     "hardware.devices_per_node=4", "strategy.expert_parallel=2"]),
    ("single", ["strategy=single"]),
]


def test_resume_across_expert_parallel_degrees_continues_as_single(tmp_path, tmp_path_factory):
    """Losses, parameters (the expert bias among them) and AdamW's state after each link equal the
    uninterrupted single run's after the same step (test_resume_matrix's tolerances)."""
    from tests.test_resume_matrix import ADAMW, assert_within_tolerance, run, walk_chain
    model = experts(4, "sigmoid_bias")
    directory = tmp_path_factory.mktemp("resume_single")
    steps = len(RESUME_CHAIN) + 1
    reference = directory, run(directory, ADAMW, steps, "strategy=single", *model,
                               save_steps=range(0, steps + 1), trace=True)
    chain = [(name, [*overrides, *model]) for name, overrides in RESUME_CHAIN]
    rows = walk_chain(tmp_path, reference, chain, ADAMW, with_optimizer_state=True)
    assert_within_tolerance(rows)


@pytest.mark.parametrize("layout", [
    ["strategy=ddp"],
    ["strategy=modular_pipeline", "strategy.pipeline_degree=2", "hardware.devices_per_node=4"],
    ["strategy=zero_layered", "strategy.pipeline_degree=2", "hardware.devices_per_node=4"],
], ids=["ddp_dp2_e2", "modular_pipeline_pp2_dp2_e2", "zero_layered_pp2_dp2_e2"])
def test_a_run_resumes_its_own_checkpoint_bit_identically(layout, tmp_path):
    """A run stopped after 2 steps and run again to 3 in the same directory (resuming from last.ckpt:
    ddp reads the portable checkpoint beside it, rank 0's file holding only its experts' AdamW
    moments; the pipeline its per-rank files, whose gathered experts are cut back to the rank's;
    zero_layered its per-rank files, the experts' flat shards among them) ends bit-identical
    to 3 uninterrupted steps: weights, expert bias and moments."""
    from layerwise.preflight import validate
    from layerwise.run.fit import train
    from strategies.checkpoint.portable import read_portable
    from tests.ranks import QUICK, compose_config
    overrides = [*QUICK, *experts(4, "sigmoid_bias"), *layout, "strategy.expert_parallel=2", "optimizer=adamw",
                 "trainer.limit_val_batches=0", "trainer.val_check_interval=10", "trainer.checkpoint_every_n_steps=1"]
    stopped, straight = tmp_path / "stopped", tmp_path / "straight"
    for directory, steps in ((stopped, 2), (stopped, 3), (straight, 3)):
        cfg = compose_config(*overrides, f"trainer.max_steps={steps}")
        summary = train(cfg, directory, validate(cfg))
        assert summary["status"] == "completed" and summary["steps"] == steps, summary.get("error")
    for prefix in ("model.", "optimizer."):
        resumed, expected = (read_portable(run / "checkpoints" / "last", prefix) for run in (stopped, straight))
        assert resumed.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(resumed[name], expected[name], rtol=0, atol=0, msg=name)
