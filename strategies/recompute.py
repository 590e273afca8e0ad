"""Activation recomputation (`strategy.activation_recompute`): what a block keeps for its backward.

`full` runs every block's forward under torch.utils.checkpoint (non-reentrant, RNG state
preserved): the forward saves nothing inside the block, and the backward recomputes the block from
its input with the same dropout masks before differentiating it, so gradients are those of the
plain model. Compute rises from F + 2F to F + 3F per block (docs/strategies/modular_pipeline.md: 8 instead of 6
FLOP/param/token); a block's working activations are held for one block at a time.

`selective` (Korthikanti et al. 2022 §5; Megatron-LM's `--recompute-granularity selective`) does the
same to the core attention only (models.CoreAttention: Q·Kᵀ, softmax, scores·V, no weights): the
rest of the block keeps its activations; the core keeps only its inputs q, k, v, which the
projections around it save anyway. What it no longer keeps: with the math kernel the s × s
probabilities per head (and, in a model with attention dropout, its mask and output); with a
fused (flash) kernel only the log-sum-exp (the output is the projection's saved input). The
backward reruns the core's forward, `attention_share` of a block's forward.

A recomputed forward reruns with its own micro-batch's context. Some inputs of a block are not its
arguments but a context the strategy sets on the model before each micro-batch's forward: the packed
documents and positions (`LanguageModel.set_documents`: RoPE, the core attention's masks), the MoE
loss share (`set_loss_scale`), and under context parallelism the attention's key side
(strategies/context_parallel.py `ContextParallelAttention.keys`). A pipeline runs a micro-batch's
backward after later micro-batches' forwards have set theirs, so the rerun would read another
micro-batch's documents and key side. `micro_batch_context` takes those values when the forward runs
and checkpoint's `context_fn` hands the rerun a context manager (`RerunWith`) that sets them for the
rerun and puts back the current ones after it. Under context parallelism the rerun's attention
exchanges K/V again: one more forward exchange per layer and micro-batch (cost/traffic.py
`context_traffic`'s `recomputed`).

The module's `forward` is replaced on the instance rather than the module wrapped in another,
so parameter names, checkpoints and flat shards are unchanged; models/ stays plain. The recompute
reads the block's weights when the backward runs: under ZeRO those are the re-gathered ones (the
core has none).
"""

import contextlib

import torch
from torch.utils.checkpoint import checkpoint

from models import BlockDescription, CoreAttention, block_of

MODES = ("none", "selective", "full")
# Backward cost in forwards: 2, plus one recomputation under `full`; under `selective`, 2 plus
# `attention_share` (the core attention's forward), which depends on the shape (`backward_factor`).
BACKWARD_FACTORS = {"none": 2.0, "full": 3.0}


def recompute_errors(strategy_config) -> list:
    """The config error of an unknown `strategy.activation_recompute`, naming the fix."""
    mode = strategy_config.activation_recompute
    if mode in MODES:
        return []
    return [f"strategy.activation_recompute={mode!r} is unknown. Fix: strategy.activation_recompute="
            f"none (keep every block's activations), selective (rerun only the core attention) or "
            f"full (keep only each block's input)."]


def attention_share(block: BlockDescription, sequence_length: int) -> float:
    """The core attention's share of a block's forward FLOPs: per token, Q·Kᵀ and scores·V cost
    2·s·(heads·d) each = 4·s·h (h = heads·d; the causal mask not discounted, as PaLM's count in
    models.model_flops_per_token and cost/step_time.py's core_attention_seconds), the linears
    2·W (W = block.matmul_weights()): share = 4sh / (2W + 4sh). GPT (W = 12h²): s / (6h + s)."""
    attention = 4 * sequence_length * block.hidden
    return attention / (2 * block.matmul_weights() + attention)


def attention_share_of(cfg) -> float:
    """`attention_share` of the configured model's block at the configured sequence length."""
    return attention_share(block_of(cfg.model), cfg.data.sequence_length)


def backward_factor(activation_recompute: str, attention_share: float = 0.0) -> float:
    """Cost of a backward in forwards, for the simulator's flop_cost: 2 (none), 3 (full), or
    2 + the core attention's share of the forward (selective: `attention_share`)."""
    if activation_recompute == "selective":
        return BACKWARD_FACTORS["none"] + attention_share
    return BACKWARD_FACTORS[activation_recompute]


# What a strategy sets on a model's modules per micro-batch (models/transformer.py `set_documents`,
# `set_loss_scale`), and on a core attention's `context` hook (ContextParallelAttention.keys).
MODULE_CONTEXT = ("documents", "loss_scale")
HOOK_CONTEXT = ("keys",)


def micro_batch_context(module) -> list:
    """[(holder, attribute, value)] of the per-micro-batch context `module`'s forward reads now: each
    submodule's MODULE_CONTEXT attributes and its `context` hook's HOOK_CONTEXT ones (instance
    attributes only, read from vars(): a ModuleDict's `keys` is a method, not a context)."""
    taken = []
    for holder in module.modules():
        attributes = vars(holder)
        taken += [(holder, name, attributes[name]) for name in MODULE_CONTEXT if name in attributes]
        hook = attributes.get("context")
        if hook is not None and hasattr(hook, "__dict__"):
            taken += [(hook, name, vars(hook)[name]) for name in HOOK_CONTEXT if name in vars(hook)]
    return taken


class RerunWith:
    """A context manager that sets the `micro_batch_context` values `taken` at the forward for the
    rerun and afterwards puts back what the model holds then (the micro-batch whose forward ran last,
    which may still run its own). Re-entrant one use after another: a split backward's I and W may
    each rerun the forward (checkpoint enters its recompute context once per rerun)."""

    def __init__(self, taken: list):
        self.taken, self.held = taken, []

    def __enter__(self):
        self.held.append([(holder, name, getattr(holder, name)) for holder, name, _ in self.taken])
        for holder, name, value in self.taken:
            setattr(holder, name, value)

    def __exit__(self, *exception):
        for holder, name, value in self.held.pop():
            setattr(holder, name, value)


class RecomputedForward:
    """A module's own forward, run under checkpoint whenever autograd records (training); the rerun
    sees the micro-batch context its forward saw (module docstring)."""

    def __init__(self, forward, module):
        self.forward, self.module = forward, module

    def __call__(self, *arguments):
        if not torch.is_grad_enabled():  # validation: nothing would be saved anyway
            return self.forward(*arguments)
        if torch.compiler.is_compiling():  # the compiled backward recomputes from its graph's saved inputs
            return checkpoint(self.forward, *arguments, use_reentrant=False, preserve_rng_state=True)
        taken = micro_batch_context(self.module)
        return checkpoint(self.forward, *arguments, use_reentrant=False, preserve_rng_state=True,
                          context_fn=lambda: (contextlib.nullcontext(), RerunWith(taken)))


def recomputed_modules(block, activation_recompute: str) -> list:
    """The modules of `block` whose forward reruns in the backward: the block itself (full) or its
    core attention (selective)."""
    if activation_recompute == "full":
        return [block]
    cores = [module for module in block.modules() if isinstance(module, CoreAttention)]
    if not cores:
        raise ValueError(f"strategy.activation_recompute=selective: block {type(block).__name__} has no "
                         f"models.CoreAttention to rerun. Fix: strategy.activation_recompute=full or none.")
    return cores


def apply_activation_recompute(model, activation_recompute: str) -> None:
    """Under `full` or `selective`, make each of the model's blocks (those this rank holds)
    recompute its whole forward, or its core attention's, in the backward."""
    if activation_recompute == "none":
        return
    for block in model.blocks.values():
        for module in recomputed_modules(block, activation_recompute):
            if not isinstance(module.forward, RecomputedForward):  # applied once: Lightning may set up twice
                module.forward = RecomputedForward(module.forward, module)
