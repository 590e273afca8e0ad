"""Rank roles: pipeline ranks with equal memory merged, each with its bytes and whether it fits, and
the header every plan.json starts with (the point, the step, tokens/s, MFU)."""

from cost.inputs import Device, Workload
from cost.step_time import model_flops_utilization
from models import blocks_of
from models.transformer import model_flops_per_token


GIB = 2 ** 30


def roles(per_rank: list, head_rank: int = None) -> list:
    """Pipeline ranks with equal memory merged into one role: (label, ranks, breakdown). The head is
    on `head_rank`, by default the last (ZBV's V placement puts it on rank 0)."""
    merged = []
    for rank, breakdown in enumerate(per_rank):
        if merged and merged[-1][2] == breakdown:
            merged[-1][1].append(rank)
        else:
            merged.append((None, [rank], breakdown))
    head = len(per_rank) - 1 if head_rank is None else head_rank
    return [(_label(ranks, head), ranks, breakdown) for _, ranks, breakdown in merged]


def _label(ranks: list, head: int) -> str:
    parts = (["embedding"] if 0 in ranks else []) + (["head"] if head in ranks else [])
    span = f"pipeline rank {ranks[0]}" if len(ranks) == 1 else f"pipeline ranks {ranks[0]}–{ranks[-1]}"
    return span + (f" ({' + '.join(parts)})" if parts else "")


def _result_header(cfg, world_size: int, workload: Workload, device: Device, step_seconds: float) -> dict:
    """What every plan.json starts with: the point, the step, tokens/s and MFU (summary.json's names
    where they mean the same thing, units in the name: docs/evidence.md)."""
    tokens = cfg.data.global_batch_size * cfg.data.sequence_length
    flops = model_flops_per_token(cfg.model.layers, cfg.model.hidden, cfg.data.sequence_length,
                                  workload.shape.vocabulary, cfg.model.mlp_ratio, workload.shape.block,
                                  blocks_of(cfg.model)) * tokens  # MoE: active weights, dense blocks apart
    return {"strategy": cfg.strategy.name, "model": cfg.model.name, "hardware": cfg.hardware.name,
            "world_size": world_size, "layout": plan_layout(workload.layout), "step_time_s": step_seconds,
            "tokens_per_s": tokens / step_seconds, "mfu": model_flops_utilization(flops, step_seconds, device.flops_per_second, world_size),
            "allocator_margin": cfg.plan.allocator_margin, "efficiency_assumed": device.efficiency}


def plan_layout(layout) -> dict:
    """plan.json `layout`: the Layout's fields, `context` and `expert` only where they split something
    (as Layout.as_dict lists them), so plans written before they existed read the same."""
    return {name: value for name, value in layout.__dict__.items() if name not in ("context", "expert") or value > 1}


def _role(label: str, ranks: list, breakdown: dict, margin: float, device: Device) -> dict:
    """One role of plan.json: its pipeline ranks, its bytes by kind (`memory_bytes`), their sum (the
    predicted `peak_compute_bytes`, summary.json's measure) and that sum with the allocator margin,
    which must fit the device."""
    peak = sum(breakdown.values())
    total = peak * (1 + margin)
    return {"role": label, "pipeline_ranks": ranks, "memory_bytes": breakdown, "peak_compute_bytes": peak,
            "peak_with_margin_bytes": total, "fits": total <= device.memory_bytes}
