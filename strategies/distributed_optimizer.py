"""The distributed optimizer (`strategy.distributed_optimizer=true`): ZeRO stage 1 inside the pipeline.

Rajbhandari et al. 2020 §5.1 (P_os), as Megatron-LM's `--use-distributed-optimizer` runs it
(megatron/core/distributed/param_and_grad_buffer.py, megatron/core/optimizer/distrib_optimizer.py).
Every data replica keeps its stages' whole weights for compute; the optimizer state and the update
are split over the d data ranks:

1. setup: each local stage's parameters (in backward order, as the all-reduce buckets of
   strategies/buckets.py take them) are grouped into buckets of at most `strategy.bucket_mb`; a
   bucket's weights and gradients move into two flat buffers, zero-padded to a multiple of d, whose
   views the parameters and their `.grad` become (DDP's gradient_as_bucket_view);
2. the optimizer Lightning built over the model's parameters is re-pointed at this rank's shards: the
   slice [r·S, (r+1)·S) of each bucket, cut at parameter boundaries into one optimizer parameter per
   (parameter, rank) — a view of the flat weight buffer, in its parameter's group (weight decay) —
   so its state (AdamW's two moments) exists for 1/d of the elements only;
3. each step: the gradient buffers are zeroed and the backward accumulates into them; at
   REDUCE_GRADIENT(c) the tensor grid's replicated gradients are summed (as before), then one
   asynchronous reduce-scatter per bucket sums the replicas' gradients into this rank's slice, in
   place (the slice is where NCCL's in-place reduce-scatter writes); before the optimizer they are
   waited for and divided by d;
4. the optimizer steps on the shards (the fp16 scaler unscales and checks them: one inf on any rank
   skips everywhere, strategies/precision.py), then one asynchronous in-place all-gather per bucket
   brings every replica's updated slice into the flat weight buffer; each stage's gathers are waited
   for before its first forward of the next step (validation and checkpoints wait for all first).

With strategy.expert_parallel=e the split experts (strategies/expert_parallel.py) are buckets of their
own, sliced over expert_data (the d/e ranks holding the same experts): reduce-scattered, divided by d
and all-gathered there.

Bytes: a reduce-scatter plus an all-gather of a bucket are, per rank, (d−1)/d·N each: together the
2(d−1)/d·N of the all-reduce they replace (parallel/comm.py), N the bucket padded to a multiple of d.
Optimizer state per rank: 1/d of the replicated optimizer's (docs/strategies/distributed_optimizer.md).
"""

import torch
from torch import nn

from strategies.buckets import on_wire, parameter_buckets
from strategies.expert_parallel import expert_parameter_ids
from strategies.schedule import FORWARD, REDUCE_GRADIENT
from strategies.stages import stage_parameter_names


class Bucket:
    """One bucket's flat weights and gradients (padded to d·S elements) and this rank's slice of them.

    The parameters' `.data` and `.grad` are views of `weights` and `gradients`; `pieces` are the
    optimizer's parameters: (name, parameter, piece) with piece = weights[a:b], the part of the
    parameter that falls in this rank's slice, and `.grad` = gradients[a:b] once reduced."""

    def __init__(self, named_parameters: list, rank: int, size: int, group=None):
        self.group = group  # where it is reduce-scattered and gathered (None: the optimizer's data group)
        self.names = [name for name, _ in named_parameters]
        self.parameters = [parameter for _, parameter in named_parameters]
        first = self.parameters[0]
        elements = sum(parameter.numel() for parameter in self.parameters)
        self.shard_size = -(-elements // size)  # ceil: equal slices, NCCL's reduce-scatter needs them
        self.rank, self.size = rank, size
        padded = self.shard_size * size
        self.weights = torch.zeros(padded, dtype=first.dtype, device=first.device)  # the padding stays zero
        self.gradients = torch.zeros(padded, dtype=first.dtype, device=first.device)
        self.offsets, offset = [], 0
        with torch.no_grad():
            for parameter in self.parameters:
                view = self.weights[offset:offset + parameter.numel()].view_as(parameter)
                view.copy_(parameter)
                parameter.data = view  # the module computes with the flat buffer's view
                self.offsets.append(offset)
                offset += parameter.numel()
        self.pieces = self._cut_pieces()
        self.attach_gradients()

    @property
    def shard(self) -> slice:
        return slice(self.rank * self.shard_size, (self.rank + 1) * self.shard_size)

    def _cut_pieces(self) -> list:
        """(name, model parameter, piece, begin, end): the parameter's flat elements [begin, end) are
        this rank's, held by `piece`, an nn.Parameter viewing the flat weights (no copy)."""
        start, end, pieces = self.shard.start, self.shard.stop, []
        for name, parameter, offset in zip(self.names, self.parameters, self.offsets):
            first, last = max(start, offset), min(end, offset + parameter.numel())
            if first < last:
                piece = nn.Parameter(self.weights[first:last], requires_grad=parameter.requires_grad)
                pieces.append((name, parameter, piece, first - offset, last - offset))
        return pieces

    def attach_gradients(self) -> None:
        """Zero the flat gradients; each `.grad` a view of them, where autograd accumulates in place."""
        self.gradients.zero_()
        for parameter, offset in zip(self.parameters, self.offsets):
            parameter.grad = self.gradients[offset:offset + parameter.numel()].view_as(parameter)

    def post_reduce_scatter(self, communicator, group, wire: torch.dtype = torch.float32):
        """Sum the replicas' gradients into this rank's slice, in place (NCCL: output = input + r·S);
        with a narrower `wire` (strategy.reduction_dtype=compute) of a bf16/fp16 copy of the buffer."""
        self.moved = on_wire(self.gradients, wire, group)
        return communicator.reduce_scatter(self.moved[self.shard], self.moved, group, async_op=True)

    def settle_gradients(self, replicas: int) -> None:
        """The reduced slice (cast back into the fp32 buffer) averaged; each piece's `.grad` its part
        of it (the step zeroed them)."""
        moved, self.moved = getattr(self, "moved", None), None
        if moved is not None and moved is not self.gradients:
            self.gradients[self.shard].copy_(moved[self.shard])
        self.gradients[self.shard].div_(replicas)
        for _, _, piece, _, _ in self.pieces:
            offset = piece.storage_offset() - self.weights.storage_offset()
            piece.grad = self.gradients[offset:offset + piece.numel()]

    def post_gather(self, communicator, group):
        """Every replica's updated slice into the flat weights, in place (NCCL: input = output + r·S)."""
        return communicator.all_gather(self.weights, self.weights[self.shard], group, async_op=True)

    def state_bytes(self, optimizer) -> int:
        return sum(value.numel() * value.element_size() for _, _, piece, _, _ in self.pieces
                   for value in optimizer.state.get(piece, {}).values() if isinstance(value, torch.Tensor))


class DistributedOptimizer:
    """The sharded optimizer state of one rank's stages over its data group (module docstring).

    `handlers(handlers)` gives the executor's table with REDUCE_GRADIENT posting reduce-scatters and
    each stage's first FORWARD waiting for its gathers; `zero_gradients`, `wait_for_reductions`,
    `post_gathers` and `settle` are called by the strategy around the step."""

    def __init__(self, work, local_stages: list, capacity_bytes: int, communicator, group, rank: int,
                 wire: torch.dtype = torch.float32, experts=None):
        self.work, self.communicator, self.group = work, communicator, group
        self.wire = wire  # the dtype the reduce-scatters move (strategy.reduction_dtype)
        model = work.model
        # A tied weight is one parameter under two names (and, with one pipeline rank, in the first
        # and the last stage: the check refuses ties across ranks): it is sharded once, under the
        # model's name for it, in the lowest stage, whose REDUCE_GRADIENT follows every backward.
        named = {id(parameter): name for name, parameter in model.named_parameters()}
        # split experts (experts = (rank, size, group) of expert_data): buckets of their own, sliced there
        split = expert_parameter_ids(model) if experts is not None else set()
        self.buckets, seen = {}, set()  # stage -> [Bucket], in backward order
        for stage in sorted(local_stages):
            names = stage_parameter_names(model, stage, work.stages, work.layers_per_stage)[::-1]
            parameters = [p for p in {id(p): p for p in map(model.get_parameter, names)}.values() if id(p) not in seen]
            seen.update(map(id, parameters))
            self.buckets[stage] = [Bucket([(named[id(p)], p) for p in bucket],
                                          *(experts if id(bucket[0]) in split else (rank, group.size)))
                                   for bucket in parameter_buckets(parameters, capacity_bytes,
                                                                   apart=lambda p: id(p) in split)]
        self.reductions = []  # (bucket, work) posted this step
        self.gathers = {}  # stage -> [work] posted after the last step, waited before its first forward

    def all_buckets(self) -> list:
        return [bucket for buckets in self.buckets.values() for bucket in buckets]

    # ----- the optimizer over the shards
    def adopt(self, optimizer) -> None:
        """Re-point the optimizer Lightning built over the model's parameters at their shards: each
        piece in its parameter's group (weight decay, learning rate), before any state exists."""
        if optimizer.state:
            raise RuntimeError("strategy.distributed_optimizer: the optimizer already holds state for whole "
                               "parameters; it must be re-pointed at the shards before its first step")
        pieces = {id(parameter): [] for bucket in self.all_buckets() for parameter in bucket.parameters}
        for bucket in self.all_buckets():
            for _, parameter, piece, _, _ in bucket.pieces:
                pieces[id(parameter)].append(piece)
        for group in optimizer.param_groups:
            unknown = [p for p in group["params"] if id(p) not in pieces]
            if unknown:
                raise RuntimeError(f"strategy.distributed_optimizer: {len(unknown)} optimizer parameters are "
                                   f"not in this rank's stages; the optimizer must be built over them only")
            group["params"] = [piece for p in group["params"] for piece in pieces[id(p)]]

    def pieces(self) -> dict:
        """{id(optimizer parameter): (name in the model, model parameter, begin, end)}: which flat
        elements of which parameter each optimizer parameter holds (for the portable checkpoint)."""
        return {id(piece): (name, parameter, begin, end) for bucket in self.all_buckets()
                for name, parameter, piece, begin, end in bucket.pieces}

    def state_bytes(self, optimizer) -> int:
        """Bytes of optimizer state this rank holds (its shards' moments and counters)."""
        return sum(bucket.state_bytes(optimizer) for bucket in self.all_buckets())

    # ----- the step
    def handlers(self, handlers: dict) -> dict:
        forward = handlers[FORWARD]

        def forward_after_gather(action):
            self._wait_gathers(action.stage)
            return forward(action)
        return {**handlers, FORWARD: forward_after_gather, REDUCE_GRADIENT: self.reduce_gradient}

    def zero_gradients(self) -> None:
        """Before a step's backward: the flat gradients zeroed, the `.grad` views attached."""
        for bucket in self.all_buckets():
            bucket.attach_gradients()

    def reduce_gradient(self, action) -> None:
        """REDUCE_GRADIENT(c): the grid's replicated gradients summed, then c's reduce-scatters posted."""
        self.work.sum_replicated_gradients(action.stage)
        for bucket in self.buckets[action.stage]:
            self.reductions.append((bucket, bucket.post_reduce_scatter(self.communicator, bucket.group or self.group,
                                                                       self.wire)))

    def wait_for_reductions(self) -> None:
        """Before the optimizer: the reduce-scatters summed; average, and hand each shard its gradient.
        Any gather of the last step still in flight (a stage that ran no forward) is waited for
        first: the step writes the slices it would overwrite."""
        self.settle()
        for bucket, work in self.reductions:
            if work is not None:
                work.wait()
            bucket.settle_gradients(self.group.size)
        self.reductions.clear()

    def post_gathers(self) -> None:
        """After the optimizer step: each bucket's updated slice all-gathered, waited for at its stage's next forward."""
        for stage, buckets in self.buckets.items():
            self.gathers[stage] = [bucket.post_gather(self.communicator, bucket.group or self.group) for bucket in buckets]

    def _wait_gathers(self, stage: int) -> None:
        for work in self.gathers.pop(stage, ()):
            if work is not None:
                work.wait()

    def settle(self) -> None:
        """Wait for every gather still in flight: before anything else reads the weights."""
        for stage in list(self.gathers):
            self._wait_gathers(stage)


class DistributedOptimizerSeams:
    """Mixin of ModularPipelineStrategy: where the distributed optimizer enters Lightning's step.

    The subclass sets `distributed_optimizer` (the switch), `work`, `bucket_mb` and `layout`, and
    routes its executor table and its wait before the optimizer through `self.sharded` when set.
    1. setup_optimizers: after Lightning built the optimizer over this rank's stages, shard it;
    2. training_step: the flat gradients zeroed before the schedule's backward;
    3. optimizer_step: after the step (or the fp16 scaler's skip), the updated slices all-gathered;
    4. before the weights are read otherwise (validation, checkpoint, the end): the gathers waited for.
    """

    distributed_optimizer = False
    sharded = None  # a DistributedOptimizer once the optimizer exists

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        if not self.distributed_optimizer:
            return
        from strategies.buckets import bucket_bytes
        from strategies.context_layout import replica_index
        # sliced over the ranks holding the same parameters: data replicas × context shards (data alone without CP)
        experts = None
        if self.layout.degrees.expert > 1:  # split experts: sliced over the ranks holding the same ones
            group = self.layout.group("expert_data")
            experts = (self.layout.index("expert_data"), group.size, group)
        self.sharded = DistributedOptimizer(self.work, self.local_stages(), bucket_bytes(self.bucket_mb),
                                            self.layout.communicator, self.layout.group("data_context"),
                                            replica_index(self.layout),
                                            getattr(self, "reduction_dtype", torch.float32), experts)
        for optimizer in self.optimizers:
            self.sharded.adopt(optimizer)

    def training_step(self, *args, **kwargs):
        if self.sharded is not None:
            self.sharded.zero_gradients()
        return super().training_step(*args, **kwargs)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        result = super().optimizer_step(optimizer, closure, model=model, **kwargs)
        if self.sharded is not None:
            self.sharded.post_gathers()
        return result

    def lightning_module_state_dict(self) -> dict:
        self.settle_weights()
        return super().lightning_module_state_dict()

    def on_validation_start(self) -> None:
        self.settle_weights()
        super().on_validation_start()

    def on_train_end(self) -> None:
        self.settle_weights()
        super().on_train_end()

    def settle_weights(self) -> None:
        if self.sharded is not None:
            self.sharded.settle()

    def optimizer_pieces(self) -> dict:
        """For the portable checkpoint: which elements of which model parameter each optimizer
        parameter holds ({} when the optimizer holds whole parameters)."""
        return {} if self.sharded is None else self.sharded.pieces()


def distributed_optimizer_errors(cfg) -> list:
    """What `strategy.distributed_optimizer=true` cannot compose with; each error names the field and the fix."""
    if not cfg.strategy.get("distributed_optimizer", False):
        return []
    errors = []
    if cfg.optimizer.name == "lamb":
        errors.append("strategy.distributed_optimizer=true: optimizer.name=lamb scales each tensor by its own "
                      "trust ratio, which a data rank's shard does not hold whole. Fix: optimizer=adamw or "
                      "optimizer=sgd, or strategy.distributed_optimizer=false.")
    return errors


# Strategies whose schema has no `distributed_optimizer`, and why it does not compose with them.
NOT_COMPOSED = {
    "zero_layered": "already shards weights, gradients and optimizer state over the data ranks (ZeRO-3)",
    "zero_depth_first": "already shards weights, gradients and optimizer state over the data ranks (ZeRO-3)",
    "fsdp2": "already shards weights, gradients and optimizer state over the data ranks (FSDP2)",
    "pipefisher": "preconditions each layer's whole gradient with its K-FAC factors before the optimizer, "
                  "which a data rank's flat shard does not hold",
    "kfac": "preconditions each layer's whole gradient with its K-FAC factors before the optimizer",
}


def not_composed(strategy_name: str) -> str:
    """Why `strategy.distributed_optimizer` is not a setting of `strategy_name`, and the fix."""
    reason = NOT_COMPOSED.get(strategy_name, "has no data-parallel optimizer to shard")
    return (f"strategy={strategy_name} {reason}, so it has no distributed_optimizer setting. Fix: remove "
            f"strategy.distributed_optimizer, or use it with strategy=modular_pipeline (or gpipe, "
            f"one_f_one_b, interleaved_1f1b).")
