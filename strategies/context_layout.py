"""Context parallelism as a layout dimension of the strategies (strategy.context_parallel = c).

The attention that exchanges keys and values between a sequence's c shards is
strategies/context_parallel.py's (`apply_context_parallel`, `context_parallel_batch`). This module is
what every strategy that offers c shares around it:

1. the registry side: `context_of(strategy_config)` reads c and the exchange, `context_errors(...)`
   refuses what is not built (each error names the field and the fix), `eager_unless_context` keeps
   the blocks eager under trainer.compile where the exchange runs inside them;
2. the rank side: `ContextParallelHooks` installs the attention on the blocks this rank holds and
   cuts each batch's rows to this rank's head and tail chunks (`context_batch`: the task's step, for
   ddp and tp_1d; `ContextCut`: StageWork's micro-batches, for the pipelines and ZeRO).

Who reduces what (Megatron-core's "data-parallel group with context parallelism",
megatron/core/parallel_state.py `get_data_parallel_group(with_context_parallel=True)`): the c ranks
of a sequence hold the same parameters and each computes the gradient of the mean loss over its own
s/c tokens of every row, so the global-batch gradient is the mean over the d·c ranks of the
`data_context` group. Data-parallel slicing stays by the data index: the c ranks of one replica
read the same rows (RunHooks.data_parallel is unchanged). Each rank scores s/c targets per row (no
target is ignored for a causal model, packed or not), so the mean of the per-rank losses is the
global mean and the logged loss (the world mean of what each rank returns) needs no change; BERT's
masked targets would break that (refused).
"""

from __future__ import annotations

from dataclasses import dataclass

from models.documents import batch_documents
from strategies.context_parallel import EXCHANGES, apply_context_parallel, context_parallel_batch

# trainer.compile with c > 1: the exchange (point-to-point sends or an all-gather through the counted
# communicator) runs inside every block's attention; dynamo refuses the communicator's tallies as a side
# effect (compile.py TENSOR_GRID, the same tally), and a graph break per layer would leave eager islands.
CONTEXT_EAGER = ("its blocks' attention exchanges keys and values over the context group through the counted "
                 "communicator (strategy.context_parallel > 1), a side effect dynamo refuses inside a compiled "
                 "block (as the tensor grid's collectives): the blocks stay eager")


def context_of(strategy_config) -> tuple:
    """(c, exchange): strategy.context_parallel and strategy.context_parallel_comm; (1, "ring") for a
    schema without ContextParallelConfig (pipefisher on the pipeline's code)."""
    if "context_parallel" not in strategy_config:
        return 1, "ring"
    return strategy_config.context_parallel, strategy_config.context_parallel_comm


def context_errors(cfg, world_size: int, other_ranks: int, refused: dict = None, tensor: int = 1) -> list:
    """What strategy.context_parallel (c) and strategy.context_parallel_comm need, for a strategy that
    splits the world as data × `other_ranks` (pipeline × tensor) × c, with `tensor` 1-D ranks. `refused`:
    {why: fix} of this strategy's combinations with c > 1 that are not built. Each error names the
    field and the fix."""
    strategy = cfg.strategy
    c, exchange = context_of(strategy)
    errors = []
    if exchange not in EXCHANGES:
        errors.append(f"strategy.context_parallel_comm={exchange}: need ring (key/value blocks passed around the "
                      f"context group, overlapped with the blockwise attention) or all_gather (keys and values "
                      f"gathered, local queries). Fix: strategy.context_parallel_comm=ring.")
    if c < 1:
        return errors + [f"strategy.context_parallel={c} must be at least 1 (ranks one sequence is split over). "
                         f"Fix: strategy.context_parallel=1 (off) or 2."]
    if c == 1:  # no split: the strategy's own check names a world that its other degrees do not divide
        return errors
    if world_size % (c * other_ranks):
        fits = [n for n in range(1, world_size + 1) if world_size % (n * other_ranks) == 0]
        choices = f"strategy.context_parallel in {fits}, or " if fits else ""
        errors.append(f"strategy.context_parallel={c} × {other_ranks} pipeline × tensor ranks does not divide the "
                      f"world size {world_size} (hardware.nodes × hardware.devices_per_node); world = data × "
                      f"pipeline × context × tensor. Fix: {choices}"
                      f"hardware.devices_per_node={c * other_ranks} or {2 * c * other_ranks}.")
    length = cfg.data.sequence_length
    if length % (2 * c):
        errors.append(f"data.sequence_length={length} does not split into 2 × strategy.context_parallel={c} "
                      f"chunks (each rank holds a head and a tail chunk, so causal work is balanced). Fix: "
                      f"data.sequence_length a multiple of {2 * c}, e.g. {length // (2 * c) * 2 * c or 2 * c}.")
    if strategy.get("sequence_parallel", False) and (length // c) % tensor:
        errors.append(f"strategy.sequence_parallel=true with strategy.context_parallel={c}: each rank's "
                      f"{length // c} positions (data.sequence_length={length} / c) must split into the {tensor} "
                      f"tensor ranks' sequence shards. Fix: data.sequence_length a multiple of {2 * c * tensor}.")
    if cfg.model.architecture == "bert":
        errors.append(f"strategy.context_parallel={c} with model.architecture=bert: a masked-LM row scores only "
                      f"its masked positions, which fall unevenly on the c shards, so the mean of the shards' "
                      f"mean losses (and gradients) is not the batch's. Fix: strategy.context_parallel=1, or "
                      f"model=gpt or llama.")
    recompute = strategy.get("activation_recompute", "none")
    if recompute == "selective":
        errors.append(f"strategy.context_parallel={c} with strategy.activation_recompute=selective: selective "
                      f"reruns the core attention, which under context parallelism is the key/value exchange "
                      f"itself (not built: its rerun would repeat the exchange in the backward). Fix: "
                      f"strategy.activation_recompute=none or full.")
    for why, fix in (refused or {}).items():
        errors.append(f"strategy.context_parallel={c} {why}. Fix: strategy.context_parallel=1, or {fix}.")
    return errors


def eager_unless_context(eager_blocks):
    """`eager_blocks` of a strategy offering c: eager with CONTEXT_EAGER when c > 1, else its own."""
    def chosen(cfg):
        if context_of(cfg.strategy)[0] > 1:
            return CONTEXT_EAGER
        return eager_blocks(cfg)
    return chosen


def replica_index(layout) -> int:
    """This rank's place in its `data_context` group (data-major, context-minor: d·c + c_index): which
    ZeRO shard or distributed-optimizer slice it holds when those split over data × context."""
    return layout.group("data_context").ranks.index(layout.rank)


@dataclass(frozen=True)
class ContextCut:
    """Cuts whole rows to this rank's chunks: `cut(model, batch) -> batch` keeps tokens and targets of
    chunks `index` and 2c − 1 − `index` (strategies/context_parallel.py `context_parallel_batch`, which
    also sets the model's positions, and documents of packed rows, for them)."""

    index: int
    degree: int

    def __call__(self, model, batch: dict) -> dict:
        tokens, targets = context_parallel_batch(model, batch["tokens"], batch["targets"], batch_documents(batch),
                                                 self.index, self.degree)
        return {"tokens": tokens, "targets": targets}

    def length(self, whole: int) -> int:
        """Positions of a row this rank holds: its two chunks of s/(2c)."""
        return whole // self.degree


class ContextParallelHooks:
    """Mixin (before RunHooks in a strategy's bases) of the strategies that offer c.

    The subclass sets `context_degree` and `context_comm` from its constructor and has a `layout`.
    1. `install_context_parallel(model)`: after this rank's blocks exist (materialised, cut to a
       tensor grid's shards if any), their attention exchanges keys and values over the context group;
    2. `context_cut()`: the ContextCut of this rank, None without CP;
    3. `context_batch(model, batch)`: RunHooks' hook the task calls before each step's forward.
    """

    context_degree = 1
    context_comm = "ring"

    def install_context_parallel(self, model) -> None:
        if self.context_degree > 1:
            apply_context_parallel(model, self.layout.group("context"), self.layout.communicator, self.context_comm)

    def context_cut(self) -> ContextCut | None:
        if self.context_degree == 1:
            return None
        return ContextCut(self.layout.index("context"), self.context_degree)

    def context_batch(self, model, batch: dict) -> dict:
        cut = self.context_cut()
        return batch if cut is None else cut(model, batch)
