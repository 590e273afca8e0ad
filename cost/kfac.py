"""PipeFisher's plan (Osawa et al. 2023, docs/strategies/pipefisher.md): K-FAC's units priced with plan mode's cost
model and packed into the first-order plan's bubbles, and the bytes strategies/kfac.py allocates.

  time    every curvature unit (aᵀa, gᵀg) and inversion costs its FLOPs (strategies/schedule/curvature.py
          `unit_flops`) at the rate plan mode gives F and B; a factor sync is its all-reduce over the
          data group's link. `units.pack` places the units in the bubbles of k consecutive steps (k the
          packing needs unless strategy.refresh_interval forces it); the one simulator times each of
          the cycle's k plans; the step is their mean plus what runs on the critical path: the
          exposed data-parallel reduction and the preconditioning ΔW = B⁻¹·∇W·A⁻¹.
  memory  per pipeline rank, for every block Linear of its stages (this rank's 1-D shard of it):
          the factors A (in × in, no bias column: kfac.py preconditions the bias by B⁻¹ alone) and
          B (out × out) and the inverses in use (`KFAC.inverses`), all fp32 and resident; plus what
          passes, the most it adds to the rank's peak over the cycle's steps as the packing placed
          the units, while the stash is full (in a bubble after the forward that fills it, where the
          backward's working set is not live yet, or as the next backward starts): the captured
          a / g of units still to run (`KFAC.captured`; in the capturing step a is the stash itself
          and g appears only as the backward frees more), inverses built and not yet promoted
          (`KFAC.fresh`) and an inversion's float64 workspace while it runs.
"""

import statistics

from cost.inputs import Device, Workload
from cost.step_time import collective_seconds, predict_step, step_cost
from cost.memory import block_saved_bytes, in_flight
from strategies.schedule import BACKWARD, FORWARD, simulate
from strategies.schedule import curvature as units
from cost.inputs import BYTES
from cost.traffic import all_reduce

FLOAT64 = 8
CHOLESKY_TEMPORARIES = 4  # kfac.damped_inverse: eye, the damped float64 copy, its Cholesky factor, the inverse


# ----- time

def block_shape(workload: Workload) -> units.BlockShape:
    """The shapes curvature.py's FLOP counts need, for this workload's micro-batch."""
    shape = workload.shape
    return units.BlockShape(shape.hidden, shape.mlp_ratio, shape.length, workload.micro_batch_rows * shape.length,
                            workload.layers_per_stage, units.block_linears(shape.block))


def kfac_cost(workload: Workload, device: Device, plan):
    """Plan mode's cost of F, B and receives, the K-FAC units' FLOPs at the same achieved rate, and
    the factor syncs' all-reduce over the data group (nothing with one data replica per stage)."""
    base = step_cost(workload, device, plan)
    rate = device.flops_per_second * device.efficiency
    seconds = {kind: flops / rate for kind, flops in shard_unit_flops(workload).items()}
    seconds.update({kind: sync_seconds(workload, device, factor)
                    for kind, factor in ((units.SYNC_A, "A"), (units.SYNC_B, "B"))})
    return lambda action: seconds[action.kind] if action.kind in seconds else base(action)


def shard_unit_flops(workload: Workload) -> dict:
    """curvature.py's `unit_flops` on the factors this rank holds (`factor_dimensions`: under a 1-D
    grid one of each Linear's two is split); without a grid, `unit_flops` itself."""
    dimensions, blocks = factor_dimensions(workload), workload.layers_per_stage
    tokens = workload.micro_batch_rows * workload.shape.length
    flops = {kind: blocks * 2 * tokens * sum(pair[factor == "B"] ** 2 for pair in dimensions[part])
             for (factor, part), kind in units.CURVATURE.items()}
    flops.update({half: flops[kind] / 2 for kind, pair in units.HALVES.items() for half in pair})
    flops[units.INVERT_A] = blocks * sum(a ** 3 for a, _ in units.every_linear(dimensions))
    flops[units.INVERT_B] = blocks * sum(b ** 3 for _, b in units.every_linear(dimensions))
    return flops


def stage_factor_elements(workload: Workload, factor: str) -> int:
    """Elements of one stage's A (or B) factors of every block Linear on this rank (so also of its
    inverses); kfac.py keeps them in the weights' dtype, fp32."""
    return workload.layers_per_stage * sum(pair[factor == "B"] ** 2
                                           for pair in units.every_linear(factor_dimensions(workload)))


def sync_seconds(workload: Workload, device: Device, factor: str) -> float:
    """One stage's A or B factors summed over its data replicas (strategies/pipefisher.py `_sync`)."""
    layout = workload.layout
    if layout.data == 1:
        return 0.0
    extent = workload.tensor_ranks * layout.pipeline * layout.data  # the data axis is outermost
    return collective_seconds(device, all_reduce(stage_factor_elements(workload, factor), layout.data), extent,
                              stride=workload.tensor_ranks * layout.pipeline)


def preconditioning_flops(shape: units.BlockShape) -> float:
    """ΔW = B⁻¹·∇W·A⁻¹ for every Linear of a stage: 2·out²·in + 2·out·in² (Δb = B⁻¹∇b is negligible)."""
    return linear_preconditioning_flops(units.every_linear(units.linear_shapes(shape)), shape.layers_per_stage)


def linear_preconditioning_flops(pairs, blocks: int) -> float:
    """`preconditioning_flops` for Linears of these (in, out) — or a rank's shards' (A side, B side)."""
    return blocks * sum(2 * out * out * fan_in + 2 * out * fan_in * fan_in for fan_in, out in pairs)


def pipefisher_step(workload: Workload, device: Device, plan, refresh_interval: int = None,
                    margin: float = 0.05) -> dict:
    """The first-order step (`predict_step`), the cycle the packing needs (`needed`; the forced one if
    no k fits every unit: `fits_bubbles` false) and the one that runs (`cycle`: k forced by
    `refresh_interval`, else the same), their cost, PipeFisher's step in seconds and K-FAC's step
    without bubbles (every unit on the critical path, one refresh per k)."""
    first_order = predict_step(workload, device, plan)
    cost = kfac_cost(workload, device, plan)
    needed, cycle = cycles(plan, cost, refresh_interval, margin)
    k = cycle.refresh_interval
    precondition = linear_preconditioning_flops(units.every_linear(factor_dimensions(workload)), workload.layers_per_stage) \
        / (device.flops_per_second * device.efficiency)
    extra = first_order["exposed_data_seconds"] + precondition
    timed = [simulate(step, cost) for step in cycle.plans]
    synchronous = simulate(units.synchronous_plan(plan), cost).makespan
    bubble = statistics.mean(timeline.bubble_fraction for timeline in timed)
    return {"first_order": first_order, "cost": cost, "needed": needed or cycle, "fits_bubbles": needed is not None,
            "cycle": cycle,
            "step_seconds": statistics.mean(timeline.makespan for timeline in timed) + extra,
            "no_bubbles_seconds": (synchronous + (k - 1) * first_order["compute_seconds"]) / k + extra,
            "preconditioning_seconds": precondition, "bubble_with_kfac": bubble,
            "bubble_with_kfac_needed": bubble if needed is None or needed is cycle else mean_bubble(needed.plans, cost)}


def cycles(plan, cost, refresh_interval: int, margin: float) -> tuple:
    """(the cycle the packing needs, or None if some unit fits no bubble; the cycle that runs: k
    forced by `refresh_interval`, its leftover units on the critical path, else the same)."""
    try:
        needed = units.pack(plan, cost, margin=margin)
    except ValueError:
        if not refresh_interval:
            raise
        needed = None
    if needed is not None and needed.refresh_interval == (refresh_interval or needed.refresh_interval):
        return needed, needed
    return needed, units.pack(plan, cost, refresh_interval, margin)


def mean_bubble(plans, cost) -> float:
    """Idle share of the simulated steps of a cycle, averaged over its steps."""
    return statistics.mean(simulate(step, cost).bubble_fraction for step in plans)


# ----- memory

def factor_dimensions(workload: Workload) -> dict:
    """(A's, B's) side of each block Linear's factors on one rank, by curvature.py's part letter:
    a 1-D grid of T splits a column-parallel Linear's outputs (B: out/T) and a row-parallel one's
    inputs (A: in/T) (kfac.py `split_factor`); the other factor stays whole."""
    layout = workload.layout
    if layout.tensor_grid not in (None, "1d"):
        raise ValueError(f"PipeFisher keeps K-FAC factors per 1-D shard; a {layout.tensor_grid} grid is refused")
    ranks = workload.tensor_ranks
    shapes = units.linear_shapes(block_shape(workload))
    column_parallel = ("q", "i")  # qkv and fc_in (q, k, v; gate, up) split their outputs; proj and fc_out their inputs
    return {part: tuple((fan_in, fan_out // ranks) if part in column_parallel else (fan_in // ranks, fan_out)
                        for fan_in, fan_out in pairs) for part, pairs in shapes.items()}


def kfac_memory(workload: Workload, plan, pipeline_rank: int, cycle: units.Cycle, working: float) -> dict:
    """Bytes strategies/kfac.py adds to a rank at `pipeline_rank`'s peak (module docstring); `working`:
    the backward's working set `memory` counts on top of the stash (`working_set`)."""
    row = [action for action in plan.ranks[pipeline_rank] if action is not None]
    blocks = len({action.stage for action in row if action.kind == FORWARD}) * workload.layers_per_stage
    inverse_bytes = {factor: stage_factor_elements(workload, factor) * BYTES for factor in "AB"}  # a stage's A⁻¹ or B⁻¹
    factors = blocks // workload.layers_per_stage * sum(inverse_bytes.values())
    return {"factors": factors, "inverses": factors,
            **at_stash_peak(workload, cycle, pipeline_rank, inverse_bytes, working)}


def working_set(workload: Workload, plan, pipeline_rank: int, activations: float, flash: bool) -> float:
    """What `memory`'s activations hold beyond the stash: live only while a backward runs."""
    row = [action for action in plan.ranks[pipeline_rank] if action is not None]
    tokens = workload.micro_batch_rows * workload.shape.length
    return activations - in_flight(row) * workload.layers_per_stage * block_saved_bytes(workload, tokens, flash)


def at_stash_peak(workload: Workload, cycle: units.Cycle, pipeline_rank: int, inverse_bytes: dict,
                  working: float) -> dict:
    """The most K-FAC's passing bytes add to the rank's peak over the cycle's steps, while its stash
    is full: in a bubble after the forward that fills it (the backward's working set not yet live:
    "less_working_set") or as the next backward starts. Passing: captures whose unit has not run
    (from the cycle's second step: in the capturing step a is the stash itself and no g exists
    before the first backward), inverses built and not yet promoted (`fresh`, until the cycle's
    last step ends) and an inversion's float64 workspace while it runs."""
    dimensions = factor_dimensions(workload)
    pieces = [action for step in cycle.plans for action in step.ranks[pipeline_rank]
              if action is not None and units.is_curvature(action.kind)]
    done, inverted = set(), set()
    worst = {"captures": 0, "fresh_inverses": 0, "inversion_workspace": 0, "less_working_set": 0}
    for step, plan in enumerate(cycle.plans):
        row = [action for action in plan.ranks[pipeline_rank] if action is not None]
        peak, alive = in_flight(row), 0
        for action in row:
            backward_at_peak = action.kind == BACKWARD and alive == peak
            alive += (action.kind == FORWARD) - (action.kind == BACKWARD)
            done.add(action)
            if action.kind in (units.INVERT_A, units.INVERT_B):
                inverted.add(action)
            if alive == peak or backward_at_peak:
                now = {"captures": pending_captures(workload, pieces, done, dimensions) if step else 0,
                       "fresh_inverses": sum(inverse_bytes[units.UNITS[unit.kind][0]] for unit in inverted),
                       "inversion_workspace": inversion_workspace(action, dimensions),
                       "less_working_set": 0 if backward_at_peak else -working}
                worst = max(worst, now, key=lambda parts: sum(parts.values()))
    return worst


def pending_captures(workload: Workload, pieces: list, done: set, dimensions: dict) -> float:
    """Bytes of the a (factor A) or g (factor B) kfac.py keeps for every curvature unit with a piece
    (a token half) still to run: the capture is dropped by its last piece."""
    pending = {(units.UNITS[piece.kind], piece.stage, piece.micro_batch) for piece in pieces if piece not in done}
    tokens = workload.micro_batch_rows * workload.shape.length
    # a part's linears read one input (A: one capture, shared), each has its own output gradient (B)
    return sum(tokens * (dimensions[part][0][0] if factor == "A" else sum(b for _, b in dimensions[part]))
               for (factor, part), _, _ in pending) * workload.layers_per_stage * workload.activation_bytes


def inversion_workspace(action, dimensions: dict) -> float:
    """kfac.damped_inverse's float64 temporaries for the largest factor an inversion unit inverts."""
    if action.kind not in (units.INVERT_A, units.INVERT_B):
        return 0
    largest = max(pair[action.kind == units.INVERT_B] for pair in units.every_linear(dimensions))
    return CHOLESKY_TEMPORARIES * largest * largest * FLOAT64
