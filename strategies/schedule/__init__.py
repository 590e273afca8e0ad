"""Schedules as data: actions and plans (ir), generators, passes, validator, simulator, plotter, executor.

    plan = add_gradient_reductions(add_communication(build_plan("looped_breadth_first", ...)))
    validate_plan(plan); timeline = simulate(plan, unit_cost); plot_timeline(timeline, "gantt.png")
    records = execute(plan.ranks[rank], handlers)   # on each rank, handlers supplied by the strategy

The pass modules offload (L2L host<->device copies), zero (ZeRO-3 gathers and reduce-scatters) and
curvature (K-FAC work units) each declare their action kinds in ACTION_KINDS and their dependency
rules in DEPENDENCY_RULES; this file registers them all, here and nowhere else. Importing any
strategies.schedule module runs this file first, so KINDS is complete whatever the caller imported.
point_to_point holds NCCL's rule (each pair of ranks issues its sends and receives in one order):
add_communication places the receive posts it needs, validate_plan checks it on every plan.
"""

from . import curvature, offload, zero
from .execute import FINISH, ExecutedAction, execute
from .generators import (PLACEMENTS, SCHEDULES, build_plan, gpipe, interleaved_one_f_one_b, layered,
                         looped_breadth_first, one_f_one_b, stage_placement, zbv, zero_bubble_h1,
                         zero_bubble_h2)
from .ir import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, KINDS, POST_RECV_ACTIVATION, POST_RECV_GRADIENT, RECV_ACTIVATION, RECV_GRADIENT,
                 REDUCE_GRADIENT, SEND_ACTIVATION, SEND_GRADIENT, Action, KindInfo, Plan, PlanError, counterpart,
                 dependencies, is_post, kind_of, parse_action, parse_row, post_of, posted_receive, register_kinds)
from .passes import add_communication, add_gradient_reductions
from .point_to_point import (add_receive_posts, check_point_to_point_order, issue_order, issue_sequences,
                             message_order, most_sends_held, pair_orders, release_points, send_completions,
                             send_releases)
from .plot import plot_timeline
from .simulate import TimedAction, Timeline, flop_cost, simulate, unit_cost
from .validate import validate_plan

register_kinds(offload.ACTION_KINDS, offload.DEPENDENCY_RULES)
register_kinds(zero.ACTION_KINDS, zero.DEPENDENCY_RULES)
register_kinds(curvature.ACTION_KINDS, curvature.DEPENDENCY_RULES)

__all__ = [
    "Action", "KindInfo", "KINDS", "kind_of", "Plan", "PlanError", "parse_action", "parse_row", "counterpart",
    "dependencies", "is_post", "post_of", "posted_receive",
    "FORWARD", "BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "SEND_ACTIVATION", "RECV_ACTIVATION", "SEND_GRADIENT", "RECV_GRADIENT", "REDUCE_GRADIENT",
    "POST_RECV_ACTIVATION", "POST_RECV_GRADIENT",
    "PLACEMENTS", "SCHEDULES", "stage_placement", "gpipe", "one_f_one_b", "looped_breadth_first",
    "interleaved_one_f_one_b", "layered", "zero_bubble_h1", "zero_bubble_h2", "zbv", "build_plan",
    "add_communication", "add_gradient_reductions", "validate_plan",
    "add_receive_posts", "check_point_to_point_order", "issue_order", "issue_sequences", "message_order", "pair_orders",
    "send_releases", "most_sends_held",
    "release_points", "send_completions",
    "Timeline", "TimedAction", "simulate", "unit_cost", "flop_cost", "plot_timeline",
    "execute", "ExecutedAction", "FINISH",
]
