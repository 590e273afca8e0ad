"""Expert parallelism (`strategy.expert_parallel=e`): each MoE block's experts split over e data ranks.

The `expert` group is e consecutive data ranks (parallel/layout.py); member i keeps experts
[i·E/e, (i+1)·E/e) of every MoE block and every other parameter whole. Each rank routes its own
tokens (its slice of the global batch), so a token's expert may live on another member: the
tokens travel there and back by all-to-all (GShard, Lepikhin et al. 2020 §2.2; torchtitan's
`expert_parallel_degree`, Megatron-core's `alltoall` token dispatcher):

1. dispatch: the MoE layer hands its n·k routed slots sorted by global expert and the count per
   global expert. Sorted by expert is sorted by (destination member, its local expert), so the rows
   for member j are one contiguous run. First the counts travel (an all-to-all of e·(E/e) integers:
   each member learns how many rows of each of its experts every source sends), then the rows, with
   variable splits. They arrive ordered (source member, local expert) and are permuted to (local
   expert, source member), the grouped product's order, with the count per local expert;
2. combine: the inverse permutation, then the inverse all-to-all (splits swapped): the rows come
   back in the order dispatch received them, which the layer un-sorts.
Both all-to-alls are differentiable (`_AllToAll`): the backward of an all-to-all is the all-to-all
with the splits swapped. Every member of the expert group issues them at the same MoE layer of the
same micro-batch, so the collectives' order is the same on each (NCCL, parallel/comm.py rule 3).

Gradients. A rank's expert gradient already sums the contributions of every token of its expert
group (they arrived through the all-to-all's backward), each scaled by its own rank's 1/(local
batch). Summing over the `expert_data` group (the data ranks holding the same experts, d/e of them)
and dividing by d, as every other parameter is summed over `data` and divided by d, gives the mean
over the global batch: the single-process gradient.

A rank never builds the experts it does not own: `apply_expert_parallel` runs on the meta model,
before materialisation, and leaves each MoE block with only its E/e local experts (`Experts.first`
says where they start), whose seeded values equal those experts' values in the whole model
(models/moe.py seeds each expert on its own).
"""

from __future__ import annotations

import torch
from torch import nn

from parallel.comm import Group
from strategies.checks import divisors

EXPERT_GROUP = "expert"
EXPERT_DATA_GROUP = "expert_data"


class _AllToAll(torch.autograd.Function):
    """Rows of `x` (dim 0) exchanged over `group`: `input_splits[i]` rows to member i, and
    `output_splits[i]` rows from member i. Backward: the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, communicator):
        ctx.splits, ctx.group, ctx.communicator = (output_splits, input_splits), group, communicator
        output = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        communicator.all_to_all(output, x.contiguous(), output_splits, input_splits, group)
        return output

    @staticmethod
    def backward(ctx, gradient):
        output_splits, input_splits = ctx.splits
        returned = gradient.new_empty((sum(input_splits),) + tuple(gradient.shape[1:]))
        ctx.communicator.all_to_all(returned, gradient.contiguous(), input_splits, output_splits, ctx.group)
        return returned, None, None, None, None


def all_to_all(x: torch.Tensor, output_splits: list, input_splits: list, group: Group, communicator) -> torch.Tensor:
    """The differentiable, counted all-to-all of rows (`_AllToAll`)."""
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group, communicator)


def source_to_expert_order(received_counts: torch.Tensor) -> torch.Tensor:
    """The row permutation from (source member, local expert) order to (local expert, source member)
    order: `received_counts[s, j]` rows of local expert j came from member s, blocks laid out s-major.
    Returns `index` with rows_in_expert_order = rows_in_source_order[index]."""
    sources, experts = received_counts.shape
    counts = received_counts.reshape(-1)
    starts = torch.cumsum(counts, 0) - counts  # start of block (s, j) in source order
    blocks = starts.view(sources, experts).t().reshape(-1)  # blocks visited expert-major
    lengths = received_counts.t().reshape(-1)
    if int(lengths.sum()) == 0:
        return torch.zeros(0, dtype=torch.long, device=received_counts.device)
    offsets = torch.arange(int(lengths.sum()), device=received_counts.device)
    block_starts_in_output = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    return torch.repeat_interleave(blocks, lengths) + (offsets - block_starts_in_output)


class AllToAllDispatcher:
    """An MoE layer's token exchange over the `expert` group (the module docstring's 1 and 2).

    `dispatch(x_sorted, counts)` -> (rows for this member's experts, grouped by local expert; the
    count per local expert); `combine(y_local)` -> the rows back, in x_sorted's order. One dispatch
    is followed by its combine before the next dispatch (the state between them is this pair's).
    """

    def __init__(self, group: Group, communicator, experts: int):
        if experts % group.size:
            raise ValueError(f"strategy.expert_parallel: {group.size} must divide the {experts} experts")
        self.group, self.communicator = group, communicator
        self.experts, self.local = experts, experts // group.size
        self._pending = None

    def dispatch(self, x_sorted: torch.Tensor, counts: torch.Tensor):
        from models.moe import compute_dtype
        # the rows travel in the dtype the experts compute in (bf16 under bf16-mixed), to which they
        # would cast them anyway: the same rounding, half the bytes of the fp32 residual stream
        x_sorted = x_sorted.to(compute_dtype(x_sorted))
        members, local = self.group.size, self.local
        send_counts = counts.to(torch.long).reshape(members, local).contiguous()
        received_counts = torch.empty_like(send_counts)
        # the counts first: each member learns the splits it will receive (e·(E/e) integers)
        self.communicator.all_to_all(received_counts, send_counts, [1] * members, [1] * members, self.group)
        # variable splits must be known on the host (NCCL's all_to_all takes them as integers):
        # one device-to-host copy per layer, as every all-to-all dispatcher does
        input_splits = send_counts.sum(1).tolist()
        output_splits = received_counts.sum(1).tolist()
        received = all_to_all(x_sorted, output_splits, input_splits, self.group, self.communicator)
        order = source_to_expert_order(received_counts)
        self._pending = (input_splits, output_splits, order)
        return received.index_select(0, order), received_counts.sum(0)

    def combine(self, y_local: torch.Tensor) -> torch.Tensor:
        input_splits, output_splits, order = self._pending
        self._pending = None
        in_source_order = _unpermute(y_local, order)
        return all_to_all(in_source_order, input_splits, output_splits, self.group, self.communicator)


def _unpermute(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """rows_in_source_order, with rows = rows_in_source_order[order] (differentiable)."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return rows.index_select(0, inverse)


# ----- the model's experts

def is_experts(module) -> bool:
    """Whether `module` is an MoE block's experts (models/moe.py `Experts`)."""
    from models.moe import Experts
    return isinstance(module, Experts)


def moe_layers(model: nn.Module) -> list:
    """The MoE layers of `model` (models/moe.py `MoE`: an `experts` child and a `dispatcher` slot), in order."""
    from models.moe import moe_modules
    return [module for _, module in moe_modules(model)]


def expert_parameters(model: nn.Module) -> dict:
    """{name: (parameter, its Experts module)} of every expert Parameter of `model` (held split)."""
    found = {}
    for prefix, module in model.named_modules():
        if is_experts(module):
            for name, parameter in module.named_parameters(recurse=False):
                found[f"{prefix}.{name}" if prefix else name] = (parameter, module)
    return found


def expert_parameter_ids(model: nn.Module) -> set:
    return {id(parameter) for parameter, _ in expert_parameters(model).values()}


def apply_expert_parallel(model: nn.Module, layout) -> None:
    """On the meta model, before it is materialised: this rank keeps experts [i·E/e, (i+1)·E/e) of
    every MoE block only (i = its index in the expert group), in the blocks built so far and in every
    block built later (`LanguageModel.expert_shard`, read by build_part: seeded or loaded, a rank
    builds only its experts). Nothing to do when e = 1."""
    from models.transformer import keep_local_experts
    experts = layout.degrees.expert
    if experts == 1:
        return
    shard = (layout.index("expert"), experts)
    model.expert_shard = shard
    for name in list(model.blocks):
        block = model.blocks[name]
        if all(tensor.is_meta for tensor in list(block.parameters()) + list(block.buffers())):
            keep_local_experts(block, shard)


def install_dispatchers(model: nn.Module, layout) -> int:
    """After materialisation: every MoE layer exchanges its tokens over the `expert` group (none at
    e = 1: all experts are local). Returns the number of layers."""
    layers = moe_layers(model)
    if layout.degrees.expert == 1:
        return len(layers)
    group = layout.group(EXPERT_GROUP)
    for layer in layers:
        if layer.experts.count * group.size != layer.experts.total:
            raise ValueError(f"a MoE layer holds {layer.experts.count} of {layer.experts.total} experts on a rank of "
                             f"{group.size}: apply_expert_parallel must run on the meta model first")
        layer.dispatcher = AllToAllDispatcher(group, layout.communicator, layer.experts.total)
    return len(layers)


def sum_expert_gradients(parameters: list, layout, replicas: int) -> None:
    """The expert gradients summed over `expert_data` (the ranks holding the same experts) and
    divided by `replicas` (the data degree, as every other gradient: the module docstring), in one
    flat buffer; a parameter without a gradient joins with zeros (every member joins every sum)."""
    if not parameters:
        return
    for parameter in parameters:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
    flat = torch.cat([parameter.grad.reshape(-1) for parameter in parameters])
    layout.communicator.all_reduce(flat, layout.group(EXPERT_DATA_GROUP))
    flat.div_(replicas)
    offset = 0
    for parameter in parameters:
        parameter.grad.copy_(flat[offset:offset + parameter.numel()].view_as(parameter))
        offset += parameter.numel()


def gather_experts(state: dict, model: nn.Module, layout, prefix: str = "model.") -> dict:
    """`state` (a state dict of `model` under `prefix`) with each local expert tensor replaced by
    the whole one, all-gathered over the expert group (collective: every member calls it), so a
    saved model is the plain model. Nothing to do at e = 1."""
    if layout is None or layout.degrees.expert == 1:
        return state
    group = layout.group(EXPERT_GROUP)
    for name, (parameter, module) in expert_parameters(model).items():
        key = prefix + name
        if key in state:
            local = state[key].detach().contiguous()
            whole = local.new_empty((module.total,) + tuple(local.shape[1:]))
            layout.communicator.all_gather(whole, local, group)
            state[key] = whole
    return state


def local_experts_of(state: dict, model: nn.Module, prefix: str = "model.") -> dict:
    """`state` with each whole expert tensor cut to this rank's experts [first, first + count)."""
    for name, (parameter, module) in expert_parameters(model).items():
        key = prefix + name
        if key in state and state[key].shape[0] == module.total != module.count:
            state[key] = state[key][module.first:module.first + module.count]
    return state


def expert_origin(model: nn.Module, name: str):
    """(first, total) of the Experts module holding parameter `name` of `model` (also once a flat shard
    replaced it by a plain tensor), or None when `name` is no expert."""
    path = name.rpartition(".")[0]
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    return (module.first, module.total) if is_experts(module) else None


def expert_placements(model: nn.Module) -> dict:
    """{parameter name: (plain shape, origin)}: where a rank's experts lie in the plain [E, ...] tensor."""
    return {name: ((module.total,) + tuple(parameter.shape[1:]), (module.first,) + (0,) * (parameter.dim() - 1))
            for name, (parameter, module) in expert_parameters(model).items()}


# ----- the strategy side

class ExpertParallelHooks:
    """Strategy mixin (before Lightning's strategy in the bases): the saved model is the plain model.

    `lightning_module_state_dict` (every rank calls it when a checkpoint is made) holds each expert
    tensor whole, all-gathered over the expert group, so a Lightning file or a per-rank file holds
    the plain model's experts (export, consolidate and the tests read it as they read any other);
    `load_model_state_dict` cuts them back to this rank's. The portable checkpoint (strategies/
    checkpoint/portable.py) saves each rank's experts as their block of the plain [E, ...] tensor, so
    a run resumes at any e (`resume_from`)."""

    def lightning_module_state_dict(self) -> dict:
        state = super().lightning_module_state_dict()
        return gather_experts(state, self.lightning_module.model, self.layout)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if "state_dict" in checkpoint:
            local_experts_of(checkpoint["state_dict"], self.lightning_module.model)
        return super().load_model_state_dict(checkpoint, strict=strict)


# ----- configuration (read by each strategy's registry check and degrees)

def expert_parallel_of(strategy_config) -> int:
    """strategy.expert_parallel (1 where the strategy's schema has no such field)."""
    return int(strategy_config.get("expert_parallel", 1) or 1)


def expert_degrees(experts: int, data: int) -> list:
    """Every e dividing both the `data` data-parallel ranks and the `experts` E (each member keeps E/e
    whole experts), ascending: what strategy.expert_parallel may be."""
    return [e for e in divisors(data) if experts % e == 0]


def expert_errors(cfg, data: int, refused: dict = None) -> list:
    """strategy.expert_parallel=e against the model and the layout: e ≥ 1; e > 1 needs a model with
    experts, e dividing model.experts and the `data` data-parallel ranks the experts are split over,
    no context parallelism, and none of the strategy's `refused` combinations ({why: fix})."""
    e = cfg.strategy.expert_parallel
    if e < 1:
        return [f"strategy.expert_parallel={e}: need e >= 1 (1: every rank holds every expert). "
                f"Fix: strategy.expert_parallel=1."]
    if e == 1:
        return []
    experts = cfg.model.get("experts", 0) or 0
    if not experts:
        return [f"strategy.expert_parallel={e} splits the experts of a mixture of experts, and "
                f"model={cfg.model.get('name', cfg.model.architecture)} has none (model.experts=0). "
                f"Fix: strategy.expert_parallel=1, or a model with experts (model.experts=8, model=llama_tiny)."]
    errors, fits = [], expert_degrees(experts, data)
    if data % e:
        errors.append(f"strategy.expert_parallel={e} must divide the {data} data-parallel ranks the experts are "
                      f"split over (world / (pipeline × tensor × context)). Fix: strategy.expert_parallel in "
                      f"{fits}, or more devices (hardware.devices_per_node).")
    if experts % e:
        errors.append(f"strategy.expert_parallel={e} must divide model.experts={experts} (each rank holds "
                      f"E/e experts). Fix: strategy.expert_parallel in {fits}.")
    if cfg.strategy.get("context_parallel", 1) > 1:
        errors.append(f"strategy.expert_parallel={e} with strategy.context_parallel="
                      f"{cfg.strategy.context_parallel} is refused: each context rank routes only its chunk "
                      f"of a sequence, so the experts' gradients would have to be summed over the context "
                      f"shards as well as expert_data (Megatron-core folds context into its expert-data "
                      f"group), and the per-sequence auxiliary loss would need the whole sequence's counts; "
                      f"neither is built. Fix: strategy.context_parallel=1 or strategy.expert_parallel=1.")
    for why, fix in (refused or {}).items():
        errors.append(f"strategy.expert_parallel={e} {why}. Fix: {fix}.")
    return errors
