"""PipeFisherStrategy: K-FAC's curvature, factor sync and inversion run in the pipeline's bubbles.

Osawa et al., MLSys 2023 (docs/strategies/pipefisher.md). The pipeline is ModularPipelineStrategy's (GPipe,
1F1B, looped breadth-first or a zero-bubble schedule: K-FAC then fills what bubble is left); strategies/schedule/curvature.py packs the K-FAC work units into the
bubbles of k consecutive steps; strategies/kfac.py does the math. Numerically it equals the
one-process `kfac` strategy with the same refresh interval k, damping and outer optimizer.
"""

import contextlib
import statistics
from pathlib import Path

from typing_extensions import override

from strategies import modular_pipeline
from strategies.kfac import (KFAC, KFACInCheckpoint, block_linears, kfac_errors, local_trace,
                            split_factor, unit_scales)
from strategies.modular_pipeline import ModularPipelineStrategy
from strategies.schedule import FORWARD, plot_timeline, simulate, validate_plan
from models import block_of
from strategies.schedule import curvature as units
from strategies.compile import KFAC_HOOKS, always_eager
from strategies.registry import StrategyEntry
from strategies.stages import stage_blocks


def block_shape(cfg, data_degree: int) -> units.BlockShape:
    """The shapes the FLOP cost model needs, for this run's model and micro-batch."""
    tokens = cfg.data.global_batch_size // (data_degree * cfg.strategy.micro_batches) * cfg.data.sequence_length
    return units.BlockShape(cfg.model.hidden, cfg.model.mlp_ratio, cfg.data.sequence_length, tokens,
                            cfg.strategy.layers_per_stage, units.block_linears(block_of(cfg.model)))


class PipeFisherStrategy(KFACInCheckpoint, ModularPipelineStrategy):
    """A pipeline with K-FAC work in its bubbles.

    1. step 0 runs the plan with curvature after each F/B and sync + inversion at the end (synchronous);
    2. later steps run the k plans of the packed cycle in turn: step 1 of a cycle captures a, g
       and every unit runs where the pass put it (a bubble of this or a following step);
    3. before the optimizer: gradients averaged, the cycle's inverses activated in its last step,
       block Linears preconditioned (B⁻¹ ∇W A⁻¹), then the outer optimizer steps.
    """

    def __init__(self, degrees, compute, layers_per_stage: int, cost, refresh_interval, bubble_margin: float,
                 damping: float, **kwargs):
        super().__init__(degrees, compute, layers_per_stage, **kwargs)
        self.cost = cost  # FLOPs of every action and K-FAC unit: what the packing pass fills bubbles with
        self.cycle = units.pack(self.plan, cost, refresh_interval, bubble_margin)
        self.first_plan = validate_plan(units.synchronous_plan(self.plan))
        self.refresh_interval = self.cycle.refresh_interval
        self.damping = damping
        self._stage_linears = {}

    @override
    def setup(self, trainer) -> None:
        super().setup(trainer)
        model = self.lightning_module.model
        self.kfac = KFAC(block_linears(model), self.damping, whole_trace=self._whole_trace)
        self.restore_kfac()
        for stage in self.plan.stages_on(self.layout.index("pipeline")):
            self._stage_linears[stage] = [name for block in stage_blocks(stage, self.layers_per_stage)
                                          for paths in units.LINEAR_PARTS.values() for path in paths
                                          if (name := f"blocks.{block}.{path}") in self.kfac.linears]

    def _whole_trace(self, name: str, factor: str, matrix) -> tuple:
        """(trace, dim) of the whole factor: over a 1-D grid, the split factor's block traces are
        summed over the tensor group, so every shard damps with the whole layer's π (kfac.py)."""
        tensor = self.layout.group("tensor")
        if factor != split_factor(name)[0] or tensor.size == 1:
            return local_trace(name, factor, matrix)
        trace = matrix.trace().reshape(1)
        self.layout.communicator.all_reduce(trace, tensor)
        return trace[0].double(), matrix.shape[0] * tensor.size

    def _names(self, stage: int, part: str = None) -> list:
        suffix = None if part is None else units.LINEAR_PARTS[part]
        return [name for name in self._stage_linears[stage] if suffix is None or name.endswith(suffix)]

    # ----- the step: the pipeline's, with these seams
    @override
    def plan_of_step(self, step: int):
        """Step 0 (and a K-FAC rebuild after a portable resume) is synchronous; later steps run the
        packed cycle's k plans in turn."""
        return self.first_plan if step in (0, self.rebuild_step) else self.cycle.plans[(step - 1) % self.refresh_interval]

    @override
    @contextlib.contextmanager
    def step_context(self, batch, step: int):
        """Capture a and g only in a cycle's first step (refresh_phase), with this step's token scales."""
        capture, _ = self.curvature_phase(step)
        tokens = batch["tokens"].numel()
        self.scales = unit_scales(tokens, tokens * self.degrees.data)
        if capture:
            self.kfac.reset([name for names in self._stage_linears.values() for name in names])
        self.kfac.capturing = capture
        try:
            yield
        finally:
            self.kfac.capturing = False

    @override
    def handlers(self) -> dict:
        handlers = {**self.work.handlers(), FORWARD: self._forward}
        handlers.update({kind: self._curvature for kind in units.UNITS if units.is_curvature(kind)})
        handlers.update({units.SYNC_A: self._sync, units.SYNC_B: self._sync,
                         units.INVERT_A: self._invert, units.INVERT_B: self._invert})
        return handlers

    def _forward(self, action) -> None:
        self.kfac.micro_batch = action.micro_batch  # the capture hooks key a and g by micro-batch
        self.work.forward(action)

    def _curvature(self, action) -> None:
        factor, part = units.UNITS[action.kind]
        self.kfac.accumulate(factor, self._names(action.stage, part), action.micro_batch, self.scales[factor],
                             half=units.TOKEN_HALF.get(action.kind))  # None: the whole unit

    def _sync(self, action) -> None:
        """Sum the stage's factors over its data-parallel replicas (each holds its own tokens' share)."""
        factor, _ = units.UNITS[action.kind]
        if self.degrees.data == 1:
            return
        for name in self._names(action.stage):
            self.layout.communicator.all_reduce(self.kfac.factors[name][factor], self.layout.group("data"))

    def _invert(self, action) -> None:
        factor, _ = units.UNITS[action.kind]
        self.kfac.invert(factor, self._names(action.stage))

    @override
    def before_optimizer_step(self, optimizer) -> None:
        super().before_optimizer_step(optimizer)  # gradients averaged over data-parallel replicas
        _, promote = self.curvature_phase(self.lightning_module.global_step)
        if promote:
            self.kfac.promote()
        self.kfac.precondition()

    # ----- evidence
    @override
    def compute_resident_tensors(self) -> list:
        """Also K-FAC's factors, inverses (in use and fresh) and the captures a later step's units
        still read: they live on the compute side between steps (the memory meter's floor)."""
        kept = [matrix for state in (self.kfac.factors, self.kfac.inverses, self.kfac.fresh)
                for pair in state.values() for matrix in pair.values()]
        return super().compute_resident_tensors() + kept + list(self.kfac.captured.values())

    def cycle_timeline(self):
        return units.cycle_timeline(self.cycle.plans, self.cost)

    @override
    def simulated_timeline(self):
        return simulate(self.plan, self.cost)

    @override
    def bubble_fraction(self) -> dict:
        with_kfac = statistics.mean(simulate(plan, self.cost).bubble_fraction for plan in self.cycle.plans)
        return {**super().bubble_fraction(), "simulated_with_kfac": with_kfac, **self.cycle.report()}

    @override
    def write_evidence(self, run_directory: Path, charts: bool = True) -> list:
        paths = super().write_evidence(run_directory, charts)
        if charts:
            paths.append(plot_timeline(self.cycle_timeline(), Path(run_directory) / "schedule_kfac.png",
                                       title=f"PipeFisher: K-FAC units in the bubbles of a {self.refresh_interval}-step "
                                       "cycle", time_unit="FLOP"))
        return paths


# ----- the registry interface (see strategies/__init__.py)

def check(cfg, world_size: int) -> list:
    errors = kfac_errors(cfg.strategy)
    if not 0 <= cfg.strategy.bubble_margin < 1:
        errors.append(f"strategy.bubble_margin={cfg.strategy.bubble_margin} must be in [0, 1). "
                      f"Fix: strategy.bubble_margin=0.05 (the paper's 5%).")
    if cfg.strategy.tensor_parallel not in ("none", "1d"):
        errors.append(f"strategy.tensor_parallel={cfg.strategy.tensor_parallel}: pipefisher keeps K-FAC factors "
                      f"per 1-D shard (a shard's rows or columns); 2-D/3-D grids also split a linear's tokens, "
                      f"whose factors are not built yet. Fix: strategy.tensor_parallel=1d or none.")
    if cfg.strategy.schedule == "interleaved_one_f_one_b":
        errors.append(f"strategy.schedule={cfg.strategy.schedule} is not supported by pipefisher. Fix: gpipe, "
                      f"one_f_one_b, looped_breadth_first, zero_bubble_h1, zero_bubble_h2 or zbv.")
    return errors or modular_pipeline.check(cfg, world_size) or packing_errors(cfg, world_size)


def packing_errors(cfg, world_size: int) -> list:
    """refresh_interval=null: every unit must fit some bubble (the k the packing needs); a zero-bubble
    schedule's gaps can all be smaller than a unit. Packed as `build` packs (FLOPs alone)."""
    if cfg.strategy.refresh_interval is not None:
        return []
    degrees = modular_pipeline.degrees(cfg, world_size)
    cost = units.pipefisher_cost(block_shape(cfg, degrees.data), flops_per_second=1.0)
    try:
        units.pack(modular_pipeline.training_plan(cfg.strategy, cfg.model.layers), cost,
                   margin=cfg.strategy.bubble_margin)
    except ValueError as error:
        return [f"strategy.refresh_interval=null packs every K-FAC unit into the bubbles of the steps it needs, "
                f"but the {error}: strategy.schedule={cfg.strategy.schedule} leaves gaps smaller than some unit. "
                f"Fix: strategy.refresh_interval=<k> (what does not fit in k steps runs on the critical path; "
                f"summary.json's bubble_fraction.spilled_work says how much), or strategy.schedule=one_f_one_b."]
    return []


def build(cfg, world_size: int):
    degrees = modular_pipeline.degrees(cfg, world_size)
    cost = units.pipefisher_cost(block_shape(cfg, degrees.data), flops_per_second=1.0)
    return PipeFisherStrategy(degrees, modular_pipeline.compute_plan(cfg.strategy, cfg.model.layers),
                              cfg.strategy.layers_per_stage, cost, cfg.strategy.refresh_interval,
                              cfg.strategy.bubble_margin, cfg.strategy.damping,
                              **modular_pipeline.pipeline_arguments(cfg), bucket_mb=cfg.strategy.bucket_mb,
                              overlap_reduction=cfg.strategy.overlap_reduction)


PIPEFISHER = StrategyEntry(check=check, degrees=modular_pipeline.degrees, build=build,
                           consolidate=modular_pipeline.consolidate, scales_fp16_loss=False,
                           planned_as="pipefisher", eager_blocks=always_eager(KFAC_HOOKS))
