"""ZeroLayeredStrategy: ZeRO-3 sharding + layered gradient accumulation (Lamy-Poirier 2021, docs/strategies/zero_layered.md).

The modular pipeline's engine with one more pass (strategies/schedule/zero.py): per stage and run of
its compute, an all-gather of its weights; after each backward run, a reduce-scatter of its gradient
instead of an all-reduce. Layered order has two runs per stage, so a step moves 3(n−1)/n·P bytes per
rank whatever m; `breadth_first_micro_batches=1` is depth-first ZeRO-3, 3m(n−1)/n·P (the comparator).
With `pipeline_degree > 1` it is Breadth-First Pipeline Parallelism: looping + layered + sharded.
"""

import functools
from collections import deque

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.weak import WeakIdKeyDictionary
from typing_extensions import override

from parallel.dims import Layout
from strategies import modular_pipeline
from strategies.modular_pipeline import ModularPipelineStrategy, compute_plan, forward_only
from strategies.recompute import attention_share_of
from strategies.schedule import BACKWARD, FINISH, FORWARD, validate_plan
from strategies.schedule.zero import (GATHER_BACKWARD, GATHER_FORWARD, GATHER_WEIGHT, REDUCE_SCATTER, add_weight_gathers,
                                      add_zero)
from strategies.buckets import sum_over_groups
from strategies.checks import divisors
from strategies.compile import pipeline_eager_blocks
from strategies.context_layout import eager_unless_context, replica_index
from strategies.expert_parallel import apply_expert_parallel, expert_parameters, install_dispatchers
from strategies.registry import StrategyEntry
from strategies.sharding import FlatShard, ShardContainer, unshard
from strategies.stages import Peers, StageWork, keep_local_stages, stage_parameter_names, stage_part_names


def shard_stages(model, local_stages, stages: int, layers_per_stage: int, rank: int, size: int,
                 experts=None) -> dict:
    """(stage, kind) -> FlatShard for each local stage, kind "matrices" (weight-decayed) or "vectors"
    (not), like optim.py's parameter groups; with `experts` = (this rank's index, size, group) of the
    ranks holding the same split experts (strategy.expert_parallel: expert_data), the stage's
    experts are a kind of their own, "experts", sharded over that group (matrices: decayed)."""
    shards = {}
    split = set(expert_parameters(model)) if experts is not None else set()
    for stage in local_stages:
        names = stage_parameter_names(model, stage, stages, layers_per_stage)
        is_matrix = {name: model.get_parameter(name).dim() >= 2 for name in names}
        for kind, matrix in (("matrices", True), ("vectors", False)):
            chosen = [name for name in names if is_matrix[name] == matrix and name not in split]
            if chosen:
                shards[(stage, kind)] = FlatShard(model, chosen, rank, size, matrix)
        chosen = [name for name in names if name in split]
        if chosen:
            shards[(stage, "experts")] = FlatShard(model, chosen, *experts[:2], True, group=experts[2])
    return shards


class ShardedStageWork(StageWork):
    """StageWork whose stages are gathered before each run of their compute and reduce-scattered after.

    1. GATHER_*(c): free the weights of the finished run, post the async all-gather of stage c (the
       plan puts it one run ahead: double buffering);
    2. F/B(c, i): on a new run, wait for its gather and install it (B: also a flat gradient buffer);
       saved activations refer to weights by (stage, position), so freed weights are not kept alive
       by the autograd graph and the backward uses the re-gathered ones;
    3. REDUCE_SCATTER(c): post the async reduce-scatter; it overlaps the earlier stages' backward.
    """

    def __init__(self, *arguments, shards: dict, **precision):
        super().__init__(*arguments, **precision)
        self.shards_of = {}  # stage -> its FlatShards
        for (stage, _), shard in shards.items():
            self.shards_of.setdefault(stage, []).append(shard)
        self.gathers = deque()  # (stage, kind, [(work, buffer) per shard]) in plan order
        self.installed = None  # (stage, kind) whose weights the leaves point at
        self.scatters = []  # (shard, work, piece, gradient) in flight
        # storage of an installed buffer -> (stage, shard index); keyed by the storage object, not its
        # address: fake tensors (the dry run) all have address 0, and a view shares its base's storage object
        self.buffers = WeakIdKeyDictionary()

    def handlers(self) -> dict:
        return {**super().handlers(), GATHER_FORWARD: self.gather, GATHER_BACKWARD: self.gather,
                GATHER_WEIGHT: self.gather,
                REDUCE_SCATTER: self.reduce_scatter, FINISH: self.finish}

    # ----- weights
    def gather(self, action) -> None:
        self._release()  # by the plan's construction, the installed run is over
        group, communicator = self.peers.data_group, self.peers.communicator
        posted = [shard.post_gather(communicator, shard.group or group) for shard in self.shards_of[action.stage]]
        kind = FORWARD if action.kind == GATHER_FORWARD else BACKWARD
        self.gathers.append((action.stage, kind, posted))

    def _install(self, stage: int, kind: str) -> None:
        if self.installed == (stage, kind):
            return
        self._release()
        gathered_stage, gathered_kind, posted = self.gathers.popleft()
        assert (gathered_stage, gathered_kind) == (stage, kind), "plan and gathers out of step"
        for index, (shard, (work, buffer)) in enumerate(zip(self.shards_of[stage], posted)):
            if work is not None:
                work.wait()
            shard.install(buffer)
            self.buffers[buffer.untyped_storage()] = (stage, index)
            if kind == BACKWARD:
                shard.attach_gradients()
        self.installed = (stage, kind)

    def _release(self) -> None:
        if self.installed is not None:
            for shard in self.shards_of[self.installed[0]]:
                shard.release()
            self.buffers.clear()
            self.installed = None

    def _pack(self, tensor):
        key = self.buffers.get(tensor.untyped_storage())
        if key is None:  # detached: a saved output returned whole would hold its own node, a cycle
            return tensor.detach()  # gc cannot see, kept alive where a split W leaves nodes unrun
        return key, tensor.storage_offset(), tensor.size(), tensor.stride()

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        (stage, index), offset, size, stride = packed
        return self.shards_of[stage][index].full.as_strided(size, stride, offset)

    # ----- compute
    def forward(self, action) -> None:
        self._install(action.stage, FORWARD)
        with saved_tensors_hooks(self._pack, self._unpack):
            super().forward(action)

    def backward(self, action) -> None:
        self._install(action.stage, BACKWARD)
        super().backward(action)

    def backward_input(self, action) -> None:
        self._install(action.stage, BACKWARD)  # I and W share B's run and gather (schedule/zero.py)
        super().backward_input(action)

    def backward_weight(self, action) -> None:
        self._install(action.stage, BACKWARD)
        super().backward_weight(action)

    def weights(self, stage: int) -> list:
        """The installed leaves: their .grad are views of the flat buffer kept until the stage's
        reduce-scatter (the modules' parameters are the shards' leaves, not nn.Parameters)."""
        return [leaf for shard in self.shards_of[stage] for leaf in shard.leaves]

    # ----- gradients
    def reduce_scatter(self, action) -> None:
        self._settle_scatters()  # at most one stage's full gradient in flight
        self.sum_replicated_gradients(action.stage)  # over the tensor grid first, then scattered over data
        for shard in self.shards_of[action.stage]:
            work, piece, gradient = shard.post_reduce_scatter(self.peers.communicator, shard.group or self.peers.data_group)
            self.scatters.append((shard, work, piece, gradient))

    def sum_replicated_gradients(self, stage: int) -> None:
        """As StageWork's, over the installed leaves (views of the flat gradient buffer): the
        modules' parameters were replaced by the shards', so they are found by the shards' entries."""
        if self.tensor_form is None:
            return
        groups = self.tensor_form.gradient_groups
        sum_over_groups([(leaf.grad, groups.get(entry.name, ())) for shard in self.shards_of[stage]
                         for entry, leaf in zip(shard.entries, shard.leaves)], self.peers.communicator)

    def _settle_scatters(self) -> None:
        for shard, work, piece, _ in self.scatters:
            if work is not None:
                work.wait()
            shard.accumulate(piece, self.peers.data_group.size)
        self.scatters.clear()

    def finish(self) -> None:
        super().finish()
        self._release()

    def wait_for_reductions(self) -> None:
        self._settle_scatters()


class ZeroLayeredStrategy(ModularPipelineStrategy):
    """ZeRO-3 over the data-parallel group on the modular pipeline's engine (layered or depth-first).

    1. materialise: keep this rank's stages, then one stage at a time materialise it, cut it into flat
       1/n shards (the optimizer's parameters) and drop it: never more than one full stage besides shards;
    2. each step runs the plan: gather a stage before each run of its compute (one run ahead), reduce-
       scatter its gradient after each backward run — twice + once per step under layered order;
    3. before the optimizer: wait for the reduce-scatters; the optimizer updates only the shards.
    With strategy.expert_parallel=e a rank builds only its E/e experts of each MoE block, and they are a
    flat shard of their own per stage ("experts"), cut over expert_data (the d/e ranks holding the
    same experts), gathered and reduce-scattered there and divided by d as the others.
    """

    def __init__(self, *arguments, **kwargs):
        super().__init__(*arguments, **kwargs)
        self.shards = {}

    @staticmethod
    @override
    @functools.lru_cache(maxsize=8)  # as ModularPipelineStrategy's: plans are frozen
    def complete_plan(compute):
        """Compute and transfers, then the ZeRO-3 gathers and reduce-scatters; validated."""
        return validate_plan(add_zero(compute))

    @staticmethod
    @override
    def forward_plan(compute):
        # Forward only (no B, so not a training plan the validator accepts): gathers, no scatters.
        return add_weight_gathers(forward_only(compute))

    @override
    def materialise_model(self, model) -> None:
        """Stage by stage: materialise it on the device, make the replicas bit-identical, cut this
        rank's flat shards; cutting replaces the stage's parameters, so the full stage is freed."""
        local_stages = self.local_stages()
        apply_expert_parallel(model, self.layout)  # on meta: only this rank's experts get built
        keep_local_stages(model, local_stages, self.plan.stages, self.layers_per_stage)
        # Shards over data_context (the data ranks alone without CP): a sequence's c context shards hold
        # the same parameters, so they share the sharding as torchtitan's FSDP mesh (dp_shard × cp) and
        # Megatron-core's distributed optimizer (data-parallel group with context) do; replicating the
        # d shards on each context rank would keep c copies of each and need a second reduction.
        data = self.layout.group("data_context")
        for stage in local_stages:
            parts = stage_part_names(stage, self.plan.stages, self.layers_per_stage)
            self.parallelize_parts(model, parts)  # a tensor grid's shards first; ZeRO shards those over data
            model.materialise(self.root_device, parts)
            self.convert_to_fp8(model)  # fp8-mixed: before cutting, while the linears hold Parameters
            for part in parts:
                self.synchronise_replicas(model.get_submodule(part), "data_context")
                install_dispatchers(model.get_submodule(part), self.layout)  # before its experts are cut
            self.shards.update(shard_stages(model, [stage], self.plan.stages, self.layers_per_stage,
                                            replica_index(self.layout), data.size, self.expert_sharding()))
        model.zero_shards = ShardContainer(self.shards)  # the optimizer's only parameters
        self.install_context_parallel(model)

    def expert_sharding(self):
        """(index, size, group) of expert_data, over which split experts are sharded; None at e = 1."""
        if self.layout.degrees.expert == 1:
            return None
        group = self.layout.group("expert_data")
        return self.layout.index("expert_data"), group.size, group

    @override
    def make_stage_work(self, model, local_stages: list, peers: Peers) -> ShardedStageWork:
        return ShardedStageWork(model, self.plan.stages, self.layers_per_stage, self.plan.micro_batches,
                                peers, shards=self.shards, **self.stage_precision())

    @override
    def compute_resident_tensors(self) -> list:
        """Between steps the compute side holds only shards, their gradients and optimizer state."""
        tensors = [shard.parameter for shard in self.shards.values()]
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
        return tensors


# ----- the registry interface (see strategies/__init__.py)

def check(cfg, world_size: int) -> list:
    """The pipeline's checks, plus what sharding needs; each error names the field and the fix."""
    strategy, errors = cfg.strategy, []
    if strategy.data_degree is not None and world_size % strategy.data_degree:
        return [f"strategy.data_degree={strategy.data_degree} does not divide the world size {world_size} "
                f"(hardware.nodes × hardware.devices_per_node). Fix: strategy.data_degree=null (world / "
                f"pipeline_degree) or one of {divisors(world_size)} with pipeline_degree = world / data_degree."]
    if cfg.optimizer.name == "lamb":
        errors.append("optimizer.name=lamb scales each tensor by its own trust ratio, which a flat shard "
                      "does not hold whole. Fix: optimizer=adamw or optimizer=sgd.")
    if cfg.model.tie_embeddings:
        errors.append("model.tie_embeddings=true shares one weight between the first and the last stage, "
                      "which are sharded separately. Fix: model.tie_embeddings=false.")
    return errors + modular_pipeline.check_recomputing(cfg, world_size)


def degrees(cfg, world_size: int) -> Layout:
    """The pipeline's layout, its stage parameters flat ZeRO-3 shards over the data ranks."""
    return modular_pipeline.degrees(cfg, world_size, zero=True)


def build(cfg, world_size: int):
    return ZeroLayeredStrategy(degrees(cfg, world_size),
                               compute_plan(cfg.strategy, cfg.model.layers), cfg.strategy.layers_per_stage,
                               **modular_pipeline.pipeline_arguments(cfg),
                               activation_recompute=cfg.strategy.activation_recompute,
                               attention_share=attention_share_of(cfg))


def consolidate(rank_state_dicts: list, layout: dict) -> dict:
    """The full model from per-rank shards: concatenate each flat group over the data × context ranks
    (data-major: the shards' order, `replica_index`) of every (pipeline, tensor) position, then merge
    stages and tensor-grid shards as the pipeline does."""
    data, pipeline, tensor = layout["data"], layout["pipeline"], layout.get("tensor", 1)
    context = layout.get("context", 1)
    unsharded = [unshard_over_data([rank_state_dicts[t + tensor * (k + context * (p + pipeline * d))]
                                    for d in range(data) for k in range(context)])
                 for p in range(pipeline) for t in range(tensor)]  # in rank order of data replica 0
    return modular_pipeline.consolidate(unsharded, {**layout, "context": 1})


def unshard_over_data(states: list) -> dict:
    """One (pipeline, tensor) position's state dict with its flat shards joined into parameters. A
    shard cut over fewer ranks than `states` (split experts over expert_data: e = len(states) / its
    size) is joined per expert index i from ranks i, i + e, ... (data index = i + e·j), and the e
    slices of experts concatenated in order: the plain [E, ...] tensors."""
    merged = {}
    for key, group in states[0]["model.zero_shards._extra_state"].items():
        pieces = [state[f"model.zero_shards.flat.{key}"] for state in states]
        split = len(pieces) // group["size"]
        if split > 1:
            slices = [unshard(group, pieces[index::split]) for index in range(split)]
            merged.update({f"model.{name}": torch.cat([part[name] for part in slices]) for name in slices[0]})
            continue
        merged.update({f"model.{name}": value for name, value in unshard(group, pieces).items()})
    merged.update({k: v for k, v in states[0].items() if not k.startswith("model.zero_shards.")})
    return merged


ZERO_LAYERED = StrategyEntry(check=check, degrees=degrees, build=build, consolidate=consolidate,
                             planned_as="pipeline", eager_blocks=eager_unless_context(pipeline_eager_blocks))
