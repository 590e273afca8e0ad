"""The strict point-to-point mode: real gloo ranks record what they issue, and an order NCCL would
mismatch fails the run although gloo (which matches by tag) completes it.

The plan-level rule (every generator's plans, the rejected orders) is tested in test_schedule.py.
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
from strategies.schedule import (add_communication, add_gradient_reductions, execute, looped_breadth_first,
                                 validate_plan)
from strategies.stages import Peers, StageWork, keep_local_stages
from layerwise.run.launch import RankError
from tests.ranks import QUICK, compose_config, run_on_ranks
from tests.test_schedule import posts_at_step_start


def operation(kind, peer, tag, elements=4):
    return IssuedOperation(kind, peer, elements, "torch.float32", tag)


def test_matching_sequences_pass():
    issued = [{1: [operation("send", 1, 0), operation("receive", 1, 1)]},
              {0: [operation("receive", 0, 0), operation("send", 0, 1)]}]
    assert first_order_mismatch(issued) is None


@pytest.mark.parametrize("theirs, expected", [
    ([operation("send", 0, 1), operation("receive", 0, 0)], "rank 1 issued send to rank 0: 4 × torch.float32, tag 1"),
    ([operation("receive", 0, 1), operation("send", 0, 1)], "rank 1 issued receive from rank 0: 4 × torch.float32, "
                                                             "tag 1"),
    ([operation("receive", 0, 0, elements=8), operation("send", 0, 1)], "8 × torch.float32"),
    ([], "rank 1 issued nothing"),
], ids=["both_send_first", "same_size_other_message", "other_size", "missing"])
def test_a_mismatch_names_the_pair_k_and_both_operations(theirs, expected):
    issued = [{1: [operation("send", 1, 0), operation("receive", 1, 1)]}, {0: theirs} if theirs else {}]
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
