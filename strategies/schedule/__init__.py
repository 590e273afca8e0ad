"""Schedules as data: actions and plans (ir), generators, passes, validator, simulator, plotter, executor.

    plan = add_gradient_reductions(add_communication(build_plan("looped_breadth_first", ...)))
    validate_plan(plan); timeline = simulate(plan, unit_cost); plot_timeline(timeline, "gantt.png")
    records = execute(plan.ranks[rank], handlers)   # on each rank, handlers supplied by the strategy
"""

from .execute import FINISH, ExecutedAction, execute
from .generators import (PLACEMENTS, SCHEDULES, build_plan, gpipe, interleaved_one_f_one_b, layered,
                         looped_breadth_first, one_f_one_b, stage_placement)
from .ir import (BACKWARD, FORWARD, KINDS, RECV_ACTIVATION, RECV_GRADIENT, REDUCE_GRADIENT, SEND_ACTIVATION,
                 SEND_GRADIENT, Action, KindInfo, Plan, PlanError, counterpart, dependencies, kind_of, parse_action,
                 parse_row)
from .passes import add_communication, add_gradient_reductions
from .plot import plot_timeline
from .simulate import TimedAction, Timeline, flop_cost, simulate, unit_cost
from .validate import validate_plan

__all__ = [
    "Action", "KindInfo", "KINDS", "kind_of", "Plan", "PlanError", "parse_action", "parse_row", "counterpart",
    "dependencies",
    "FORWARD", "BACKWARD", "SEND_ACTIVATION", "RECV_ACTIVATION", "SEND_GRADIENT", "RECV_GRADIENT", "REDUCE_GRADIENT",
    "PLACEMENTS", "SCHEDULES", "stage_placement", "gpipe", "one_f_one_b", "looped_breadth_first",
    "interleaved_one_f_one_b", "layered", "build_plan",
    "add_communication", "add_gradient_reductions", "validate_plan",
    "Timeline", "TimedAction", "simulate", "unit_cost", "flop_cost", "plot_timeline",
    "execute", "ExecutedAction", "FINISH",
]
