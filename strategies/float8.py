"""`hardware.precision=fp8-mixed`: the blocks' linear layers through torchao's float8 training.

torchtitan (`torchtitan/components/quantization/float8.py`) and torchao's own recipe turn FP8 on by
swapping each `nn.Linear` of the transformer blocks for torchao's `Float8Linear`
(`torchao.float8.convert_to_float8_training`): the forward casts the input and the weight to e4m3
with a dynamic scale and multiplies them in FP8 (`torch._scaled_mm`); the backward casts the output
gradient (e5m2 under "tensorwise", e4m3 under "rowwise") the same way. Everything else is
bf16-mixed as Lightning runs it: fp32 master weights and optimizer state, autocast to bf16 around
the step, the embedding, norms, attention's softmax and the head in bf16/fp32. So:

1. Lightning sees `bf16-mixed` (it accepts only its own precision names: `lightning_precision`),
   and the strategies' own buffers follow bf16-mixed (strategies/precision.py maps fp8-mixed to
   bf16 for them); the conversion is the only difference, asked of the strategy through
   `RunHooks.enable_fp8(recipe, emulate)` and applied where it materialises its blocks
   (strategies/hooks.py `shard_lightning_module`), as compilation is.
2. `Float8Linear` is an `nn.Linear` subclass that keeps the same `weight` and `bias` Parameters
   (torchao `Float8Linear.from_float` assigns `new_mod.weight = mod.weight`) and registers no
   buffer: parameter names, optimizer state and checkpoints are unchanged, and a checkpoint moves
   between fp8-mixed and bf16-mixed runs as it is.
3. The blocks are converted twice, idempotently (only exact `nn.Linear` are swapped, never a
   `Float8Linear` again): on the meta model before the strategy materialises it (FSDP2 shards the
   meta blocks in place, and its sharded parameters must already belong to the modules that will
   run them), and after (every other strategy builds its blocks afresh, part by part).
4. Recipes (`hardware.fp8_recipe`): "tensorwise" (one scale per tensor, e5m2 gradients) and
   "rowwise" (one scale per row, e4m3 throughout, power-of-2 scales). A tensorwise scale is the
   amax of the whole tensor this process sees, so a micro-batch, a data shard or a tensor-parallel
   shard gets its own scale and rounds differently from the whole batch (TORCH.md: 0.37 in
   gradients between one batch and two micro-batches); rowwise scales each token's row by itself
   and matched to 1.4e-6. Strategies splitting the batch therefore equal `single` under rowwise;
   under tensorwise they are within the FP8 tolerance of it, not equal.
5. `emulate`: torchao's own emulation (the FP8 casts and scales exactly, the product in
   high precision), which runs on CPU: the tests' proof that FP8 composes with each strategy.

Where a strategy cannot run it, validation refuses fp8-mixed with the reason (`float8_errors`).
"""

from __future__ import annotations

import dataclasses

PRECISION = "fp8-mixed"
RECIPES = ("tensorwise", "rowwise")
INSTALL = 'pip install -e ".[fp8]"'

# Why a strategy refuses fp8-mixed (the text of its config error).
TENSOR_GRID = ("its tensor grid's column- and row-parallel linears are our own autograd functions "
               "(parallel/, strategies/tensor_parallel/), not nn.Linear, so torchao's conversion would leave them "
               "in bf16; and a tensorwise scale over a row-parallel shard is that shard's amax, not the whole "
               "weight's, unless the amaxes are all-reduced (torchtitan's Float8RowwiseParallel does so through "
               "DTensor, which our grid does not use)")
KFAC = ("K-FAC builds its curvature factors from each linear's input and output gradient and preconditions "
        "the gradient the products give; under FP8 those gradients carry e5m2/e4m3 rounding (~9% per element, "
        "TORCH.md) that the factors' inverse would amplify, and no FP8 K-FAC is published or tried here")


def lightning_precision(precision: str) -> str:
    """The precision name Lightning gets: fp8-mixed runs under Lightning's bf16-mixed."""
    return "bf16-mixed" if precision == PRECISION else precision


def torchao_available() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return True


def float8_config(recipe: str, emulate: bool):
    """torchao's Float8LinearConfig of the named recipe, emulated (CPU, tests) or not."""
    from torchao.float8 import Float8LinearConfig
    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=True) if emulate else config


def convert_blocks(model, recipe: str, emulate: bool) -> int:
    """Swap every exact `nn.Linear` inside `model.blocks` (meta or materialised) for a Float8Linear
    sharing its Parameters; returns how many Float8Linear the blocks hold after."""
    import torch.nn as nn
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    config = float8_config(recipe, emulate)
    for block in model.blocks.values():
        convert_to_float8_training(block, config=config, module_filter_fn=lambda module, name: type(module) is nn.Linear)
    return sum(isinstance(module, Float8Linear) for block in model.blocks.values() for module in block.modules())


def uses_tensor_grid(strategy) -> bool:
    return strategy.name in ("tp_1d", "tp_2d", "three_d") or strategy.get("tensor_parallel", "none") not in (None, "none")


def float8_errors(cfg) -> list:
    """Config errors of hardware.precision=fp8-mixed: where FP8 cannot run, the reason and the fix."""
    hardware = cfg.hardware
    if hardware.precision != PRECISION:
        return []
    head = f"hardware.precision={PRECISION}"
    errors = []
    if hardware.get("fp8_recipe", "rowwise") not in RECIPES:
        errors.append(f"hardware.fp8_recipe={hardware.fp8_recipe}: need one of {', '.join(RECIPES)}. "
                      f"Fix: hardware.fp8_recipe=rowwise.")
    emulate = bool(hardware.get("fp8_emulate", False))
    if hardware.accelerator == "cpu" and not emulate:
        errors.append(f"{head}: a CPU has no FP8 matrix products. Fix: hardware.precision=bf16-mixed, or "
                      f"hardware.fp8_emulate=true (torchao's emulation: FP8 rounding, products in high precision; "
                      f"for tests, not speed).")
    if hardware.accelerator == "gpu" and not emulate and "fp8" not in (hardware.get("peak_flops") or {}):
        errors.append(f"{head}: hardware={hardware.name} has no FP8 tensor cores (its peak_flops has no fp8 rate: "
                      f"V100 and A100 are pre-Hopper; torch._scaled_mm needs compute capability 8.9 or 9.0). "
                      f"Fix: hardware.precision=bf16-mixed, or an H100 profile (hardware=dgx_h100).")
    if not torchao_available():
        errors.append(f"{head}: torchao is not installed (its float8 training converts the linears). "
                      f"Fix: {INSTALL}.")
    strategy = cfg.strategy
    if uses_tensor_grid(strategy):
        errors.append(f"{head}: strategy={strategy.name} with a tensor grid cannot: {TENSOR_GRID}. "
                      f"Fix: hardware.precision=bf16-mixed, or a strategy without a tensor grid "
                      f"(single, ddp, fsdp2, l2l, the pipelines, zero_layered).")
    if strategy.name in ("kfac", "pipefisher"):
        errors.append(f"{head}: strategy={strategy.name} cannot: {KFAC}. Fix: hardware.precision=bf16-mixed.")
    return errors


def check_device(device) -> None:
    """On a CUDA device, before converting: FP8 products need compute capability ≥ 8.9 (Ada, Hopper)."""
    import torch
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(f"hardware.precision={PRECISION}: {name} (compute capability "
                           f"{torch.cuda.get_device_capability(device)}) has no FP8 matrix products. "
                           f"Fix: hardware.precision=bf16-mixed, or hardware.fp8_emulate=true.")
