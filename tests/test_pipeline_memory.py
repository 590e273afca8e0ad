"""Sends released on completion (issue 28 items 1–3): the pipeline holds only the sends in flight.

`StageWork` keeps a sent tensor until its work completes; on gloo (and the fake group) a send
completes only in `wait()`, which it calls once a later message proves the peer issued the receive
(`strategies/schedule/point_to_point.py` `send_releases`; docs/strategies/pipeline_memory.md).
So on gloo the most sends a rank holds at once is a number of the plan (`most_sends_held`): here
it is measured in real runs and must equal the plan's, and for 1F1B it must not grow with m (the
executor before issue 28 held all m until the step's end). The memory model's closed form of the
held buffers (`closed_form_held`, read by the search) equals the built plans'. On NCCL (GPU
profiles) a send completes once the peer has issued its receive (`send_completions`), so the plan
holds fewer: checked by hand on p = 2, v = 2, m = 4, and below gloo's count on every tested plan.
Ids: {schedule}_pp2_m{m}: 2 pipeline ranks, m micro-batches (interleaved: 2 stages per rank).
"""

import os

import pytest

from layerwise.preflight import validate
from cost.memory import closed_form_held, held_sends
from strategies.modular_pipeline import training_plan
from strategies.schedule import (add_communication, add_gradient_reductions, build_plan, most_sends_held,
                                 send_completions)
from tests.ranks import QUICK, compose_config, run_on_ranks


def built(schedule: str, pipeline: int, loops: int, micro_batches: int, breadth_first=None):
    return add_gradient_reductions(add_communication(build_plan(
        schedule, pipeline_degree=pipeline, stages=pipeline * loops, micro_batches=micro_batches,
        breadth_first_micro_batches=breadth_first)))


@pytest.mark.parametrize("schedule, loops", [("one_f_one_b", 1), ("interleaved_one_f_one_b", 2)])
def test_one_f_one_b_holds_as_many_sends_whatever_m(schedule, loops):
    """From m = 2p on (at m = p interleaved 1F1B's warm-up is cut short), the count is the schedule's."""
    for pipeline in (2, 4):
        held = {m: [most_sends_held(built(schedule, pipeline, loops, m), rank) for rank in range(pipeline)]
                for m in (2 * pipeline, 16, 32)}
        assert held[2 * pipeline] == held[16] == held[32], (pipeline, held)
        assert max(held[32]) <= (loops + 1) * pipeline < 16


def test_gpipe_holds_every_micro_batch_it_must_stash():
    """GPipe runs every forward before any backward: its last rank's input gradients wait for a
    message that never comes back before the step ends, one per micro-batch."""
    assert [held_sends(built("gpipe", 2, 1, m), 1)[1] for m in (4, 16)] == [4, 16]


@pytest.mark.parametrize("schedule, loops", [("gpipe", 1), ("one_f_one_b", 1), ("interleaved_one_f_one_b", 2),
                                             ("interleaved_one_f_one_b", 3), ("looped_breadth_first", 2)])
def test_closed_form_of_held_buffers_equals_the_built_plans(schedule, loops):
    for pipeline in (2, 3, 4, 8):
        for micro_batches, breadth_first in [(8, None), (16, None), (16, 4), (24, 8), (12, 3)]:
            if schedule == "interleaved_one_f_one_b" and (breadth_first or micro_batches) % pipeline:
                continue
            try:
                plan = built(schedule, pipeline, loops, micro_batches, breadth_first)
            except ValueError:  # a combination the generators refuse (bf < p when looping)
                continue
            for rank in range(pipeline):
                assert closed_form_held(schedule, pipeline, loops, breadth_first or micro_batches, micro_batches,
                                        rank) == held_sends(plan, rank), (pipeline, micro_batches, breadth_first, rank)


def test_nccl_frees_a_looping_ranks_gradients_as_they_are_received_hand_checked():
    """Looped breadth-first, p = 2, v = 2 (rank 1 holds stages 1 and 3), m = 4. Every receive here is
    posted one pair operation ahead (add_receive_posts), no later than its send in the unit-cost
    timeline, so each send is complete from the next action of its row and dropped at the rank's
    next SEND or RECV. Rank 1's backward sends 3B0..3B3→2 then 1B0..1B3→0, one at a time: at each
    backward after its stages have started (1B1..1B3) the previous input gradient was dropped at the
    RECV just before (0 held), and 1B3→0, the last, is held to the end (1). On gloo a send waits for
    a later message to prove its receive: rank 1 holds 2 at a backward, 3 at the end, and at most 4
    at once on each rank."""
    plan = built("looped_breadth_first", 2, 2, 4)
    row = plan.ranks[1]
    slot = {action: index for index, action in enumerate(row) if action is not None}
    assert all(at == slot[send] + 1 for send, at in send_completions(plan)[1].items())
    assert held_sends(plan, 1, completes_when_received=True) == (0, 1)
    assert held_sends(plan, 1) == (2, 3)
    assert [most_sends_held(plan, rank, completes_when_received=True) for rank in range(2)] == [1, 1]
    assert [most_sends_held(plan, rank) for rank in range(2)] == [4, 4]


@pytest.mark.parametrize("schedule, loops", [("gpipe", 1), ("one_f_one_b", 1), ("interleaved_one_f_one_b", 2),
                                             ("looped_breadth_first", 2), ("looped_breadth_first", 3)])
def test_nccl_holds_no_more_than_gloo_and_the_search_bounds_it(schedule, loops):
    """On NCCL a rank never holds more than on gloo (a proven send is also complete), breadth-first
    and looping ranks far fewer; the search's NCCL closed form is above the plan's by at most one."""
    for pipeline in (2, 3, 4, 8):
        for micro_batches, breadth_first in [(8, None), (16, None), (16, 4), (24, 8)]:
            if schedule == "interleaved_one_f_one_b" and (breadth_first or micro_batches) % pipeline:
                continue
            try:
                plan = built(schedule, pipeline, loops, micro_batches, breadth_first)
            except ValueError:
                continue
            for rank in range(pipeline):
                nccl, gloo = held_sends(plan, rank, completes_when_received=True), held_sends(plan, rank)
                assert nccl[0] <= gloo[0] and nccl[1] <= gloo[1], (pipeline, micro_batches, rank, nccl, gloo)
                bound = closed_form_held(schedule, pipeline, loops, breadth_first or micro_batches, micro_batches,
                                         rank, completes_when_received=True)
                assert 0 <= bound[0] - nccl[0] <= 1 and 0 <= bound[1] - nccl[1] <= 1, (pipeline, rank, bound, nccl)
            if schedule != "one_f_one_b" and pipeline > 2 and micro_batches >= 16:
                assert held_sends(plan, 1, True)[1] == 1 < held_sends(plan, 1)[1] // 2  # gloo: about bf or v·bf


# ----------------------------------------------------------------------------- measured on gloo ranks

def held_by_rank(rank, cfg):
    """Fit two steps on this rank (one_rank_step, the dry run's per-rank reference) and return the
    most sends StageWork held at once in each step."""
    from layerwise.tools.dry_run import one_rank_step
    from strategies.stages import StageWork
    held, finish = [], StageWork.finish

    def recording_finish(work):
        held.append(work.state.most_held)
        finish(work)
    StageWork.finish = recording_finish
    one_rank_step(cfg, int(os.environ["WORLD_SIZE"]))
    return held


RUNS = {
    "one_f_one_b_pp2_m16": ["strategy=one_f_one_b", "model.layers=2", "strategy.layers_per_stage=1",
                            "strategy.micro_batches=16", "data.global_batch_size=16"],
    "interleaved_pp2_m8": ["strategy=interleaved_1f1b", "model.layers=4", "strategy.layers_per_stage=1",
                           "strategy.micro_batches=8", "data.global_batch_size=8"],
}


@pytest.mark.parametrize("case", list(RUNS))
def test_sends_held_in_a_real_run_are_the_plans_in_flight_count(case):
    cfg = compose_config(*QUICK, *RUNS[case])
    world = validate(cfg)
    plan = training_plan(cfg.strategy, cfg.model.layers)
    held = run_on_ranks(held_by_rank, world, cfg)
    for rank in range(world):
        expected = most_sends_held(plan, rank)
        assert held[rank] == [expected, expected], (rank, held[rank], expected)
        assert expected < cfg.strategy.micro_batches  # held until the step's end, it was m
