"""summary.json's `compile` (trainer.compile=true): what compiled, how often, and how long it took.

torch counts for itself, per process (strategies/compile.py `compile_counters`): the graphs dynamo
made and the recompilations its guards caused. `CompileRecord` reads them around every training
step, so each graph is charged to the step (or the validation between steps) that made it:

1. before and after each training step: the graphs and recompilations that step added; the first
   step traces every block's graph (one per distinct block code and micro-batch shape: a pipeline's
   micro-batches and stages share it, TORCH.md "Twelve block instances share one graph"), every
   later step should add none;
2. whatever is added between steps is validation's (no_grad traces its own graph, once);
3. at the end of training, every rank's numbers are reduced (the maximum; blocks compiled: the sum)
   and handed to the evidence, which writes them into summary.json (docs/evidence.md).
"""

import lightning.pytorch as pl
import torch.distributed as dist

from layerwise.run.evidence import reduce_over_ranks
from strategies.compile import compile_counters

# What regional compilation leaves eager in every strategy that compiles (strategies/compile.py).
REGIONAL = ("the embedding, the head and the loss, and the strategy's schedule, hooks and collectives "
            "(regional compilation: only transformer blocks compile)")


class CompileRecord(pl.Callback):
    """Counts graphs per training step and hands the totals to the run's evidence at the end."""

    def __init__(self, evidence, eager_blocks: str | None = None):
        self.evidence = evidence
        self.eager_blocks = eager_blocks  # why the strategy's blocks run eager (strategies/compile.py), or None
        self.steps = []  # (graphs, recompiles) each training step added, in this process
        self.start = None
        self.before = None

    def on_train_start(self, trainer, module):
        self.start = compile_counters()

    def on_train_batch_start(self, trainer, module, batch, batch_index):
        self.before = compile_counters()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
        after = compile_counters()
        self.steps.append((after["graphs"] - self.before["graphs"], after["recompiles"] - self.before["recompiles"]))

    def on_train_end(self, trainer, module):
        """Before the evidence's own on_train_end (this callback comes first): every rank reduces."""
        end = compile_counters()
        first = self.steps[0] if self.steps else (0, 0)
        later = [sum(graphs for graphs, _ in self.steps[1:]), sum(recompiles for _, recompiles in self.steps[1:])]
        in_steps = sum(graphs for graphs, _ in self.steps)
        validation = end["graphs"] - self.start["graphs"] - in_steps
        device = trainer.strategy.root_device
        # differences from training's start: a forked rank inherits its parent's counters (an earlier
        # compiled run in the same process: a test session, a sweep)
        maxima = reduce_over_ranks([float(first[0]), float(later[0]), float(later[1]),
                                    float(end["recompiles"] - self.start["recompiles"]), float(validation),
                                    end["compile_s"] - self.start["compile_s"]], dist.ReduceOp.MAX, device)
        blocks = reduce_over_ranks([float(trainer.strategy.compiled_blocks)], dist.ReduceOp.SUM, device)[0]
        self.evidence.history["compile"] = {
            "blocks_compiled": int(blocks),  # over all ranks (a pipeline's stages hold disjoint blocks)
            "graphs_first_step": int(maxima[0]),  # the most any rank traced in the first step
            "graphs_after_first_step": int(maxima[1]),  # new graphs in later training steps: 0 expected
            "recompiles_after_first_step": int(maxima[2]),
            "recompiles": int(maxima[3]),  # all of training's, validation included
            "validation_graphs": int(maxima[4]),  # no_grad traces its own graph
            "compile_s": round(maxima[5], 3),  # the slowest rank's seconds in dynamo + inductor (cold or cached)
            "eager": self.eager_blocks or REGIONAL,
        }
