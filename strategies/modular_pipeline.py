"""ModularPipelineStrategy: looping placement + layered gradient accumulation (Lamy-Poirier 2021).

Also runs the comparators GPipe, 1F1B and interleaved 1F1B: they differ only in the plan, which
strategies/schedule builds, validates and simulates; this file places the layers and hands each
rank's list of actions to the one executor.
"""

import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
from typing_extensions import override

from parallel.layout import Degrees
from strategies.base import OwnedStepStrategy
from strategies.schedule import (BACKWARD, FORWARD, RECV_ACTIVATION, SEND_ACTIVATION, Plan,
                                 Timeline, add_communication, add_gradient_reductions, build_plan,
                                 execute, flop_cost, parse_action, plot_timeline, simulate, validate_plan)
from strategies.stages import Peers, StageWork, keep_local_stages

FORWARD_ONLY = (FORWARD, SEND_ACTIVATION, RECV_ACTIVATION)
SCHEDULE_PLACEMENT = {"gpipe": "contiguous", "one_f_one_b": "contiguous",
                      "looped_breadth_first": "looping", "interleaved_one_f_one_b": "looping",
                      "layered": None}


def compute_plan(strategy_config, layers: int) -> Plan:
    """The schedule's compute and point-to-point transfers, before any data-parallel pass."""
    return add_communication(build_plan(
        strategy_config.schedule, pipeline_degree=strategy_config.pipeline_degree,
        stages=layers // strategy_config.layers_per_stage,
        micro_batches=strategy_config.micro_batches,
        breadth_first_micro_batches=strategy_config.breadth_first_micro_batches))


def training_plan(strategy_config, layers: int) -> Plan:
    """The validated plan of one optimizer step: compute, transfers, data-parallel reductions."""
    return validate_plan(add_gradient_reductions(compute_plan(strategy_config, layers)))


def forward_only(plan: Plan) -> Plan:
    """Validation runs the same plan without backward, gradient transfers and reductions."""
    rows = tuple(tuple(a for a in row if a is not None and a.kind in FORWARD_ONLY)
                 for row in plan.ranks)
    return Plan(rows, plan.stages, plan.micro_batches, plan.placement, plan.name + " (forward)")


class ModularPipelineStrategy(OwnedStepStrategy):
    """Pipeline × data parallelism running a plan from strategies/schedule.

    1. setup: keep this rank's stages (looping: stage c on rank c mod p), embedding with stage 0,
       head and loss with the last stage; replicas of a stage start bit-identical;
    2. each step: split the rank's batch slice into m micro-batches and execute this rank's list of
       actions (receive → compute → send; reductions start when a stage's last backward ends);
    3. the loss (on the last stage) is broadcast over the pipeline so every rank returns it;
    4. before the optimizer: wait for the data-parallel all-reduces and average.
    """

    def __init__(self, cfg, world_size: int, **kwargs):
        super().__init__(degrees(cfg, world_size),
                         process_group_backend=cfg.hardware.process_group_backend, **kwargs)
        self.cfg = cfg
        self.plan = training_plan(cfg.strategy, cfg.model.layers)
        self.validation_plan = forward_only(self.plan)
        self.work = None
        self.executed = []  # per step: this pipeline's measured records, on every rank
        self.measured_bubble_fractions = []

    # ----- placement
    @override
    def setup(self, trainer) -> None:
        pipeline_rank = self.layout.index("pipeline")
        model = self.lightning_module.model
        keep_local_stages(model, list(self.plan.stages_on(pipeline_rank)), self.plan.stages,
                          self.cfg.strategy.layers_per_stage)
        self.synchronise_replicas(model)
        peers = Peers([self.layout.group("pipeline").ranks[r] for r in self.plan.placement],
                      self.layout.group("pipeline"), self.layout.group("data"),
                      self.layout.communicator)
        self.work = StageWork(model, self.plan.stages, self.cfg.strategy.layers_per_stage,
                              self.cfg.strategy.micro_batches, peers)
        super().setup(trainer)

    # ----- the step
    @override
    def run_step(self, batch) -> torch.Tensor:
        records = self._execute(self.plan, batch, training=True)
        self._record(records)
        return self._broadcast_loss()

    @override
    def before_optimizer_step(self, optimizer) -> None:
        self.work.wait_for_reductions()

    @override
    def validation_step(self, *args, **kwargs):
        with torch.no_grad():
            self._execute(self.validation_plan, args[0], training=False)
        return self._broadcast_loss()

    def _execute(self, plan: Plan, batch, training: bool):
        actions = plan.ranks[self.layout.index("pipeline")]
        self.work.start(batch, training, actions)
        return execute(actions, self.work.handlers())

    def _broadcast_loss(self) -> torch.Tensor:
        """The loss lives on the last stage's rank; every rank must log the same value."""
        last = self.plan.placement[-1]
        loss = self.work.state.loss if self.layout.index("pipeline") == last else None
        loss = torch.zeros(()) if loss is None else loss.clone()
        group = self.layout.group("pipeline")
        self.layout.communicator.broadcast(loss, group.ranks[last], group)
        return loss

    # ----- evidence: executed order and measured bubbles
    def _record(self, records) -> None:
        mine = [(str(r.action), r.start, r.end) for r in records]
        group = self.layout.group("pipeline")
        gathered = [None] * group.size
        if group.size > 1:  # evidence, not training traffic: not counted
            dist.all_gather_object(gathered, mine, group=group.process_group)
        else:
            gathered = [mine]
        self.executed = gathered
        timeline = measured_timeline(gathered)
        self.measured_bubble_fractions.append(timeline.bubble_fraction)

    def simulated_timeline(self) -> Timeline:
        """Uniform layers, backward twice the forward: the cost model the measurement is held to."""
        return simulate(self.plan, flop_cost(1.0, 1.0, backward_factor=2.0))

    def bubble_fraction(self) -> dict:
        measured = self.measured_bubble_fractions[1:] or self.measured_bubble_fractions
        return {"simulated": self.simulated_timeline().bubble_fraction,
                "measured": statistics.median(measured) if measured else None}

    def write_evidence(self, run_directory: Path, loggers) -> list:
        """Gantt charts of the planned and the last executed step, and the executed order."""
        order = {"plan": [[str(a) for a in row if a is not None] for row in self.plan.ranks],
                 "executed_last_step": [[a for a, _, _ in row] for row in self.executed]}
        (Path(run_directory) / "schedule.json").write_text(json.dumps(order, indent=1))
        paths = [plot_timeline(self.simulated_timeline(), Path(run_directory) / "schedule_planned.png",
                               title=f"planned: {self.plan.name}", time_unit="forward units"),
                 plot_timeline(measured_timeline(self.executed), Path(run_directory) / "schedule_executed.png",
                               title=f"executed (last step): {self.plan.name}")]
        for logger in loggers:
            if hasattr(logger, "log_image"):
                logger.log_image(key="schedule", images=[str(p) for p in paths])
        return paths


def measured_timeline(gathered) -> Timeline:
    return Timeline.from_records([[(parse_action(a), s, e) for a, s, e in row] for row in gathered])


# ----- the registry interface (see strategies/__init__.py)

def degrees(cfg, world_size: int) -> Degrees:
    pipeline = cfg.strategy.pipeline_degree
    return Degrees(data=max(1, world_size // pipeline), pipeline=pipeline)


def check(cfg, world_size: int) -> list:
    strategy, errors = cfg.strategy, []
    if world_size % strategy.pipeline_degree:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        return [f"strategy.pipeline_degree={strategy.pipeline_degree} does not divide the world "
                f"size {world_size} (hardware.nodes × hardware.devices_per_node). Fix: "
                f"strategy.pipeline_degree in {divisors}, or change hardware.devices_per_node."]
    data = world_size // strategy.pipeline_degree
    if strategy.data_degree not in (None, data):
        errors.append(f"strategy.data_degree={strategy.data_degree} but world {world_size} / "
                      f"pipeline {strategy.pipeline_degree} = {data}. Fix: strategy.data_degree={data} or null.")
    if cfg.model.layers % strategy.layers_per_stage:
        errors.append(f"model.layers={cfg.model.layers} is not divisible by strategy.layers_per_stage="
                      f"{strategy.layers_per_stage}. Fix: a divisor of {cfg.model.layers}.")
    elif (cfg.model.layers // strategy.layers_per_stage) % strategy.pipeline_degree:
        unit = strategy.layers_per_stage * strategy.pipeline_degree
        lower = max(unit, cfg.model.layers // unit * unit)
        errors.append(f"model.layers={cfg.model.layers} makes {cfg.model.layers // strategy.layers_per_stage} "
                      f"stages of strategy.layers_per_stage={strategy.layers_per_stage}, not a multiple of "
                      f"strategy.pipeline_degree={strategy.pipeline_degree}. Fix: model.layers={lower} "
                      f"or {lower + unit}.")
    expected = SCHEDULE_PLACEMENT.get(strategy.schedule)
    if expected and strategy.placement != expected:
        errors.append(f"strategy.placement={strategy.placement} does not match strategy.schedule="
                      f"{strategy.schedule}, which places stages {expected}. Fix: strategy.placement={expected}.")
    if cfg.model.tie_embeddings and strategy.pipeline_degree > 1:
        errors.append("model.tie_embeddings=true puts one weight on the first and the last stage. "
                      "Fix: model.tie_embeddings=false for pipeline strategies.")
    if cfg.trainer.gradient_clip_val:
        errors.append("trainer.gradient_clip_val is not supported by pipeline strategies yet (the "
                      "norm spans ranks). Fix: trainer.gradient_clip_val=0.")
    return errors or plan_errors(cfg)


def plan_errors(cfg) -> list:
    """Build and validate the plan now, so a bad combination fails before any rank starts."""
    if cfg.model.layers % cfg.strategy.layers_per_stage:
        return []
    try:
        training_plan(cfg.strategy, cfg.model.layers)
    except ValueError as error:
        return [f"{error}"]
    return []


def build(cfg, world_size: int):
    return ModularPipelineStrategy(cfg, world_size)


def consolidate(rank_state_dicts: list, layout: dict) -> dict:
    """Stages hold disjoint parameters; data-parallel replicas hold equal copies."""
    merged = {}
    for state in rank_state_dicts:
        for name, value in state.items():
            merged.setdefault(name, value)
    return merged
