"""One Lightning Strategy per technique, and the machinery they share (schedule/, ...).

`STRATEGIES` maps a config name (`strategy.name`) to the module that builds it. Every such module
has `check(cfg, world_size) -> list[str]` (config errors, each naming the field and the fix; runs
before any process starts), `degrees(cfg, world_size) -> Degrees` and `build(cfg, **runtime)`.
"""

import importlib

STRATEGIES = {
    "single": "strategies.plain",
    "ddp": "strategies.plain",
    "l2l": "strategies.l2l",
    "modular_pipeline": "strategies.modular_pipeline",
    "gpipe": "strategies.modular_pipeline",
    "one_f_one_b": "strategies.modular_pipeline",
    "interleaved_1f1b": "strategies.modular_pipeline",
    "zero_layered": "strategies.zero_layered",
    "zero_depth_first": "strategies.zero_layered",
    "fsdp2": "strategies.fsdp2",
    "kfac": "strategies.kfac",
    "pipefisher": "strategies.pipefisher",
    "three_d": "strategies.three_d",
    "tp_1d": "strategies.three_d",
    "tp_2d": "strategies.three_d",
}

# Strategies that run as one process whatever hardware.devices_per_node says: the reference and
# PipeFisher's one-process oracle, so a sweep `strategy=single,ddp` compares them directly.
ONE_PROCESS = ("single", "kfac")


def strategy_module(name: str):
    """The builder module of a strategy; KeyError with the known names otherwise."""
    if name not in STRATEGIES:
        raise KeyError(name)
    return importlib.import_module(STRATEGIES[name])
