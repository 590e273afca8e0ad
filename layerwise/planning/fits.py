"""Plan mode's pre-flight rule: a layout whose plan does not fit the device is refused before anything
runs, naming the role, its bytes and the single changes that would fit (each planned too)."""

from omegaconf import OmegaConf

from cost.memory import memory
from layerwise.planning.inputs import training_plan_of, workload_of
from layerwise.planning.pipefisher import pipefisher_rank_memory
from layerwise.planning.roles import GIB, roles
from strategies.registry import planned_as


ALTERNATIVES = (("strategy.activation_recompute", "full"), ("strategy.schedule", "one_f_one_b"))


def worst_role(cfg, world_size: int) -> tuple:
    """(label, bytes by kind, total with the allocator margin) of the rank role needing the most."""
    if planned_as(cfg.strategy.name) == "pipefisher":  # the pipeline's bytes + K-FAC's (layerwise/planning/pipefisher.py)
        per_rank = [breakdown for breakdown, _ in pipefisher_rank_memory(cfg, world_size)[0]]
    else:
        workload, schedule = workload_of(cfg, world_size), training_plan_of(cfg)
        per_rank = [memory(workload, schedule, rank, cfg.plan.flash_attention)
                    for rank in range(schedule.pipeline_degree)]
    label, _, breakdown = max(roles(per_rank), key=lambda role: sum(role[2].values()))
    return label, breakdown, sum(breakdown.values()) * (1 + cfg.plan.allocator_margin)


def planned_memory_errors(cfg, world_size: int) -> list:
    """For validate: refuse a pipeline layout whose plan does not fit hardware.device_memory_bytes,
    naming the role, its breakdown and the single changes that would fit (each planned too)."""
    if planned_as(cfg.strategy.name) not in ("pipeline", "pipefisher") or not cfg.hardware.device_memory_bytes:
        return []
    label, breakdown, total = worst_role(cfg, world_size)
    if total <= cfg.hardware.device_memory_bytes:
        return []
    parts = ", ".join(f"{kind} {value / GIB:.1f}" for kind, value in breakdown.items())
    fits = [f"{field}={value}" for field, value in ALTERNATIVES if _fits_with(cfg, world_size, field, value)]
    return [f"the plan of this layout does not fit: {label} needs {total / GIB:.1f} GiB ({parts} GiB, + "
            f"{cfg.plan.allocator_margin:.0%} allocator margin) but hardware.device_memory_bytes="
            f"{cfg.hardware.device_memory_bytes:.3g} ({cfg.hardware.device_memory_bytes / GIB:.1f} GiB). Fix: "
            + (" or ".join(fits) + " (planned to fit)" if fits else
               "more pipeline or tensor ranks, more micro-batches, or a smaller data.global_batch_size")
            + "; python train.py mode=plan ... shows every role."]


def _fits_with(cfg, world_size: int, field: str, value) -> bool:
    """Whether the layout fits with one field changed (False if that change is itself invalid)."""
    changed = OmegaConf.merge(cfg, {})  # a writable copy
    try:
        OmegaConf.update(changed, field, value)  # pipefisher has no activation_recompute: not a change
        return worst_role(changed, world_size)[2] <= cfg.hardware.device_memory_bytes
    except Exception:  # noqa: BLE001 - a change the schedule rejects simply does not fit
        return False
