"""The plan structure the closed form's ZeRO × pipeline gathers assume (cost/step_time.py
`turnaround_before_receive`): which ranks post the gather of their backwards' turnaround right
before the gradient receive feeding their first backward, so that it hides behind that wait."""

import pytest

from cost.step_time import turnaround_before_receive
from strategies.schedule import BACKWARD, RECV_GRADIENT
from strategies.schedule.zero import GATHERS
from tests.test_plan_search import built


def turnarounds(row, stage: int, breadth_first: int) -> list:
    """The slot of each group's first backward of `stage` (a rank's last local stage) in `row`."""
    return [slot for slot, action in enumerate(row)
            if action.kind == BACKWARD and action.stage == stage and action.micro_batch % breadth_first == 0]


@pytest.mark.parametrize("pipeline, loops, micro, breadth_first", [
    (2, 1, 4, 2), (2, 1, 8, 4), (2, 2, 4, 2), (2, 2, 8, 4), (2, 4, 8, 8), (3, 2, 6, 3), (3, 2, 6, 6),
    (4, 1, 8, 4), (4, 1, 16, 8), (4, 2, 8, 4), (4, 2, 12, 6), (4, 3, 16, 4), (4, 3, 16, 8), (4, 6, 8, 4),
    (8, 2, 16, 8), (8, 2, 32, 16)])
def test_turnaround_gather_stands_before_the_gradient_receive_where_the_closed_form_says(
        pipeline, loops, micro, breadth_first):
    plan = built("looped_breadth_first", pipeline, loops * pipeline, micro, breadth_first, True)
    for rank, row in enumerate(plan.ranks):
        row = [action for action in row if action is not None]
        slots = turnarounds(row, rank + (loops - 1) * pipeline, breadth_first)
        assert len(slots) == micro // breadth_first
        before = [row[slot - 1].kind == RECV_GRADIENT and row[slot - 2].kind in GATHERS for slot in slots]
        if loops == 1:  # the turnaround's gather is the next group's first: none in the last group
            before = before[:-1]
        expected = turnaround_before_receive(rank, pipeline, loops, breadth_first)
        assert before == [expected] * len(before), (rank, [' '.join(map(str, row[s - 3:s + 1])) for s in slots])
