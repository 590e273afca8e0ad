"""The declared contract between the run (layerwise/) and the techniques (strategies/).

Before any process starts the run needs, per `strategy.name`, a `StrategyEntry`: its checks, its
degrees and whether it runs as one process. In each rank it needs `build`; offline (tests, export)
it needs `consolidate`. After `build`, the run talks to the strategy only through Lightning's
interface and the `RunHooks` methods (strategies/hooks.py), never by probing attributes.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from parallel.dims import Layout
from strategies.compile import NOT_DECLARED, always_eager


def consolidate_replicated(rank_state_dicts: list, layout: dict) -> dict:
    """Ranks hold disjoint parts (pipeline stages) or equal copies (data replicas): the union."""
    merged = {}
    for state in rank_state_dicts:
        for name, value in state.items():
            merged.setdefault(name, value)
    return merged


@dataclass(frozen=True)
class StrategyEntry:
    """One technique as the run sees it.

    check(cfg, world_size) -> config errors, each naming the field and the fix (before launch);
    degrees(cfg, world_size) -> the parallel degrees the layout will build;
    build(cfg, world_size) -> the Lightning strategy, given narrow arguments read from cfg here;
    consolidate(rank_state_dicts, layout) -> the plain model's state dict from per-rank checkpoints.
    """

    check: Callable[..., list]
    degrees: Callable[..., Layout]
    build: Callable[..., object]
    consolidate: Callable[[list, dict], dict] = consolidate_replicated
    one_process: bool = False  # runs as one process whatever hardware.devices_per_node says
    # Lightning's optimizer step runs (and so clips at trainer.gradient_clip_val); false for every
    # strategy that overrides optimizer_step, which bypasses Lightning's clipping.
    clips_gradients: bool = False
    # fp16 (16-mixed) needs its loss scaled and its gradients unscaled; false where the technique
    # cannot: L2L's host store updates before a step-wide inf check exists, K-FAC's factor B would
    # be built from scaled output gradients.
    scales_fp16_loss: bool = True
    # How plan mode (layerwise/planning/) prices it: "pipeline" (the plan `fit` runs), "tensor_grid"
    # and "whole_model" (the one-stage pipeline each equals: its grid, or none), "relay" (L2L's, in
    # closed form), "pipefisher" (the pipeline plus K-FAC packed into its bubbles); None: not priced.
    planned_as: str = None
    # trainer.compile=true (strategies/compile.py): eager_blocks(cfg) -> why this strategy's blocks run
    # eager under this config, or None when each block compiles (the embedding, head and the
    # strategy's own schedule, hooks and collectives always run eager: regional compilation).
    eager_blocks: Callable = always_eager(NOT_DECLARED)


# strategy.name -> (module, entry attribute). Modules import lazily: `--help` and config checks of
# one strategy do not import every technique.
REGISTRY = {
    "single": ("strategies.plain", "SINGLE"),
    "ddp": ("strategies.plain", "DDP"),
    "l2l": ("strategies.l2l", "L2L"),
    "modular_pipeline": ("strategies.modular_pipeline", "PIPELINE"),
    "gpipe": ("strategies.modular_pipeline", "PIPELINE"),
    "one_f_one_b": ("strategies.modular_pipeline", "PIPELINE"),
    "interleaved_1f1b": ("strategies.modular_pipeline", "PIPELINE"),
    "zero_layered": ("strategies.zero_layered", "ZERO_LAYERED"),
    "zero_depth_first": ("strategies.zero_layered", "ZERO_LAYERED"),
    "fsdp2": ("strategies.fsdp2", "FSDP2"),
    "kfac": ("strategies.kfac", "KFAC_ORACLE"),
    "pipefisher": ("strategies.pipefisher", "PIPEFISHER"),
    "three_d": ("strategies.three_d", "TENSOR_PARALLEL"),
    "tp_1d": ("strategies.three_d", "TENSOR_PARALLEL"),
    "tp_2d": ("strategies.three_d", "TENSOR_PARALLEL"),
}


PLANNED_AS = ("pipeline", "tensor_grid", "whole_model", "relay", "pipefisher")


def strategy_entry(name: str) -> StrategyEntry:
    """The entry of `strategy.name`; KeyError naming the known strategies otherwise."""
    if name not in REGISTRY:
        raise KeyError(f"unknown strategy {name!r}; known: {', '.join(sorted(REGISTRY))}")
    module, attribute = REGISTRY[name]
    return getattr(importlib.import_module(module), attribute)


def planned_as(name: str):
    """How plan mode prices strategy `name` (StrategyEntry.planned_as), None for an unknown name."""
    return strategy_entry(name).planned_as if name in REGISTRY else None


def strategies_planned_as(*ways) -> tuple:
    """The strategy names plan mode prices in any of `ways`, in the registry's order."""
    return tuple(name for name in REGISTRY if planned_as(name) in ways)
