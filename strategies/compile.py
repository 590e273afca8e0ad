"""`trainer.compile=true`: each transformer block compiled once, regionally, as torchtitan does.

torchtitan (`torchtitan/models/llama3/infra/parallelize.py`, `apply_compile`) compiles every
transformer block on its own rather than the whole model: blocks are identical in code and shapes,
so one graph serves all of them (dynamo treats the parameters of an inlined module as inputs), the
compile time is one block's, and everything around the blocks (embedding, head, loss, the
strategy's schedule, hooks and collectives) stays ordinary Python. Here:

1. `apply_compile(model)` calls `nn.Module.compile` on each block this rank holds: the module keeps
   its parameter names (no `_orig_mod.` wrapper), so checkpoints, flat shards and the pipeline's
   stage partition are unchanged. Compilation is lazy: the first call traces, so a strategy that
   later replaces a block's `forward` (activation recomputation, strategies/recompute.py) before the
   first step gets that forward compiled, `checkpoint` included (torchtitan applies AC first too);
2. `fullgraph=True`: a graph break inside a block is an error, never a silent eager island;
   `dynamic=False`: a micro-batch shape is a graph (a new shape adds one, counted);
3. dropout: inductor's own random numbers differ from eager's; `fallback_random` makes compiled
   dropout draw from eager's generator in eager's order, so compiled equals eager (TORCH.md: 4.8e-7);
4. `donated_buffer = False`: a block whose backward runs twice over one graph (retain_graph) would
   otherwise raise "compiled with non-empty donated buffers" (TORCH.md);
5. on CPU, `compile_threads = 1`: inductor compiles in the rank's own process instead of a pool of
   worker processes. CPU ranks are forked (layerwise/run/launch.py), and a rank forked from a
   process that had started the pool (a one-process compiled run before it, as in a test session or
   a sweep) waited forever on the parent's workers (measured: a 2-rank ddp run hung > 600 s after a
   compiled `single` in the same process). GPU ranks are spawned and keep inductor's pool.

What a strategy cannot compile is declared, with the reason, by its registry entry's
`eager_blocks(cfg)` (strategies/registry.py): those blocks run eager, and the run says so with the
reason (`eager_note`: a line at start and summary.json's `compile.eager`), never a silent graph
break; a sweep over strategies with trainer.compile=true runs every point. The reasons are these
constants.
"""

from __future__ import annotations

import torch

# Why a strategy's blocks run eager (each is the text of the config error or the summary's `eager`).
SPLIT_BACKWARD = ("its schedule splits the backward into I and W (strategy.schedule={schedule}); a compiled block "
                  "is one autograd node, so W would rerun the block's whole backward (measured for issue 59: "
                  "107 ms vs 64 ms fused): split-backward stages stay eager")
TENSOR_GRID = ("its blocks' tensor-grid layers are autograd functions whose collectives update the counted "
               "communicator's tallies (parallel/comm.py); inside a compiled block dynamo refuses that side effect "
               "(\"Unsupported: HOP: Unsafe side effect\", tried with tp_1d on torch 2.13), and graph breaks "
               "around each collective would leave silent eager islands")
KFAC_HOOKS = ("K-FAC captures each linear's input in a forward hook that registers a gradient hook on its output "
              "(strategies/kfac.py); inside a compiled block dynamo refuses that (\"Unsupported HOP: Unsafe side "
              "effect\", tried on torch 2.13), and a graph break there would leave the linears eager")
NOT_DECLARED = "the strategy does not declare that its blocks compile"


def compiles(cfg) -> None:
    """`eager_blocks` of a strategy whose blocks all compile: no reason to stay eager."""
    return None


def always_eager(reason: str):
    """`eager_blocks` of a strategy that cannot compile its blocks under any config."""
    def eager_blocks(cfg) -> str:
        return reason
    return eager_blocks


def pipeline_eager_blocks(cfg):
    """`eager_blocks` of the staged strategies: their blocks compile unless the schedule splits the
    backward or a tensor grid cuts the blocks' layers."""
    from strategies.schedule.generators import ZERO_BUBBLE
    strategy = cfg.strategy
    if strategy.get("schedule") in ZERO_BUBBLE:
        return SPLIT_BACKWARD.format(schedule=strategy.schedule)
    if strategy.get("tensor_parallel", "none") not in (None, "none"):
        return TENSOR_GRID
    return None


def eager_note(cfg, entry) -> str | None:
    """Under `trainer.compile=true`, why this strategy's blocks run eager (None: they compile)."""
    if not cfg.trainer.get("compile", False):
        return None
    reason = entry.eager_blocks(cfg)
    if reason is None:
        return None
    return (f"trainer.compile=true: strategy={cfg.strategy.name} runs its blocks eager: {reason}. The blocks "
            f"compile in single, ddp, fsdp2, l2l, the pipelines and zero_layered with a fused-backward schedule.")


def configure_compiler(device_type: str) -> None:
    """Process-wide settings every compiled block needs (see the module's docstring, 3 to 5)."""
    import torch._functorch.config
    import torch._inductor.config
    torch._inductor.config.fallback_random = True
    torch._functorch.config.donated_buffer = False
    if device_type == "cpu":
        torch._inductor.config.compile_threads = 1


def apply_compile(model, device_type: str) -> int:
    """Compile each block `model.blocks` holds on this rank, in place, once; returns how many.
    Idempotent: Lightning may configure the model twice (validate/test after fit)."""
    configure_compiler(device_type)
    compiled = 0
    for block in model.blocks.values():
        if getattr(block, "_compiled_call_impl", None) is None:
            block.compile(fullgraph=True, dynamic=False)
        compiled += 1
    return compiled


# dynamo's timers of a whole forward compile (inductor's lowering of the forward, and of the backward
# when it is not deferred, included) and of a backward compiled lazily at its first call
COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")


def compile_counters() -> dict:
    """torch's own counts in this process: the graphs dynamo made (`unique_graphs`; a new shape or
    grad mode adds one, TORCH.md) and the recompilations it logged (guard failures), and the seconds
    spent compiling (COMPILE_TIMERS)."""
    from torch._dynamo.utils import compilation_time_metrics, counters
    seconds = sum(sum(compilation_time_metrics.get(name, ())) for name in COMPILE_TIMERS)
    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "recompiles": int(sum(counters["recompiles"].values())), "compile_s": float(seconds)}
