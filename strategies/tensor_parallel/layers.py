"""The parallel modules. Each holds only this rank's shard and names its collectives' groups.

Parameter names equal the plain modules' (`weight`, `bias`, `token.weight`, ...), so a parallel
model's state dict has the plain model's keys, with shard-sized values.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from strategies.tensor_parallel.collectives import (
    copy_to_group,
    GatherMatmulScatter,
    reduce_from_group,
    sum_over_group,
    VocabularyParallelCrossEntropy,
)
from strategies.tensor_parallel.sequence import (
    OverlappedRowProduct,
    ReduceScatterSequence,
    SequenceColumnLinear,
    ShardDropout,
)


def _parameter(tensor):
    return None if tensor is None else nn.Parameter(tensor.detach().clone().contiguous())


def _group_spec(layout, spec):
    return None if spec is None else (layout.group(spec[0]), spec[1])


class GridLinear(nn.Module):
    """Linear of the 2-D / 3-D grids: y = scatter(gather(x) · gather(W)) + b (GatherMatmulScatter).

    `specs` are (family, dim) triples from the grid for this layer's explicit position, so two
    consecutive layers differ only in the arguments they were given (docs/strategies/three_d.md).
    """

    def __init__(self, weight, bias, layout, specs):
        super().__init__()
        self.weight, self.bias = _parameter(weight), _parameter(bias)
        self.communicator = layout.communicator
        self.specs = tuple(_group_spec(layout, spec) for spec in specs)

    def forward(self, x):
        y = GatherMatmulScatter.apply(x, self.weight, self.communicator, *self.specs)
        return y if self.bias is None else y + self.bias


class MegatronLinear(nn.Module):
    """A 1-D tensor-parallel linear: this rank's slice of W (and b), the tensor group, and with
    sequence parallelism the group's `sequence.SequenceRegion` (None: the activation is whole);
    `narrow`: partial sums all-reduced in the compute dtype (strategy.tensor_collective_dtype=compute)."""

    def __init__(self, weight, bias, layout, region=None, narrow: bool = False):
        super().__init__()
        self.weight, self.bias = _parameter(weight), _parameter(bias)
        self.communicator, self.group = layout.communicator, layout.group("tensor")
        self.region, self.narrow = region, narrow


class ColumnParallelLinear(MegatronLinear):
    """Megatron: W split by output rows. Its input's gradient is summed over the group by the f
    after the norm that feeds it (`CopyToGroup`), once for all the column linears reading it. With
    sequence parallelism that norm's output is gathered along the sequence instead: this linear keeps
    only its shard for the backward (`sequence.SequenceColumnLinear`), and if the gather is still in
    flight (strategy.tensor_overlap) multiplies it chunk by chunk."""

    def forward(self, x):
        gathered = None if self.region is None else self.region.gathered_input(x)
        if gathered is None:
            return F.linear(x, self.weight, self.bias)
        return SequenceColumnLinear.apply(x, self.weight, self.bias, gathered, self.region.take(x))


class CopyToGroup:
    """Forward hook putting Megatron's f (identity forward, gradient summed over the group backward;
    Shoeybi et al. 2019, §3) on a norm's output, which every column-parallel linear of the sub-layer
    reads (GPT's qkv; Llama's q, k, v, or gate and up; the head): one all-reduce of the summed input
    gradients, not one per linear."""

    def __init__(self, layout, narrow: bool = False):
        self.communicator, self.group = layout.communicator, layout.group("tensor")
        self.narrow = narrow  # the summed gradient all-reduced in the compute dtype (collectives.wire_dtype)

    def __call__(self, module, arguments, output):
        return copy_to_group(output, self.communicator, self.group, self.narrow)


class RowParallelLinear(MegatronLinear):
    """Megatron: W split by input columns; partial outputs summed over the group (g), or with
    sequence parallelism summed and scattered along the sequence (chunked under the products with
    strategy.tensor_overlap). The bias is added after the sum (once, not t times)."""

    def forward(self, x):
        if self.region is None:
            y = reduce_from_group(F.linear(x, self.weight), self.communicator, self.group, self.narrow)
        elif self.region.overlap:
            y = OverlappedRowProduct.apply(x, self.weight, self.region)
        else:
            y = ReduceScatterSequence.apply(F.linear(x, self.weight), self.region)
        return y if self.bias is None else y + self.bias


class ParallelNorm(nn.Module):
    """LayerNorm (with a bias) or RMSNorm (without) over features split across `group` (§4).

    LayerNorm, two-pass: mean = Σ_group Σ x / h; variance = Σ_group Σ (x − mean)² / h;
    y = (x − mean)/√(var + ε)·w + b. RMSNorm (Zhang & Sennrich 2019): y = x/√(Σ_group Σ x²/h + ε)·w.
    """

    def __init__(self, weight, bias, eps, layout, family):
        super().__init__()
        self.weight, self.bias, self.eps = _parameter(weight), _parameter(bias), eps
        self.communicator, self.group = layout.communicator, layout.group(family)
        self.features = weight.numel() * self.group.size

    def _sum(self, x):
        return sum_over_group(x.sum(-1, keepdim=True), self.communicator, self.group)

    def forward(self, x):
        if self.bias is None:  # RMSNorm: no centring
            return x * torch.rsqrt(self._sum(x * x) / self.features + self.eps) * self.weight
        centred = x - self._sum(x) / self.features
        variance = self._sum(centred * centred) / self.features
        return centred * torch.rsqrt(variance + self.eps) * self.weight + self.bias


class ParallelEmbedding(nn.Module):
    """Token (+ position, if the model has a table) embedding of this rank's rows and feature chunk;
    no communication.

    The tables hold [V, h/q] (replicated over the ranks that share the feature chunk: their
    gradients are summed by the strategy). The simplest correct split (§4 allows it).
    With a sequence `region` (1-D sequence parallelism) only this rank's s/t positions are looked
    up: the output is the sequence shard the blocks take, with no collective, and the tables'
    gradients are partial (summed over the tensor group, `Grid1D.replicated_over`).
    """

    def __init__(self, token, position, dropout, rows, region=None):
        super().__init__()
        self.token = nn.Embedding.from_pretrained(token.clone(), freeze=False)
        self.position = None if position is None else nn.Embedding.from_pretrained(position.clone(), freeze=False)
        self.dropout = nn.Dropout(dropout) if region is None else ShardDropout(dropout, region)
        self.rows = rows  # (index, parts) of this data rank's sequences
        self.region = region
        # Per-token positions [b, s] set by LanguageModel.set_documents (the embedding it replaces reads
        # them too): packed rows' restarted ones, or a context-parallel rank's chunks' global positions
        # (strategies/context_parallel.py); None: 0..s−1 of every row.
        self.documents = None

    def forward(self, tokens):
        tokens = tokens.chunk(self.rows[1], dim=0)[self.rows[0]]
        if self.documents is None:
            positions, along = torch.arange(tokens.shape[1], device=tokens.device), 0
        else:
            positions, along = self.documents.positions.chunk(self.rows[1], dim=0)[self.rows[0]], 1
        if self.region is not None:
            tokens, positions = self.region.shard(tokens), self.region.shard(positions, dim=along)
        if self.position is None:
            return self.dropout(self.token(tokens))
        return self.dropout(self.token(tokens) + self.position(positions))


class VocabularyParallelLoss:
    """This rank's share of the global-batch loss from vocabulary-split logits.

    objective = Σ(this rank's rows' losses) / (valid targets in the global batch), so summing the
    gradients over the batch-splitting groups and data ranks gives the global-batch gradient. The
    returned value is the objective's sum over those groups (§4: losses are all-reduced over the
    axes that split the batch), so every rank logs the global loss; its gradient is the share's.
    """

    def __init__(self, layout, grid, data_group):
        self.communicator = layout.communicator
        self.vocabulary_group = layout.group(grid.vocabulary_family)
        # data_group None: the loss of this data rank's batch (a pipeline averages over data itself)
        self.data_group = data_group
        self.batch_groups = [layout.group(f) for f in grid.batch_families] + ([data_group] if data_group else [])
        self.rows, self.chunk = grid.logit_rows(), grid.vocabulary_chunk()

    def __call__(self, logits, targets):
        # Counted in fp32, not the logits' dtype: an fp16 count is inf above 65,504 targets, and
        # the loss and gradients would be 0 (finite: no guard would notice). fp32 is exact to 2^24
        # targets and within 6e-8 of the count beyond, and keeps the all-reduce at the 4 bytes
        # cost/traffic.py counts (int64 would add 4 bytes a step to every plan's formula).
        valid_count = (targets != -100).sum().to(torch.float32).reshape(1)
        if self.data_group is not None:
            self.communicator.all_reduce(valid_count, self.data_group)
        targets = targets.chunk(self.rows[1], dim=0)[self.rows[0]].reshape(-1)
        logits = logits.reshape(-1, logits.shape[-1])
        offset = self.chunk[0] * logits.shape[-1]
        losses = VocabularyParallelCrossEntropy.apply(logits, targets, offset, self.communicator,
                                                      self.vocabulary_group)
        share = (losses * (targets != -100)).sum() / valid_count[0]
        total = share.detach().clone()
        for group in self.batch_groups:
            self.communicator.all_reduce(total, group)
        return share + (total - share).detach()
