"""Plan mode's answers for mixtures of experts (issue 58 item 6): plan.json `experts`, and the
expert-parallel degrees the search ranges over. The prices themselves are cost/experts.py's."""

import dataclasses

from cost.experts import busiest, expert_group_on_node, local_expert_elements, local_experts, step_exchange
from cost.inputs import BYTES, Device, Workload
from models import blocks_of
from strategies.expert_parallel import expert_degrees as expert_parallel_degrees


def expert_degrees(model, data: int) -> list:
    """strategy.expert_parallel values for `data` data ranks: every e dividing both the data degree
    and the experts E (each member keeps E/e whole experts; parallel.dims.Layout); [1] for a dense model."""
    experts = model.get("experts") or 0
    return expert_parallel_degrees(experts, data) if experts else [1]


def expert_points(point, model, accepts):
    """A search point (layerwise/planning/search.py `Point`) at every degree e of `expert_degrees` for
    its data degree that `accepts` (the search's cached strategy check, asked for e > 1 only: once per
    family, grid and switches); a dense model: the point as it is."""
    for degree in expert_degrees(model, point.data_degree):
        candidate = dataclasses.replace(point, layout=dataclasses.replace(point.layout, expert=degree))
        if degree == 1 or accepts(candidate):
            yield candidate


def parameter_counts(model, vocabulary: int) -> dict:
    """The model's parameters, all and those one token uses (`active`: an MoE block's E − k routed
    experts left out), with the embedding table and the (untied) output projection and final norm."""
    blocks = blocks_of(model)
    tables = vocabulary * model.hidden * (1 if model.get("tie_embeddings") else 2) + model.hidden
    total = sum(block.parameters() for block in blocks) + tables
    idle = sum((block.experts - block.experts_per_token) * block.expert_weights() for block in blocks if block.experts)
    return {"total": total, "active": total - idle}


def experts_plan(cfg, workload: Workload, device: Device) -> dict:
    """plan.json `experts`: the shape (E, k, shared, width), the degree e and the experts a rank keeps,
    the parameters all and active (MFU counts the active ones), the load-imbalance assumption and the
    busiest rank's share it implies, the routed experts' bytes a rank holds (the largest pipeline
    rank's, before ZeRO's sharding; memory_bytes of each role has them in), and a step's all-to-all
    per rank: bytes inside and across nodes, seconds, and the members of the expert group on one node."""
    block, layout = workload.shape.block, workload.layout
    blocks = workload.layers // layout.pipeline  # a pipeline rank's blocks (every stage alike)
    micro_batches = cfg.data.global_batch_size // (layout.data * workload.micro_batch_rows)
    counts = parameter_counts(cfg.model, workload.shape.vocabulary)
    exchange = step_exchange(workload, device, micro_batches, blocks)
    return {"experts": block.experts, "experts_per_token": block.experts_per_token,
            "shared_experts": block.shared_experts, "expert_width": block.expert_width,
            "expert_parallel": layout.expert, "local_experts": local_experts(workload),
            "parameters_total": counts["total"], "parameters_active": counts["active"],
            "expert_load_imbalance_assumed": workload.expert_imbalance,
            "busiest_rank_load_over_mean": busiest(workload),
            "expert_parameter_bytes_per_rank": blocks * local_expert_elements(workload) * BYTES,
            "expert_group_members_per_node": expert_group_on_node(workload, device),
            **{f"{name}_per_step": value for name, value in exchange.items()}}
