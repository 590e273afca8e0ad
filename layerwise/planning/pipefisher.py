"""mode=plan for strategy=pipefisher: the pipeline's plan with K-FAC's units in its bubbles.

    python train.py mode=plan strategy=pipefisher model=bert_large hardware=dgx1_v100 hardware.nodes=2 \
        strategy.pipeline_degree=8 strategy.layers_per_stage=3 strategy.micro_batches=8 ...

The same workload, first-order plan and memory as the modular pipeline of the same schedule
(PipeFisherStrategy is one), plus cost/kfac.py: each role's K-FAC bytes under their
own kind ("kfac", detailed in `kfac_bytes`), the step of the packed k-step cycle, and that cycle's
timeline for plan.png. layerwise/reproduce/pipefisher.py prices the paper's layouts with the same code.
"""

from omegaconf import OmegaConf

from layerwise.planning.roles import _result_header, _role, roles
from layerwise.planning.inputs import device_of, training_plan_of, workload_of
from cost.memory import memory
from cost.kfac import kfac_memory, pipefisher_step, stage_factor_elements, working_set
from strategies.schedule import FORWARD
from strategies.schedule import curvature as units
from cost.traffic import all_reduce


def first_order(cfg):
    """`cfg` with the modular pipeline PipeFisherStrategy runs: the same schedule, degrees, stages,
    micro-batches and grid, no recomputation (its capture would see every forward twice)."""
    from layerwise.config.schema import PipelineStrategyConfig
    planned = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    fields = {name: value for name, value in OmegaConf.to_container(cfg.strategy, resolve=True).items()
              if name in PipelineStrategyConfig.__dataclass_fields__}
    planned.strategy = OmegaConf.merge(OmegaConf.structured(PipelineStrategyConfig),
                                       {**fields, "name": "modular_pipeline", "activation_recompute": "none"})
    return planned


def run_cycle(cfg, workload, schedule) -> units.Cycle:
    """The cycle `fit` runs: strategies/pipefisher.py packs with FLOPs alone (`build`), which may place
    units (and so hold captures) otherwise than plan mode's packing with its own costs."""
    from strategies.pipefisher import block_shape
    cost = units.pipefisher_cost(block_shape(cfg, workload.layout.data), flops_per_second=1.0)
    return units.pack(schedule, cost, cfg.strategy.refresh_interval, cfg.strategy.bubble_margin)


def pipefisher_rank_memory(cfg, world_size: int) -> tuple:
    """[(bytes by kind with "kfac" their K-FAC total, K-FAC bytes by what they are) per pipeline rank],
    with the captures held as the cycle `fit` runs places their units; and that cycle."""
    pipeline = first_order(cfg)
    workload, schedule = workload_of(pipeline, world_size), training_plan_of(pipeline)
    cycle = run_cycle(cfg, workload, schedule)
    per_rank = []
    for rank in range(schedule.pipeline_degree):
        first_order_bytes = memory(workload, schedule, rank, cfg.plan.flash_attention)
        working = working_set(workload, schedule, rank, first_order_bytes["activations"], cfg.plan.flash_attention)
        kfac = kfac_memory(workload, schedule, rank, cycle, working)
        per_rank.append(({**first_order_bytes, "kfac": sum(kfac.values())}, kfac))
    return per_rank, cycle


def pipefisher_plan_result(cfg, world_size: int) -> tuple:
    """(what plan.json holds, the packed cycle's simulated timeline in seconds)."""
    pipeline = first_order(cfg)
    workload, device, schedule = (workload_of(pipeline, world_size), device_of(cfg, world_size),
                                 training_plan_of(pipeline))
    step = pipefisher_step(workload, device, schedule, cfg.strategy.refresh_interval, cfg.strategy.bubble_margin)
    first, cycle, needed = step["first_order"], step["cycle"], step["needed"]
    per_rank, fit_cycle = pipefisher_rank_memory(cfg, world_size)
    margin = cfg.plan.allocator_margin
    merged = roles([breakdown for breakdown, _ in per_rank])
    result = {**_result_header(cfg, world_size, workload, device, step["step_seconds"]),
              "bubble_fraction": step["bubble_with_kfac"], "bubble_fraction_first_order": first["bubble_fraction"],
              "step_time_first_order_s": first["step_seconds"],
              "step_time_kfac_no_bubbles_s": step["no_bubbles_seconds"],
              "preconditioning_s": step["preconditioning_seconds"],
              "refresh_interval": cycle.refresh_interval, "refresh_interval_needed": needed.refresh_interval if step["fits_bubbles"] else None,
              "refresh_interval_fit": fit_cycle.refresh_interval,  # strategies/pipefisher.py packs by FLOPs
              "kfac_work_per_bubble": needed.ratio, "packing": cycle.report(),
              "exposed_data_s": first["exposed_data_seconds"],
              "comm_bytes_per_step_by_pipeline_rank": [{**traffic, "kfac_sync_all_reduce": sync_bytes_per_step(
                  workload, schedule, rank, cycle.refresh_interval)}
                  for rank, traffic in enumerate(first["bytes_by_rank"])],
              "roles": [{**_role(label, ranks, breakdown, margin, device), "kfac_bytes": per_rank[ranks[0]][1]}
                        for label, ranks, breakdown in merged]}
    return result, units.cycle_timeline(cycle.plans, step["cost"])


def sync_bytes_per_step(workload, schedule, pipeline_rank: int, refresh_interval: int) -> float:
    """The rank's factors all-reduced over the data group (A and B, once per cycle, strategies/pipefisher.py
    `_sync`), per step of the cycle."""
    stages = {action.stage for action in schedule.ranks[pipeline_rank] if action is not None
              and action.kind == FORWARD}
    elements = sum(stage_factor_elements(workload, factor) for factor in "AB")
    return len(stages) * all_reduce(elements, workload.layout.data) / refresh_interval
