"""Activation recomputation (`strategy.activation_recompute`): each block keeps only its input.

`full` runs every block's forward under torch.utils.checkpoint (non-reentrant, RNG state
preserved): the forward saves nothing inside the block, and the backward recomputes the block from
its input with the same dropout masks before differentiating it, so gradients are those of the
plain model. Compute rises from F + 2F to F + 3F per block (docs/strategies/modular_pipeline.md: 8 instead of 6
FLOP/param/token); a block's working activations are held for one block at a time.

The block's `forward` is replaced on the instance rather than the block wrapped in another module,
so parameter names, checkpoints and flat shards are unchanged; models/ stays plain. The recompute
reads the block's weights when the backward runs: under ZeRO those are the re-gathered ones.
"""

import torch
from torch.utils.checkpoint import checkpoint

MODES = ("none", "full")
BACKWARD_FACTORS = {"none": 2.0, "full": 3.0}  # backward cost in forwards: 2, plus one recomputation


def recompute_errors(strategy_config) -> list:
    """The config error of an unknown `strategy.activation_recompute`, naming the fix."""
    mode = strategy_config.activation_recompute
    if mode in MODES:
        return []
    return [f"strategy.activation_recompute={mode!r} is unknown. Fix: strategy.activation_recompute="
            f"none (keep every block's activations) or full (keep only each block's input)."]


def backward_factor(activation_recompute: str) -> float:
    """Cost of a backward in forwards, for the simulator's flop_cost."""
    return BACKWARD_FACTORS[activation_recompute]


class RecomputedForward:
    """A block's own forward, run under checkpoint whenever autograd records (training)."""

    def __init__(self, forward):
        self.forward = forward

    def __call__(self, *arguments):
        if not torch.is_grad_enabled():  # validation: nothing would be saved anyway
            return self.forward(*arguments)
        return checkpoint(self.forward, *arguments, use_reentrant=False, preserve_rng_state=True)


def apply_activation_recompute(model, activation_recompute: str) -> None:
    """Under `full`, make each of the model's blocks (those this rank holds) recompute in the backward."""
    if activation_recompute == "none":
        return
    for block in model.blocks.values():
        if not isinstance(block.forward, RecomputedForward):  # applied once: Lightning may set up twice
            block.forward = RecomputedForward(block.forward)
