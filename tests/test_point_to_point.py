"""The strict point-to-point mode: real gloo ranks record what they issue, and an order NCCL would
mismatch or deadlock on fails the run although gloo (which matches by tag) completes it.

Both of NCCL's settings are covered (docs/architecture.md, "Point-to-point order"): a dedicated
communicator per pair (each pair's operations in one order) and the group's one communicator, which
torch 2.11-2.13 uses once the group is eagerly initialised (Lightning passes device_id on GPUs), where
a rank's operations toward all its peers run in issue order: no cycle may run through the ranks.
The plan-level rule over every generator's plans is also tested in test_schedule.py.
"""

import json

import pytest
import torch
import torch.distributed as dist

from layerwise.run.fit import train
from layerwise.preflight import validate
from models import build_model
from parallel.comm import Communicator, IssuedOperation, PointToPointOrderError, first_order_mismatch
from parallel.dims import Layout
from parallel.layout import ParallelLayout
from strategies.modular_pipeline import ModularPipelineStrategy
from strategies.schedule import (PlanError, add_communication, add_gradient_reductions, check_point_to_point_order,
                                 execute, issue_order, looped_breadth_first, message_order, validate_plan)
from strategies.schedule.curvature import synchronous_plan
from strategies.schedule.point_to_point import _transfer_times
from strategies.schedule.simulate import simulate, unit_cost
from strategies.schedule.zero import add_zero
from strategies.stages import Peers, StageWork, keep_local_stages
from layerwise.run.launch import RankError
from tests.ranks import QUICK, compose_config, run_on_ranks
from tests.test_schedule import PIPELINE_GRID, broken, grid_id, pipeline_plan, posts_at_step_start
from strategies.modular_pipeline import forward_only


def operation(kind, peer, tag, elements=4):
    return IssuedOperation(kind, peer, elements, "torch.float32", tag)


def test_matching_sequences_pass():
    issued = [[operation("send", 1, 0), operation("receive", 1, 1)],
              [operation("receive", 0, 0), operation("send", 0, 1)]]
    assert first_order_mismatch(issued) is None


@pytest.mark.parametrize("theirs, expected", [
    ([operation("send", 0, 1), operation("receive", 0, 0)], "rank 1 issued send to rank 0: 4 × torch.float32, tag 1"),
    ([operation("receive", 0, 1), operation("send", 0, 1)], "rank 1 issued receive from rank 0: 4 × torch.float32, "
                                                             "tag 1"),
    ([operation("receive", 0, 0, elements=8), operation("send", 0, 1)], "8 × torch.float32"),
    ([], "rank 1 issued nothing"),
], ids=["both_send_first", "same_size_other_message", "other_size", "missing"])
def test_a_mismatch_names_the_pair_k_and_both_operations(theirs, expected):
    issued = [[operation("send", 1, 0), operation("receive", 1, 1)], theirs]
    message = first_order_mismatch(issued)
    assert "between ranks 0 and 1 at operation #0" in message and expected in message
    assert "rank 0 issued send to rank 1: 4 × torch.float32, tag 0" in message


def exchange_on_rank(rank: int, sends_first_on_both: bool):
    """Rank 0 sends then receives; rank 1 receives then sends (NCCL-safe) or also sends first."""
    dist.init_process_group("gloo")
    communicator, group = Communicator(), ParallelLayout(Layout(pipeline=2), rank=rank).group("pipeline")
    communicator.record_point_to_point()
    outgoing, incoming, peer = torch.full((4,), float(rank)), torch.empty(4), 1 - rank
    send = lambda: communicator.send(outgoing, peer, group, tag=rank)  # noqa: E731
    receive = lambda: communicator.receive(incoming, peer, group, tag=peer)  # noqa: E731
    works = [send(), receive()] if rank == 0 or sends_first_on_both else [receive(), send()]
    for work in works:
        work.wait()  # gloo completes both orders: it matches by tag
    assert incoming.tolist() == [float(peer)] * 4
    try:
        return communicator.check_point_to_point_order()
    except PointToPointOrderError as error:
        return str(error)


def test_strict_communicator_catches_an_order_gloo_hides():
    assert run_on_ranks(exchange_on_rank, 2, False) == [2, 2]
    messages = run_on_ranks(exchange_on_rank, 2, True)
    assert messages[0] == messages[1]  # every rank raises, with the same words
    assert "between ranks 0 and 1 at operation #0: rank 0 issued send to rank 1" in messages[0]
    assert "rank 1 issued send to rank 0" in messages[0]


def pipeline_step_on_rank(rank: int, plans):
    """One training step of each plan with StageWork on two gloo ranks; what the strict check says."""
    dist.init_process_group("gloo")
    layout = ParallelLayout(Layout(pipeline=2), rank=rank)
    layout.communicator.record_point_to_point()
    pipeline = layout.group("pipeline")
    results = []
    for plan in plans:
        model = build_model("gpt", vocab_size=64, sequence_length=16, layers=plan.stages, hidden=16, heads=2, seed=0)
        keep_local_stages(model, list(plan.stages_on(rank)), plan.stages, 1)
        peers = Peers([pipeline.ranks[r] for r in plan.placement], pipeline, layout.group("data"), layout.communicator)
        work = StageWork(model, plan.stages, 1, plan.micro_batches, peers)
        generator = torch.Generator().manual_seed(0)
        work.start({key: torch.randint(0, 64, (8, 16), generator=generator) for key in ("tokens", "targets")}, True)
        execute(plan.ranks[rank], work.handlers())
        try:
            results.append(layout.communicator.check_point_to_point_order())
        except PointToPointOrderError as error:
            results.append(str(error))
    return results


def test_strict_mode_passes_the_real_plan_and_catches_receives_posted_at_step_start():
    plan = validate_plan(add_gradient_reductions(add_communication(looped_breadth_first(2, 4, 2))))
    rank_zero, rank_one = run_on_ranks(pipeline_step_on_rank, 2, [plan, posts_at_step_start(plan)])
    # 3 stage boundaries × 4 micro-batches, an activation and a gradient each: 24 operations per rank
    assert rank_zero[0] == rank_one[0] == 24
    assert rank_zero[1] == rank_one[1]
    assert "between ranks 0 and 1 at operation #0: rank 0 issued receive from rank 1" in rank_zero[1]
    assert "rank 1 issued receive from rank 0" in rank_zero[1]


def test_a_run_whose_order_nccl_would_deadlock_fails(tmp_path, monkeypatch):
    """The whole run, strict mode on (as in every multi-process test): the old order fails it."""
    unsafe = staticmethod(lambda compute: posts_at_step_start(add_gradient_reductions(compute)))
    monkeypatch.setattr(ModularPipelineStrategy, "complete_plan", unsafe)  # skips validate_plan
    cfg = compose_config(*QUICK, "trainer.max_steps=2", "strategy=modular_pipeline", "model.layers=4")
    # The initial validation's 12 activation messages (forward plan, still safe) match; the step's first does not.
    with pytest.raises(RankError, match="point-to-point order mismatch between ranks 0 and 1 at operation #12"):
        train(cfg, tmp_path, validate(cfg))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "PointToPointOrderError" in summary["error"]


# -----------------------------------------------------------------------------
# One communicator per group (torch 2.11-2.13 with device_id): no cycle through the ranks

# Each rank sends to the next and then receives from the previous one. Every pair agrees (the pair's
# one message each way is a send on one side and its receive on the other), so a communicator per
# pair runs it; on the group's one communicator each rank's send waits at the head of its stream
# for a receive its peer issues only after its own send: a cycle 0 → 1 → 2 → 0.
RING = [[operation("send", 1, 0), operation("receive", 2, 2)],
        [operation("send", 2, 1), operation("receive", 0, 0)],
        [operation("send", 0, 2), operation("receive", 1, 1)]]


def test_a_cycle_across_peers_is_refused_although_every_pair_agrees():
    message = first_order_mismatch(RING)
    assert message is not None and "mismatch" not in message  # no pair disagrees ...
    assert "ranks 0 → 1 → 2 → 0 wait in a cycle" in message  # ... but the ranks wait in a ring
    assert "rank 0 issued send to rank 1: 4 × torch.float32, tag 0" in message
    assert "rank 2 issued send to rank 0: 4 × torch.float32, tag 2" in message
    # receiving first on one rank breaks the ring: rank 0's receive meets rank 2's send
    assert first_order_mismatch([RING[0][::-1], RING[1], RING[2]]) is None


def ring_on_rank(rank: int):
    """Rank r sends to r + 1, then receives from r - 1 (RING); gloo completes it."""
    dist.init_process_group("gloo")
    communicator, group = Communicator(), ParallelLayout(Layout(pipeline=3), rank=rank).group("pipeline")
    communicator.record_point_to_point()
    outgoing, incoming = torch.full((4,), float(rank)), torch.empty(4)
    works = [communicator.send(outgoing, (rank + 1) % 3, group, tag=rank),
             communicator.receive(incoming, (rank - 1) % 3, group, tag=(rank - 1) % 3)]
    for work in works:
        work.wait()
    assert incoming.tolist() == [float((rank - 1) % 3)] * 4
    try:
        return communicator.check_point_to_point_order()
    except PointToPointOrderError as error:
        return str(error)


def test_strict_communicator_catches_a_cycle_gloo_completes():
    messages = run_on_ranks(ring_on_rank, 3)
    assert messages[0] == messages[1] == messages[2]  # every rank raises, with the same words
    assert "ranks 0 → 1 → 2 → 0 wait in a cycle" in messages[0], messages[0]


# Four stages on three ranks (the last back on rank 0), one micro-batch. Rank 0 posts stage 3's
# input before it sends stage 0's output: each pair agrees and the dry run completes, but every
# rank's first operation is a receive from the rank that is itself waiting: 0 ← 2 ← 1 ← 0.
EARLY_POST_RING = ["3f0←2 0F0 0F0→1 3F0←2 3F0 3B0 3B0→2 0B0←1 0B0",
                   "1F0←0 1F0 1F0→2 1B0←2 1B0 1B0→0",
                   "2F0←1 2F0 2F0→3 2B0←3 2B0 2B0→1"]


def test_validator_refuses_a_plan_whose_ranks_wait_in_a_cycle():
    plan = broken(EARLY_POST_RING, stages=4, placement=(0, 1, 2, 0))
    with pytest.raises(PlanError, match="wait in a cycle") as error:
        validate_plan(plan)
    assert "ranks 0 → 2 → 1 → 0" in str(error.value), str(error.value)
    assert ">>3f0←2<<" in str(error.value) and ">>1F0←0<<" in str(error.value) and ">>2F0←1<<" in str(error.value)
    assert sorted(error.value.marks) == [(0, 0), (1, 0), (2, 0)]


@pytest.mark.parametrize("p, m", [(3, 3), (4, 8)])
def test_a_ring_of_ranks_gets_posts_in_one_order_for_all_peers(p, m):
    """Looped placement puts the last stage's rank next to rank 0 again: a ring of peers, where
    posting each pair's receives as early as that pair allows made every rank wait for the next."""
    plan = validate_plan(add_gradient_reductions(add_communication(looped_breadth_first(p, m, 2))))
    order = {message.send: index for index, message in enumerate(message_order(plan))}
    for rank, issued in issue_order(plan).items():
        positions = [order[item.message] for item in issued]
        assert positions == sorted(positions), rank  # each rank issues a subsequence of one order


@pytest.mark.parametrize("schedule, p, m, v", PIPELINE_GRID,
                         ids=[f"{schedule}-{grid_id(case)}" for schedule, *case in PIPELINE_GRID])
def test_every_plan_runs_on_one_communicator_per_group(schedule, p, m, v):
    """Training (reductions or ZeRO), forward-only and K-FAC step-0 plans: no cycle through the ranks."""
    transfers = add_communication(pipeline_plan(schedule, p, m, v))
    for plan in (add_gradient_reductions(transfers), add_zero(transfers), forward_only(transfers),
                 synchronous_plan(add_gradient_reductions(transfers))):
        check_point_to_point_order(plan)


@pytest.mark.parametrize("schedule, v", [("one_f_one_b", 1), ("zbv", 2), ("looped_breadth_first", 2),
                                         ("interleaved_one_f_one_b", 2)])
def test_a_send_completes_after_what_either_rank_issued_before_it(schedule, v):
    """On one stream per rank a transfer also waits for both ranks' earlier operations; on the built
    plans (every rank issues a subsequence of one order by send time) that delays none of them, so
    NCCL's held-send counts (docs/strategies/pipeline_memory.md) hold on a shared communicator."""
    plan = add_gradient_reductions(add_communication(pipeline_plan(schedule, 4, 8, v)))
    start = {record.action: record.start for row in simulate(plan, unit_cost).ranks for record in row}
    ran = _transfer_times(plan, start)
    for rank, issued in issue_order(plan).items():
        for previous, item in zip(issued, issued[1:]):
            assert ran[previous.message] <= ran[item.message]  # one stream per rank
        for item in issued:
            assert ran[item.message] >= start[item.action]  # not before this end's issue
    receive_issued = {item.message: item.action for sequence in issue_order(plan).values() for item in sequence
                      if item.action != item.message}
    assert all(ran[send] == max(start[send], start[receive]) for send, receive in receive_issued.items())
