"""Rules several strategies' config checks share: one helper each, so a rule and its message
are written once. Strategies call these from their `check`; layerwise/config/validate.py calls the rest.
"""

from parallel.dims import tensor_ranks
from strategies.registry import REGISTRY, strategy_entry
from strategies.tensor_parallel.grids import DIMENSION, grid_of


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


def model_grid_errors(cfg, mode: str) -> list:
    """What a tensor grid of `mode` (1d | 2d | 3d) needs of the model and the optimizer, whatever its
    size and the batch (`grid_errors`; the search offers only grids these accept): an untied GPT or
    Llama, whole-tensor-free optimizers, Qwen3's q/k norms on the 1-D grid only, no experts."""
    errors = unsupported_model_errors(cfg)
    if cfg.model.get("qk_norm") and mode != "1d":
        # Qwen3's q/k norms act on whole heads; the 1-D grid keeps them whole and sums their gradients
        # over "tensor" (grids.py Grid1D); the 2-D and 3-D grids' plans have no such rule yet
        errors.append(f"model.qk_norm=true: the {mode} grid does not place Qwen3's q/k norms yet. Fix: "
                      f"strategy=tp_1d (or strategy.tensor_parallel=1d in a pipeline), or no tensor grid.")
    if cfg.model.get("experts"):
        # the plan has no style for an MoE layer: it would stay whole on every rank, its input gradient
        # summed t times by the all-reduce behind norm_mlp (Megatron's f), and, loaded from
        # model.path, never filled (only planned modules read their cut)
        errors.append(f"model.experts={cfg.model.experts}: a tensor grid does not shard mixtures of experts. "
                      f"Fix: no tensor grid (strategy.expert_parallel shards the experts under ddp, the "
                      f"pipelines and zero_layered).")
    return errors


def grid_errors(cfg, mode: str, q: int, batch_splits: int, splitter: str) -> list:
    """What a tensor grid needs of the model and the batch, wherever it runs: `batch_splits` pieces of
    the global batch (data ranks, × micro-batches in a pipeline) must each split over the grid's
    rows; hidden, heads and kv heads over its feature and head chunks; an untied GPT or Llama; whole-tensor-free
    optimizers. Each error names the field and the fix."""
    dimension, grid = DIMENSION[mode], grid_of(mode, tensor_ranks(mode, q), 0)
    batch_parts = grid.input_rows()[1]  # ranks that split a piece's sequences
    errors = model_grid_errors(cfg, mode)
    if cfg.data.global_batch_size % (batch_splits * batch_parts):
        errors.append(
            f"data.global_batch_size={cfg.data.global_batch_size}: {splitter} must get a multiple of "
            f"{batch_parts} sequences (q^{dimension - 1} for {mode} with strategy.tensor_grid={q}). Fix: "
            f"data.global_batch_size={nearest_multiples(cfg.data.global_batch_size, batch_splits * batch_parts)}.")
    if cfg.model.hidden % grid.feature_parts:
        errors.append(
            f"model.hidden={cfg.model.hidden} is not divisible by {grid.feature_parts} (the {mode} grid "
            f"with strategy.tensor_grid={q} splits weights by that). Fix: model.hidden="
            f"{nearest_multiples(cfg.model.hidden, grid.feature_parts)}.")
    if cfg.model.heads % grid.head_parts:
        errors.append(
            f"model.heads={cfg.model.heads} is not divisible by strategy.tensor_grid={q} (heads are "
            f"split over {grid.head_parts} ranks). Fix: model.heads="
            f"{nearest_multiples(cfg.model.heads, grid.head_parts)}.")
    kv_heads = cfg.model.kv_heads or cfg.model.heads
    if cfg.model.architecture == "llama" and kv_heads % grid.head_parts:
        errors.append(
            f"model.kv_heads={kv_heads} is not divisible by strategy.tensor_grid={q} (key/value heads are "
            f"split over {grid.head_parts} ranks with their query groups). Fix: model.kv_heads="
            f"{nearest_multiples(kv_heads, grid.head_parts)}, or a smaller strategy.tensor_grid.")
    return errors


def unsupported_model_errors(cfg) -> list:
    """What tensor-grid shards need: an untied GPT or Llama, and an optimizer without whole-tensor rules."""
    errors = []
    for field, value, wanted in (("model.architecture", cfg.model.architecture, ("gpt", "llama")),
                                 ("model.tie_embeddings", cfg.model.tie_embeddings, (False,))):
        if value not in wanted:
            errors.append(f"{field}={value}: {cfg.strategy.name} supports only {' or '.join(map(str, wanted))} "
                          f"so far. Fix: {field}={wanted[0]}.")
    if cfg.optimizer.name == "lamb":
        errors.append(f"optimizer.name=lamb: LAMB's per-tensor trust ratio needs whole tensors, "
                      f"{cfg.strategy.name} holds shards. Fix: optimizer=adamw or optimizer=sgd.")
    return errors
