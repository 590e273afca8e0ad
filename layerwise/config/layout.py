"""A config's layout: the one constructor of parallel.dims.Layout from a config.

Training (the summary's `layout`, each strategy's process groups), validation, planning (the
cost model's Workload) and the tools all read a run's degrees here; each strategy's
StrategyEntry.degrees (strategies/registry.py) knows how its own fields split the world.
"""

from parallel.dims import Layout
from strategies import strategy_entry


def layout_of(cfg, world_size: int) -> Layout:
    """The layout `cfg` runs on `world_size` ranks: data × pipeline × tensor grid, and ZeRO."""
    return strategy_entry(cfg.strategy.name).degrees(cfg, world_size)
