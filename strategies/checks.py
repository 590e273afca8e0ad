"""Rules several strategies' config checks share: one helper each, so a rule and its message
are written once. Strategies call these from their `check`; layerwise/validate.py calls the rest.
"""

from strategies.registry import REGISTRY, strategy_entry


def divisors(number: int) -> list:
    """Every positive divisor of `number`, ascending: the values a "Fix:" may offer."""
    return [candidate for candidate in range(1, number + 1) if number % candidate == 0]


def nearest_multiples(value: int, step: int) -> str:
    """The multiples of `step` around `value` (the one below, if positive, and the next), as a
    "Fix:" names them: "8 or 16"."""
    below = value // step * step
    return " or ".join(str(multiple) for multiple in ([below] if below else []) + [below + step])


def fp16_errors(strategy_name: str, precision: str) -> list:
    """16-mixed only where the strategy scales the loss (StrategyEntry.scales_fp16_loss)."""
    if not precision.startswith("16") or strategy_entry(strategy_name).scales_fp16_loss:
        return []
    return [f"hardware.precision={precision}: strategy={strategy_name} cannot scale an fp16 loss. "
            f"Fix: hardware.precision=bf16-mixed (no loss scaling needed) or 32-true."]


def gradient_clipping_errors(strategy_name: str, clip_value: float) -> list:
    """Lightning clips gradients inside its own optimizer step; a strategy that overrides
    `optimizer_step` (to run a schedule, reduce shards or precondition) never reaches that code,
    so a clip value there would be ignored without a word. `StrategyEntry.clips_gradients` says
    which strategies leave the step to Lightning."""
    if not clip_value or strategy_entry(strategy_name).clips_gradients:
        return []
    clipping = [name for name in sorted(REGISTRY) if strategy_entry(name).clips_gradients]
    return [f"trainer.gradient_clip_val={clip_value}: strategy={strategy_name} runs its own "
            f"optimizer step, where Lightning's gradient clipping never happens. Fix: "
            f"trainer.gradient_clip_val=0, or a strategy that clips: {', '.join(clipping)}."]
