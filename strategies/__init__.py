"""One Lightning Strategy per technique, and the machinery they share (schedule/, tensor_parallel/, ...).

`strategy_entry(name)` gives the typed `StrategyEntry` of a `strategy.name` (registry.py); the
optional hooks every built strategy answers are the `RunHooks` methods (hooks.py).
"""

from strategies.registry import REGISTRY, StrategyEntry, strategy_entry

__all__ = ["REGISTRY", "StrategyEntry", "strategy_entry"]
