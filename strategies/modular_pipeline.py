"""ModularPipelineStrategy: looping placement + layered gradient accumulation (Lamy-Poirier 2021).

Also runs the comparators GPipe, 1F1B and interleaved 1F1B: they differ only in the plan, which
strategies/schedule builds, validates and simulates; this file places the layers and hands each
rank's list of actions to the one executor.
"""

import contextlib
import functools
import json
import statistics
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from typing_extensions import override

from parallel.dims import Layout, tensor_ranks
from parallel.timing import EventClock
from strategies.base import OwnedStepStrategy
from strategies.checks import divisors, grid_errors, nearest_multiples
from strategies.distributed_optimizer import DistributedOptimizerSeams, distributed_optimizer_errors
from strategies.expert_parallel import (ExpertParallelHooks, apply_expert_parallel, expert_errors, expert_parallel_of,
                                        install_dispatchers)
from strategies.buckets import bucket_bytes
from strategies.precision import MESSAGE_DTYPES, activation_dtype, message_dtype, reduction_dtype
from strategies.recompute import attention_share_of, backward_factor, recompute_errors
from strategies.compile import pipeline_eager_blocks
from strategies.context_layout import ContextParallelHooks, context_errors, context_of, eager_unless_context
from strategies.registry import StrategyEntry, consolidate_replicated
from strategies.schedule.generators import ZERO_BUBBLE
from strategies.schedule import (FORWARD, POST_RECV_ACTIVATION, RECV_ACTIVATION, SEND_ACTIVATION, Plan,
                                 Timeline, add_communication, add_gradient_reductions, build_plan,
                                 execute, flop_cost, parse_action, plot_timeline, send_releases, simulate,
                                 validate_plan)
from strategies.stages import BoundaryScatter, Peers, StageWork, keep_local_stages
from strategies.tensor_parallel import consolidate as consolidate_tensor_grid
from strategies.tensor_parallel import parallelize
from strategies.tensor_parallel.grids import DIMENSION, layout_arguments
from strategies.tensor_parallel.sequence import sequence_errors

# Dropping every gradient message on both ends keeps each pair's issue order matched (NCCL's rule).
FORWARD_ONLY = (FORWARD, SEND_ACTIVATION, POST_RECV_ACTIVATION, RECV_ACTIVATION)


def compute_plan(strategy_config, layers: int) -> Plan:
    """The schedule's compute and point-to-point transfers, before any data-parallel pass."""
    return _compute_plan(strategy_config.schedule, strategy_config.pipeline_degree,
                         layers // strategy_config.layers_per_stage, strategy_config.micro_batches,
                         strategy_config.breadth_first_micro_batches)


@functools.lru_cache(maxsize=8)
def _compute_plan(schedule: str, pipeline_degree: int, stages: int, micro_batches: int, breadth_first) -> Plan:
    # Cached (plans are frozen): validation and plan mode build the same plan, and at 1T scale
    # (64 ranks × 768 micro-batches) one build takes ~25 s.
    return add_communication(build_plan(schedule, pipeline_degree=pipeline_degree, stages=stages,
                                        micro_batches=micro_batches, breadth_first_micro_batches=breadth_first))


def training_plan(strategy_config, layers: int) -> Plan:
    """The validated plan of one optimizer step: compute, transfers, data-parallel reductions."""
    return ModularPipelineStrategy.complete_plan(compute_plan(strategy_config, layers))


def forward_only(plan: Plan) -> Plan:
    """Validation runs the same plan without backward, gradient transfers and reductions."""
    rows = tuple(tuple(a for a in row if a is not None and a.kind in FORWARD_ONLY)
                 for row in plan.ranks)
    return Plan(rows, plan.stages, plan.micro_batches, plan.placement, plan.name + " (forward)")


class ModularPipelineStrategy(ContextParallelHooks, DistributedOptimizerSeams, ExpertParallelHooks, OwnedStepStrategy):
    """Pipeline × data parallelism running a plan from strategies/schedule.

    1. setup: keep this rank's stages (looping: stage c on rank c mod p), embedding with stage 0,
       head and loss with the last stage; replicas of a stage start bit-identical;
    2. each step: split the rank's batch slice into m micro-batches and execute this rank's list of
       actions (receives are posted where the plan says; reductions start when a stage's last
       backward ends);
    3. the loss (on the last stage) is broadcast over the pipeline so every rank returns it;
    4. before the optimizer: wait for the data-parallel all-reduces and average.
    With `distributed_optimizer`, reduce-scatters replace the all-reduces, the optimizer steps on this
    data rank's 1/d of each bucket and the weights are all-gathered (strategies/distributed_optimizer.py).
    With `tensor_parallel` ("1d" | "2d" | "3d"), each stage's parts are cut by the tensor-parallel
    strategies' own functions over the layout's innermost axis; a stage boundary carries each grid
    position's piece of the activation to the same position of the next stage; a piece every tensor
    rank holds whole (1-D) goes as 1/t slices, all-gathered on arrival (`scatter_gather`). Messages
    travel in `message_dtype` (the compute dtype under mixed precision: StageWork).
    With `context_degree` c > 1 (strategy.context_parallel) each stage's rank is one of c holding a
    sequence's head and tail chunks: StageWork cuts every micro-batch to them (ContextCut), the
    boundaries carry [rows, s/c, h], the blocks' attention exchanges keys and values over the context
    group, and the gradient reduction (buckets, or the distributed optimizer's slices) runs over the
    d·c ranks of data_context (strategies/context_layout.py).
    Children (ZeRO-layered, PipeFisher) override only the seams: how the plans are completed, how
    stage work is made, which plan a step runs, which handlers run which kinds, and the step's context.
    """

    def __init__(self, degrees: Layout, compute: Plan, layers_per_stage: int,
                 activation_dtype: torch.dtype = torch.float32, activation_recompute: str = "none",
                 attention_share: float = 0.0,
                 bucket_mb: float = 25.0, tensor_parallel: str = None, message_dtype: torch.dtype = None,
                 scatter_gather: bool = False, distributed_optimizer: bool = False,
                 overlap_reduction: bool = True, sequence_parallel: bool = False, tensor_overlap: bool = False,
                 tensor_collective_dtype: str = "compute", reduction_dtype: torch.dtype = torch.float32,
                 context_comm: str = "ring", **kwargs):
        super().__init__(degrees, **kwargs)
        self.context_degree, self.context_comm = degrees.context, context_comm  # ContextParallelHooks
        # 1-D grid: the residual stream split along the sequence (its boundary piece [rows, s/t, h]),
        # the gathers and reduce-scatters chunked under the products (strategies/tensor_parallel/sequence.py)
        self.sequence_options = {"sequence_parallel": sequence_parallel, "tensor_overlap": tensor_overlap,
                                 "tensor_collective_dtype": tensor_collective_dtype}
        self.reduction_dtype = reduction_dtype  # what the data-parallel gradient reduction moves
        self.distributed_optimizer = distributed_optimizer  # ZeRO-1 over the data ranks (DistributedOptimizerSeams)
        self.tensor_parallel = tensor_parallel  # None, or the grid each stage is split over
        self.form = None  # the tensor-parallel form of this rank's parts (parallelize_parts)
        self.layers_per_stage = layers_per_stage
        self.activation_dtype = activation_dtype
        self.message_dtype = message_dtype or activation_dtype  # what crosses a stage boundary
        self.scatter_gather = scatter_gather  # 1/t of each message per tensor rank, gathered on arrival
        self.activation_recompute = activation_recompute  # none | selective | full (strategies/recompute.py)
        self.attention_share = attention_share  # what selective reruns, in forwards (recompute.attention_share)
        self.bucket_mb = bucket_mb  # data-parallel all-reduce buckets (strategies/buckets.py)
        self.overlap_reduction = overlap_reduction  # each bucket posted from the stage's last backward
        self.plan = self.complete_plan(compute)
        self.validation_plan = self.forward_plan(compute)
        self.work = None
        self.executed = []  # per step: this pipeline's measured records, on every rank
        self.timed_bubbles = []  # per timed step: (measured bubble fraction, whether the meter watched it)

    # ----- seams
    @staticmethod
    @functools.lru_cache(maxsize=8)  # validation and plan mode complete the same (frozen) plan
    def complete_plan(compute: Plan) -> Plan:
        """One optimizer step: compute and transfers, then the data-parallel reductions; validated."""
        return validate_plan(add_gradient_reductions(compute))

    @staticmethod
    def forward_plan(compute: Plan) -> Plan:
        """What validation runs: the forwards and their transfers."""
        return forward_only(compute)

    def make_stage_work(self, model, local_stages: list, peers: Peers) -> StageWork:
        """The handlers' owner for this rank's stages (called once, before the optimizer exists)."""
        return StageWork(model, self.plan.stages, self.layers_per_stage, self.plan.micro_batches, peers,
                         **self.stage_precision())

    def stage_precision(self) -> dict:
        """StageWork's keyword arguments: the boundary dtype and the fp16 loss scaling, plus how the
        stages keep activations and bucket their gradient all-reduces (every StageWork takes them)."""
        return {"activation_dtype": self.activation_dtype, "scale_loss": self.scale_loss,
                "activation_recompute": self.activation_recompute, "bucket_bytes": bucket_bytes(self.bucket_mb),
                "overlap_reduction": self.overlap_reduction, "gradient_buckets": not self.distributed_optimizer,
                "tensor_form": self.form, "message_dtype": self.message_dtype, "scatter": self.boundary_scatter(),
                "reduction_dtype": self.reduction_dtype, "context": self.context_cut()}

    def boundary_scatter(self):
        """The tensor group a stage boundary's messages are scattered over (Narayanan et al. 2021
        §4.1), or None: with `scatter_gather`, a grid and more than one stage. StageWork scatters only
        where a grid position's piece is the whole activation (`StageWork._scatters`: the 1-D grid)."""
        if not (self.scatter_gather and self.tensor_parallel and self.plan.pipeline_degree > 1):
            return None
        return BoundaryScatter(self.layout.group("tensor"), self.layout.index("tensor"))

    def plan_of_step(self, step: int) -> Plan:
        return self.plan

    def handlers(self) -> dict:
        """Action kind -> handler for the executor (the distributed optimizer's reduce-scatters and
        weight gathers in place of the all-reduces, when on)."""
        handlers = self.work.handlers()
        return handlers if self.sharded is None else self.sharded.handlers(handlers)

    def step_context(self, batch, step: int):
        """Entered around one training step's execution; nothing by default."""
        return contextlib.nullcontext()

    # ----- placement
    def local_stages(self) -> list:
        """The stages this rank runs (looping: stage c on pipeline rank c mod p)."""
        return list(self.plan.stages_on(self.layout.index("pipeline")))

    @override
    def layout_arguments(self) -> dict:
        """The tensor grid's group families, inside every (data, pipeline) block of ranks."""
        return layout_arguments(self.tensor_parallel, self.degrees.tensor) if self.tensor_parallel else {}

    @override
    def materialise_model(self, model) -> None:
        """Drop the other ranks' stages while they are shapes only, materialise the rest directly
        on the device (NCCL broadcasts only device tensors), part by part cut to this rank's
        tensor-grid shards if any, then make the replicas bit-identical. With strategy.expert_parallel
        only this rank's experts are built, and each MoE layer exchanges tokens over the expert group."""
        apply_expert_parallel(model, self.layout)
        keep_local_stages(model, self.local_stages(), self.plan.stages, self.layers_per_stage)
        self.parallelize_parts(model, model.part_names())
        model.materialise(self.root_device)
        self.synchronise_replicas(model, "data_context")  # context shards hold the same parameters too
        install_dispatchers(model, self.layout)
        self.install_context_parallel(model)

    def parallelize_parts(self, model, parts: list) -> None:
        """Cut `parts` (materialised one at a time) to this rank's tensor-grid shards; the form's
        replicated-gradient groups accumulate over calls. No grid: nothing to do."""
        if not self.tensor_parallel:
            return
        form = parallelize(model, self.layout, self.root_device, parts=parts, loss_over_data=False,
                           **self.sequence_options)
        if self.form is not None:
            form.gradient_groups.update(self.form.gradient_groups)
        self.form = form

    @override
    def setup(self, trainer) -> None:
        model = self.lightning_module.model  # this rank's stages only, on its device (materialise_model)
        pipeline = self.layout.group("pipeline")
        # gradients are reduced over the ranks holding the same parameters: data replicas × context shards
        # split experts (strategy.expert_parallel) over the ranks holding the same ones
        experts = self.layout.group("expert_data") if self.layout.degrees.expert > 1 else None
        peers = Peers([pipeline.ranks[r] for r in self.plan.placement], pipeline,
                      self.layout.group("data_context"), self.layout.communicator, experts)
        self.work = self.make_stage_work(model, self.local_stages(), peers)
        self._connect_neighbours(pipeline)
        super().setup(trainer)  # Lightning's setup: the optimizer sees what make_stage_work left

    def _connect_neighbours(self, pipeline) -> None:
        """Make each pair of neighbouring ranks' first contact now, in one order every rank shares.

        NCCL creates a pair's communicator lazily, at the pair's first send or receive, with a
        handshake that blocks both ranks: with three or more ranks, first contacts made in
        different orders can deadlock even when every pair's messages match. Here each pair
        exchanges one element in the order of the sorted pairs: the earliest pair not yet done
        always has both of its ranks waiting on it, so the sequence cannot stall.

        The same order is safe on an eagerly initialised group (Lightning passes `device_id` on
        GPUs), where no pair communicator is made and the group's one communicator runs each rank's
        sends and receives toward all its peers in issue order: every rank issues its exchanges in
        the sorted pairs' order and waits for each, so the ranks retire them one pair at a time and
        no cycle of ranks waits for the next (docs/architecture.md, "Point-to-point order", rule 2).
        """
        ranks = [pipeline.ranks[r] for r in self.plan.placement]
        pairs = sorted({tuple(sorted(pair)) for pair in zip(ranks, ranks[1:]) if pair[0] != pair[1]})
        token = torch.zeros(1, device=self.root_device)
        for low, high in pairs:
            if self.global_rank == low:
                self.layout.communicator.send(token, high, pipeline).wait()
            elif self.global_rank == high:
                self.layout.communicator.receive(token, low, pipeline).wait()
        self.layout.communicator.reset()  # set-up traffic is not a training step's

    # ----- the step
    @override
    def run_step(self, batch) -> torch.Tensor:
        step = self.lightning_module.global_step
        with self.step_context(batch, step):
            records = self._execute(self.plan_of_step(step), batch, training=True)
        self._record(records)
        return self._broadcast_loss()

    @override
    def before_optimizer_step(self, optimizer) -> None:
        self.work.wait_for_reductions()
        if self.sharded is not None:
            self.sharded.wait_for_reductions()

    @override
    def validation_step(self, *args, **kwargs):
        with torch.no_grad(), self.precision_plugin.val_step_context():
            self._execute(self.validation_plan, args[0], training=False)
        return self._broadcast_loss()

    def _execute(self, plan: Plan, batch, training: bool):
        rank = self.layout.index("pipeline")
        actions = plan.ranks[rank]
        self.work.start(batch, training, send_releases(plan)[rank])  # each send freed once proven received
        recorder = self.layout.communicator.recorder  # the flight record names each operation's action
        on_action = None if recorder is None else recorder.note_action
        if not (training and self.measuring):
            return execute(actions, self.handlers(), on_action=on_action)
        # every timed step feeds the measured bubble, with the memory meter on or off: on CUDA the
        # host only launches kernels and NCCL's wait() does not block it, so the device's events
        # time the actions (a host clock would time the launches)
        clock = EventClock(self.root_device)
        return clock.resolve(execute(actions, self.handlers(), clock=clock, on_action=on_action))

    def _broadcast_loss(self) -> torch.Tensor:
        """The loss lives on the last stage's rank; every rank must log the same value."""
        last = self.plan.placement[-1]
        loss = self.work.state.loss if self.layout.index("pipeline") == last else None
        loss = torch.zeros((), device=self.root_device) if loss is None else loss.clone()
        group = self.layout.group("pipeline")
        self.layout.communicator.broadcast(loss, group.ranks[last], group)
        return loss

    # ----- evidence: executed order and measured bubbles
    def _record(self, records) -> None:
        """On timed steps only (`measuring`): gather every pipeline rank's records for the measured
        bubble and the executed Gantt chart. all_gather_object pickles and runs two collectives."""
        if not self.measuring:
            return
        mine = [(str(r.action), r.start, r.end) for r in records]
        group = self.layout.group("pipeline")
        gathered = [None] * group.size
        if group.size > 1:  # evidence, not training traffic: not counted
            dist.all_gather_object(gathered, mine, group=group.process_group)
        else:
            gathered = [mine]
        self.executed = gathered
        timeline = measured_timeline(gathered)
        self.timed_bubbles.append((timeline.bubble_fraction, self.metered))

    def simulated_timeline(self) -> Timeline:
        """Uniform layers, backward twice the forward (three times with full activation recomputation,
        2 + the core attention's share with selective): the cost model the measurement is held to."""
        return simulate(self.plan, flop_cost(1.0, 1.0, backward_factor=backward_factor(self.activation_recompute,
                                                                                 self.attention_share)))

    @override
    def bubble_fraction(self) -> dict:
        return {"simulated": self.simulated_timeline().bubble_fraction,
                "measured": reported_bubble(self.timed_bubbles)}

    @override
    def write_evidence(self, run_directory: Path, charts: bool = True) -> list:
        """Gantt charts of the planned and the last executed step, and the executed order."""
        order = {"plan": [[str(a) for a in row if a is not None] for row in self.plan.ranks],
                 "executed_last_step": [[a for a, _, _ in row] for row in self.executed],
                 # seconds from the step's start: what plan mode's per-action prediction is checked against
                 "executed_last_step_seconds": [[(a, s - row[0][1], e - row[0][1]) for a, s, e in row]
                                                for row in self.executed if row]}
        (Path(run_directory) / "schedule.json").write_text(json.dumps(order, indent=1))
        if not charts:
            return []
        # One row per pipeline rank: a tensor grid's collectives run inside each F and B bar.
        grid = f" × {self.tensor_parallel} grid of {self.degrees.tensor} (collectives inside F, B)" \
            if self.tensor_parallel else ""
        paths = [plot_timeline(self.simulated_timeline(), Path(run_directory) / "schedule_planned.png",
                               title=f"planned: {self.plan.name}{grid}", time_unit="forward units"),
                 plot_timeline(measured_timeline(self.executed), Path(run_directory) / "schedule_executed.png",
                               title=f"executed (last step): {self.plan.name}{grid}")]
        return paths


def reported_bubble(timed: list) -> float | None:
    """The measured bubble a run reports, from (bubble fraction, metered) per timed step in order:
    the median over the steps after the first (lazy set-up, first contacts) that the memory meter
    left alone; where it watched them all, over all of those; one step: its own. On a GPU a metered
    step's device waits for the meter's slowed launches between actions (docs/evidence.md)."""
    later = timed[1:] or timed
    chosen = [bubble for bubble, metered in later if not metered] or [bubble for bubble, _ in later]
    return statistics.median(chosen) if chosen else None


def measured_timeline(gathered) -> Timeline:
    return Timeline.from_records([[(parse_action(a), s, e) for a, s, e in row] for row in gathered])


# ----- the registry interface (see strategies/__init__.py)

def tensor_parallel(strategy_config):
    """The grid each stage is split over ("1d" | "2d" | "3d"), or None."""
    mode = strategy_config.tensor_parallel
    return None if mode == "none" else mode


def tensor_degree(strategy_config) -> int:
    """Ranks of one tensor block: q, q² or q³ (1 without a grid)."""
    mode = tensor_parallel(strategy_config)
    return tensor_ranks(mode, strategy_config.tensor_grid) if mode in DIMENSION else 1


def degrees(cfg, world_size: int, zero: bool = False) -> Layout:
    """Pipeline × context (strategy.context_parallel) × the stage's tensor grid (none: one rank) ×
    data, the rest of the world."""
    mode, pipeline = tensor_parallel(cfg.strategy), cfg.strategy.pipeline_degree
    context = max(1, context_of(cfg.strategy)[0])
    layout = Layout(pipeline=pipeline, tensor_grid=mode if mode in DIMENSION else None,  # unknown: check refuses it
                    edge=cfg.strategy.tensor_grid, zero=zero, context=context)
    data = max(1, world_size // (pipeline * context * layout.tensor))
    expert = expert_parallel_of(cfg.strategy)
    return replace(layout, data=data, expert=expert if data % expert == 0 else 1)


def check(cfg, world_size: int) -> list:
    strategy, errors = cfg.strategy, []
    mode = tensor_parallel(strategy)
    if mode is not None and (mode not in DIMENSION or strategy.tensor_grid < 1):
        return [f"strategy.tensor_parallel={mode}, strategy.tensor_grid={strategy.tensor_grid}: need one of "
                f"none, 1d, 2d, 3d and q >= 1. Fix: strategy.tensor_parallel=1d strategy.tensor_grid=2."]
    tensor = tensor_degree(strategy)
    split = strategy.pipeline_degree * tensor
    if world_size % split:
        grid = f" × {tensor} tensor ranks (strategy.tensor_parallel={mode}) = {split}" if mode else ""
        return [f"strategy.pipeline_degree={strategy.pipeline_degree}{grid} does not divide the world size "
                f"{world_size} (hardware.nodes × hardware.devices_per_node); world = data × pipeline × tensor. "
                f"Fix: strategy.pipeline_degree in {[d for d in divisors(world_size) if world_size % (d * tensor) == 0]}"
                f", or hardware.devices_per_node={split} or {2 * split}."]
    errors += context_errors(cfg, world_size, split, refused=context_refusals(strategy, mode), tensor=tensor)
    if errors:
        return errors
    context = context_of(strategy)[0]
    data = world_size // (split * context)
    if strategy.data_degree not in (None, data):
        by_context = f" × context {context}" if context > 1 else ""
        errors.append(f"strategy.data_degree={strategy.data_degree} but world {world_size} / (pipeline "
                      f"{strategy.pipeline_degree} × tensor {tensor_degree(strategy)}{by_context}) = {data}. Fix: "
                      f"strategy.data_degree={data} or null.")
    if mode is not None:
        errors += grid_errors(cfg, mode, strategy.tensor_grid, batch_splits=data * strategy.micro_batches,
                              splitter=f"each of the {strategy.micro_batches} micro-batches of each of the "
                                       f"{data} data-parallel ranks")
    if cfg.model.layers % strategy.layers_per_stage:
        errors.append(f"model.layers={cfg.model.layers} is not divisible by strategy.layers_per_stage="
                      f"{strategy.layers_per_stage}. Fix: a divisor of {cfg.model.layers}.")
    elif (cfg.model.layers // strategy.layers_per_stage) % strategy.pipeline_degree:
        unit = strategy.layers_per_stage * strategy.pipeline_degree
        errors.append(f"model.layers={cfg.model.layers} makes {cfg.model.layers // strategy.layers_per_stage} "
                      f"stages of strategy.layers_per_stage={strategy.layers_per_stage}, not a multiple of "
                      f"strategy.pipeline_degree={strategy.pipeline_degree}. Fix: model.layers="
                      f"{nearest_multiples(cfg.model.layers, unit)}.")
    errors += message_errors(cfg) + sequence_errors(cfg, mode, tensor)
    if cfg.model.tie_embeddings and strategy.pipeline_degree > 1:
        errors.append("model.tie_embeddings=true puts one weight on the first and the last stage. "
                      "Fix: model.tie_embeddings=false for pipeline strategies.")
    # selective passes: the core attention has no weights, so only I reruns it (tests/test_selective_recompute.py)
    if strategy.schedule in ZERO_BUBBLE and getattr(strategy, "activation_recompute", "none") == "full":
        errors.append(f"strategy.schedule={strategy.schedule} keeps each micro-batch's graph from I to W, which "
                      f"activation recomputation (strategy.activation_recompute={strategy.activation_recompute}) "
                      f"would rerun twice. Fix: strategy.activation_recompute=none or selective, or "
                      f"strategy.schedule=one_f_one_b.")
    errors += distributed_optimizer_errors(cfg)
    if "expert_parallel" in strategy:
        errors += expert_errors(cfg, data, expert_refusals(strategy, mode))
    return errors or schedule_errors(cfg)


def expert_refusals(strategy_config, mode) -> dict:
    """{why: fix} of the pipeline combinations with strategy.expert_parallel > 1 that are not built."""
    refused = {}
    if mode is not None:
        refused[f"with strategy.tensor_parallel={mode}: the grids cut the blocks' linears, not the experts' "
                f"stacked weights, and the token exchange would run per grid position (not built)"] = \
            "strategy.tensor_parallel=none"
    return refused


def context_refusals(strategy_config, mode) -> dict:
    """{why: fix} of the pipeline combinations with strategy.context_parallel > 1 that are not built."""
    refused = {}
    if mode in ("2d", "3d"):
        refused[f"with strategy.tensor_parallel={mode}: the 2-D/3-D grids split each block's activations over "
                f"rows of the grid, and the key/value exchange would have to run inside their SUMMA/3-D attention "
                f"(not built)"] = "strategy.tensor_parallel=1d or none"
    if strategy_config.schedule in ZERO_BUBBLE:
        refused[f"with strategy.schedule={strategy_config.schedule}: the split backward runs the attention's "
                f"input gradient (I) apart from the weights' (W); that the key/value gradients returned around the "
                f"context group stay in step under I/W has no equality test yet"] = "strategy.schedule=one_f_one_b"
    return refused


def message_errors(cfg) -> list:
    """strategy.message_dtype and strategy.reduction_dtype name dtype choices. (Scattered 1-D messages
    split into t equal slices of a [rows, length, hidden] tensor: grid_errors already asks
    model.hidden to be a multiple of t.)"""
    errors = []
    reduction = cfg.strategy.get("reduction_dtype", "fp32")
    if reduction not in MESSAGE_DTYPES:
        errors.append(f"strategy.reduction_dtype={reduction}: need one of {', '.join(MESSAGE_DTYPES)}. Fix: "
                      f"strategy.reduction_dtype=fp32 (the fp32 gradients reduced as they are) or compute "
                      f"(bf16/fp16 on the wire under mixed precision).")
    if cfg.strategy.message_dtype in MESSAGE_DTYPES:
        return errors
    return errors + [f"strategy.message_dtype={cfg.strategy.message_dtype}: need one of {', '.join(MESSAGE_DTYPES)}. "
            f"Fix: strategy.message_dtype=compute (bf16/fp16 messages under mixed precision) or fp32."]


def check_recomputing(cfg, world_size: int) -> list:
    """The pipeline's checks and strategy.activation_recompute's (pipefisher's schema has no such knob)."""
    return recompute_errors(cfg.strategy) + check(cfg, world_size)


def schedule_errors(cfg) -> list:
    """Build and validate the schedule (the per-rank action lists) now, so a bad combination fails before any rank starts."""
    if cfg.model.layers % cfg.strategy.layers_per_stage:
        return []
    try:
        training_plan(cfg.strategy, cfg.model.layers)
    except ValueError as error:
        return [f"{error}"]
    return []


def build(cfg, world_size: int):
    return ModularPipelineStrategy(degrees(cfg, world_size), compute_plan(cfg.strategy, cfg.model.layers),
                                   cfg.strategy.layers_per_stage, **pipeline_arguments(cfg),
                                   activation_recompute=cfg.strategy.activation_recompute,
                                   attention_share=attention_share_of(cfg),
                                   bucket_mb=cfg.strategy.bucket_mb, overlap_reduction=cfg.strategy.overlap_reduction,
                                   distributed_optimizer=cfg.strategy.distributed_optimizer)


def pipeline_arguments(cfg) -> dict:
    """The keyword arguments every pipeline strategy's constructor takes: the hardware group's, the
    tensor grid each stage is split over, and how stage-boundary messages travel."""
    return {"activation_dtype": activation_dtype(cfg.hardware.precision),
            "message_dtype": message_dtype(cfg.hardware.precision, cfg.strategy.message_dtype),
            "scatter_gather": cfg.strategy.scatter_gather,
            "sequence_parallel": cfg.strategy.sequence_parallel, "tensor_overlap": cfg.strategy.tensor_overlap,
            "tensor_collective_dtype": cfg.strategy.tensor_collective_dtype,
            "reduction_dtype": reduction_dtype(cfg.hardware.precision, cfg.strategy.get("reduction_dtype", "fp32")),
            "process_group_backend": cfg.hardware.process_group_backend,
            "tensor_parallel": tensor_parallel(cfg.strategy),
            "context_comm": context_of(cfg.strategy)[1]}


def consolidate(rank_state_dicts: list, layout: dict) -> dict:
    """Stages are disjoint across pipeline ranks; context shards and data replicas hold copies; with a
    tensor grid, each pipeline rank's block of tensor ranks (data replica 0, context shard 0: ranks
    T·C·p … T·C·p + T − 1, parallel/layout.py's rank order) is merged into whole tensors first."""
    tensor, context = layout.get("tensor", 1), layout.get("context", 1)
    if tensor == 1:
        return consolidate_replicated(rank_state_dicts, layout)
    merged = {}
    for pipeline_rank in range(layout["pipeline"]):
        first = tensor * context * pipeline_rank
        block = rank_state_dicts[first:first + tensor]
        merged.update(consolidate_tensor_grid(block, layout))
    return merged


PIPELINE = StrategyEntry(check=check_recomputing, degrees=degrees, build=build, consolidate=consolidate,
                         planned_as="pipeline", eager_blocks=eager_unless_context(pipeline_eager_blocks))
