"""Sequence parallelism in the 1-D grid (Korthikanti et al. 2022 §4.2.2) and its overlapped collectives.

Between the tensor-parallel regions (norms, dropout, residual additions) each of the t ranks of the
tensor group holds 1/t of the sequence, [rows, s/t, h], instead of a copy of the whole activation:

    embedding   looks up only this rank's s/t positions (no collective; its tables' gradients are
                then partial: summed over the tensor group with the norms', `Grid1D.replicated_over`)
    norm -> f   the norm runs on the shard; its output is all-gathered along the sequence before the
                column-parallel linears read it (backward: the summed input gradient is reduce-
                scattered), in place of Megatron's f (identity forward, all-reduce backward); the
                linears save the shard and gather it again for their weight gradients
                (`GatheredInput`, `SequenceColumnLinear`)
    row linear  its partial sums are reduce-scattered along the sequence (backward: all-gathered),
                in place of Megatron's g (all-reduce forward)
    dropout     on the shard, with this rank's slice of the mask `single` draws for the whole
                activation (`ShardDropout`)

An all-reduce moves 2(t−1)/t of its tensor, an all-gather and a reduce-scatter (t−1)/t each: the
bytes are those of the all-reduces replaced (megatron/core/tensor_parallel/mappings.py names the
four functions), plus one all-gather per gathered norm output in the backward (the saved shard's).
Partial sums are added in the compute dtype under mixed precision with `narrow`
(strategy.tensor_collective_dtype=compute, as Megatron-LM reduce-scatters its bf16/fp16 activations),
else in fp32, as `collectives.sum_copy` adds them (`collectives.wire_dtype`).

With `chunks` > 1 (strategy.tensor_overlap) the gathers and reduce-scatters are split into chunks
along the sequence and posted asynchronously, so the product of one chunk runs while the next
chunk is on the wire (Wang et al., ASPLOS 2023, "Overlap communication with dependent computation
via decomposition in large deep learning models"; Megatron-Core's --tp-comm-overlap does it with a
ring of sends):
    forward:  the norm's gather is posted and the first column linear reading it
              (`SequenceColumnLinear`) computes chunk by chunk as each arrives; the row linear's
              product is computed chunk by chunk and each chunk's reduce-scatter posted behind it;
    backward: the column linear's second gather of its shard travels under its dX product; the row
              linear's gradient gather is chunked under the input-gradient products.
Not overlapped, and why: the norm gather's backward (a reduce-scatter of the input gradient summed
over every column linear reading it: q, k and v, or gate and up) can only start once autograd has
summed all of them, and the next operation (the norm's backward) needs its result; the row
linear's forward reduce-scatter of the last chunk has no product after it in the linear.

Chunk c of k takes, on every rank, local positions [c·n, (c+1)·n) (n = s/(t·k)): gathered over the
group it is the positions r·s/t + c·n + i of every rank r, the [:, :, c] slice of the activation
viewed as [rows, t, k, n, h], so each chunk's product lands on its own rows and every row's sums
are the ones the unchunked product makes.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from strategies.schedule.generators import ZERO_BUBBLE
from models.transformer import compute_dtype
from strategies.tensor_parallel.collectives import gather, scatter_sum, wire_dtype


class SequenceRegion:
    """The sequence-parallel state one model's 1-D tensor group shares: the group, this rank's shard
    of the sequence, how many chunks an overlapped collective takes (1: none) and the gathers still
    in flight (a gathered tensor -> its `PendingGather`, until a column linear reads it)."""

    def __init__(self, layout, overlap: bool = False, narrow: bool = False):
        self.communicator, self.group = layout.communicator, layout.group("tensor")
        self.rank, self.parts = layout.index("tensor"), self.group.size
        self.overlap = overlap
        self.narrow = narrow  # reduce-scatters in the compute dtype under autocast (wire_dtype)
        self.pending = {}
        self.gathered = {}  # the latest gathered tensor -> its `GatheredInput` (the column linears' saved shard)

    def chunks(self, local_length: int) -> int:
        """Chunks an overlapped collective of a shard `local_length` long takes: t (the ring's steps)
        where the shard splits into t, else the largest common divisor; 1 without overlap."""
        return math.gcd(local_length, self.parts) if self.overlap else 1

    def shard(self, full: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's contiguous 1/t of `full` along `dim`."""
        return full.chunk(self.parts, dim)[self.rank]

    def settle(self) -> None:
        """Finish any gather nobody read chunk by chunk (a norm output read by something other than a
        column linear), so collectives complete in the order every rank posted them."""
        for pending in list(self.pending.values()):
            pending.finish()
        self.pending.clear()

    def take(self, full: torch.Tensor):
        """The gather in flight into `full`, if any (removed: only its first reader overlaps it)."""
        return self.pending.pop(full.data_ptr(), None) if self.pending else None

    def gathered_input(self, full: torch.Tensor):
        """The `GatheredInput` of `full` if it is the latest gathered norm output, else None."""
        return self.gathered.get(full.data_ptr())


class GatheredInput:
    """A gathered norm output as the column linears reading it keep it for their weight gradients:
    its shard, gathered again in the backward (Korthikanti et al. 2022 §4.2.2: "we store Y_i^s and
    perform an extra all-gather in the backward pass"), once for all of them (GPT's qkv, Llama's q, k
    and v): the first backward gathers, the others reuse it, the last drops it."""

    def __init__(self, region: SequenceRegion, shard: torch.Tensor):
        self.region, self.shard = region, shard
        self.readers = 0  # column linears that saved it and have not run their backward yet
        self.full, self.work = None, None

    def post(self, shard: torch.Tensor) -> None:
        """Start the backward's gather asynchronously (under strategy.tensor_overlap: the input
        gradient's product runs while it travels), unless it is already here or on its way."""
        if self.full is None and self.work is None:
            front = shard.movedim(1, 0).contiguous()
            self.buffer = front.new_empty((self.region.parts * front.shape[0],) + tuple(front.shape[1:]))
            self.work = self.region.communicator.all_gather(self.buffer, front, self.region.group, async_op=True)

    def take(self, shard: torch.Tensor) -> torch.Tensor:
        """The gathered [rows, s, h] for one reader's weight gradient."""
        if self.full is None:
            if self.work is None:
                self.full = gather(self.region.communicator, shard, self.region.group, dim=1).contiguous()
            else:
                self.work.wait()
                self.full = self.buffer.movedim(0, 1).contiguous()
                self.work = self.buffer = None
        full = self.full
        self.readers -= 1
        if self.readers <= 0:
            self.full = None
        return full


def _chunked(tensor: torch.Tensor, parts: int, chunks: int) -> torch.Tensor:
    """[rows, t·k·n, ...] viewed as [rows, t, k, n, ...]: chunk c of every rank's shard is [:, :, c]."""
    rows, length = tensor.shape[:2]
    return tensor.view(rows, parts, chunks, length // (parts * chunks), *tensor.shape[2:])


class PendingGather:
    """A chunked all-gather along the sequence posted asynchronously: `wait(c)` completes chunk c and
    copies it into its rows of `full`."""

    def __init__(self, region: SequenceRegion, shard: torch.Tensor, full: torch.Tensor, chunks: int):
        self.region, self.full, self.chunks = region, full, chunks
        self.views = _chunked(full, region.parts, chunks)
        self.buffers, self.works = [], []
        for piece in shard.chunk(chunks, dim=1):  # every chunk posted now: the wire never waits for a product
            front = piece.movedim(1, 0).contiguous()  # [n, rows, h]: gathered along dim 0 as [t·n, rows, h]
            buffer = front.new_empty((region.parts * front.shape[0],) + tuple(front.shape[1:]))
            self.works.append(region.communicator.all_gather(buffer, front, region.group, async_op=True))
            self.buffers.append(buffer)
        self.done = [False] * chunks

    def wait(self, chunk: int) -> torch.Tensor:
        """Chunk `chunk` of every rank, [rows, t, n, h], once arrived (and written into `full`)."""
        view = self.views[:, :, chunk]
        if not self.done[chunk]:
            self.works[chunk].wait()
            buffer = self.buffers[chunk]
            parts, n = self.region.parts, buffer.shape[0] // self.region.parts
            view.copy_(buffer.view(parts, n, *buffer.shape[1:]).movedim(2, 0))
            self.done[chunk], self.buffers[chunk] = True, None
        return view

    def finish(self) -> None:
        for chunk in range(self.chunks):
            self.wait(chunk)


class GatherSequence(torch.autograd.Function):
    """x[rows, s/t, h] -> x[rows, s, h] gathered over the tensor group (Megatron's
    gather_from_sequence_parallel_region); backward: the gradient summed over the group and this
    rank's rows kept (a reduce-scatter). Cast to the compute dtype first, as autocast casts a
    linear's input: the gather moves compute-dtype bytes and the linears reading it cast nothing.
    Overlapped: the chunks are posted and the tensor returned at once; the first column linear
    fills it chunk by chunk (`ColumnParallelLinear`)."""

    @staticmethod
    def forward(context, shard, region):
        context.region, context.dtype = region, shard.dtype
        context.wire = wire_dtype(shard, region.narrow)  # autocast is off in the backward
        region.settle()
        shard = shard.to(compute_dtype(shard)).contiguous()
        chunks = region.chunks(shard.shape[1])
        if chunks == 1:  # [rows, s, h] contiguous: the linears' reshapes to [rows·s, h] are views, not copies
            full = gather(region.communicator, shard, region.group, dim=1).contiguous()
        else:
            full = shard.new_empty((shard.shape[0], shard.shape[1] * region.parts) + tuple(shard.shape[2:]))
            region.pending[full.data_ptr()] = PendingGather(region, shard, full, chunks)
        region.gathered = {full.data_ptr(): GatheredInput(region, shard)}
        return full

    @staticmethod
    def backward(context, grad_full):
        region = context.region
        region.settle()
        return _sum_scatter(region, grad_full, context.wire).to(context.dtype), None


class ReduceScatterSequence(torch.autograd.Function):
    """Partial sums y[rows, s, h] -> Σ_group y, this rank's s/t rows (Megatron's
    reduce_scatter_to_sequence_parallel_region), added in the wire dtype (fp32, or the compute dtype
    with strategy.tensor_collective_dtype=compute) and returned in y's dtype; backward:
    the gradient all-gathered along the sequence."""

    @staticmethod
    def forward(context, partial, region):
        context.region = region
        region.settle()
        return _sum_scatter(region, partial, wire_dtype(partial, region.narrow)).to(partial.dtype)

    @staticmethod
    def backward(context, grad_shard):
        region = context.region
        region.settle()
        return gather(region.communicator, grad_shard.contiguous(), region.group, dim=1), None


def _sum_scatter(region: SequenceRegion, full: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    """Σ_group of `full`, this rank's rows, added in `wire` (collectives.wire_dtype)."""
    wide = full if full.dtype == torch.float64 else full.to(wire)
    return scatter_sum(region.communicator, wide, region.group, dim=1)


class SequenceColumnLinear(torch.autograd.Function):
    """y = x·Wᵀ + b for a gathered norm output x, saving its shard (`GatheredInput`), not x.

    Forward: if x's gather is still in flight (strategy.tensor_overlap), chunk c's product runs once
    chunk c arrives while the later chunks travel; else one product. Backward: dX = dY·W needs no X;
    X is gathered again for dW = dYᵀ·X (posted before dX's product under overlap, so it travels
    while dX is computed, as Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication does);
    db = Σ dY. The products are the plain linear's over the flattened rows: bit-identical to it."""

    @staticmethod
    def forward(context, x, weight, bias, gathered, pending):
        context.has_bias, context.gathered, context.shape = bias is not None, gathered, x.shape
        dtype = compute_dtype(x)
        weight_c, bias_c = weight.to(dtype), None if bias is None else bias.to(dtype)
        if pending is None:
            y = F.linear(x.to(dtype), weight_c, bias_c)
        else:
            y = x.new_empty(tuple(x.shape[:-1]) + (weight.shape[0],), dtype=dtype)
            rows = _chunked(y, pending.region.parts, pending.chunks)
            for chunk in range(pending.chunks):
                rows[:, :, chunk] = F.linear(pending.wait(chunk), weight_c, bias_c)
        gathered.readers += 1
        context.save_for_backward(gathered.shard, weight)
        return y

    @staticmethod
    def backward(context, grad_y):
        shard, weight = context.saved_tensors
        gathered, dtype = context.gathered, shard.dtype
        if gathered.region.overlap:
            gathered.post(shard)
        grad = grad_y.to(dtype).reshape(-1, grad_y.shape[-1])
        grad_x = (grad @ weight.to(dtype)).view(context.shape)
        x = gathered.take(shard)
        grad_weight = grad.t() @ x.reshape(-1, x.shape[-1])
        grad_bias = grad.sum(0) if context.has_bias else None
        return grad_x, grad_weight, grad_bias, None, None


class OverlappedRowProduct(torch.autograd.Function):
    """Σ_group x·Wᵀ reduce-scattered along the sequence, chunk by chunk: chunk c's partial product is
    computed and its reduce-scatter posted before chunk c+1's product starts. Backward: dY's chunks
    all-gathered asynchronously, each chunk's dX = dY·W computed as it arrives; dW = dYᵀ·X once all
    are in (one product over every row, as the unchunked linear makes it)."""

    @staticmethod
    def forward(context, x, weight, region):
        context.save_for_backward(x, weight)
        context.region = region
        region.settle()
        dtype = compute_dtype(x)
        weight_c = weight.to(dtype)
        chunks = region.chunks(x.shape[1] // region.parts)
        rows, pieces, works = _chunked(x.to(dtype), region.parts, chunks), [], []
        wire = wire_dtype(x, region.narrow)
        for chunk in range(chunks):
            partial = F.linear(rows[:, :, chunk], weight_c)  # [rows, t, n, out]
            front = partial.to(wire).movedim(1, 0).contiguous()  # [t, rows, n, out]: member r's chunk first
            front = front.view(-1, *front.shape[2:])
            piece = front.new_empty((front.shape[0] // region.parts,) + tuple(front.shape[1:]))
            works.append(region.communicator.reduce_scatter(piece, front, region.group, async_op=True))
            pieces.append(piece)
        for work in works:
            work.wait()
        return torch.cat(pieces, dim=1).to(dtype)

    @staticmethod
    def backward(context, grad_shard):
        x, weight = context.saved_tensors
        region = context.region
        region.settle()
        dtype = grad_shard.dtype  # the compute dtype under autocast; autograd casts each gradient back
        grad_full = grad_shard.new_empty(tuple(x.shape[:-1]) + (grad_shard.shape[-1],))
        pending = PendingGather(region, grad_shard.contiguous(), grad_full, region.chunks(grad_shard.shape[1]))
        grad_x = grad_shard.new_empty(x.shape)
        rows, weight_c = _chunked(grad_x, region.parts, pending.chunks), weight.to(dtype)
        for chunk in range(pending.chunks):
            rows[:, :, chunk] = pending.wait(chunk) @ weight_c
        flat = grad_full.reshape(-1, grad_full.shape[-1])
        return grad_x, flat.t() @ x.to(dtype).reshape(-1, x.shape[-1]), None


class ShardDropout(nn.Module):
    """Dropout of a sequence shard [rows, s/t, ...] with this rank's slice of the mask `single` draws
    for the whole [rows, s, ...] activation.

    Megatron forks the RNG per tensor rank so each rank draws its shard's mask alone; here every
    rank draws the whole mask from the global generator (seeded alike on the ranks of one tensor
    group, layerwise/run/task.py) and keeps its slice: ranks never share a mask on different shards,
    the masks are `single`'s, and activation recomputation (which restores the global generator)
    redraws them. The price: (t−1)/t of the mask's random numbers drawn and dropped, and a
    transient whole-activation mask (not saved: autograd keeps the slice)."""

    def __init__(self, p: float, region: SequenceRegion):
        super().__init__()
        self.p, self.region = p, region

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        whole = (x.shape[0], x.shape[1] * self.region.parts) + tuple(x.shape[2:])
        with torch.no_grad():  # F.dropout of ones: the very draws single's dropout makes for this shape
            mask = F.dropout(torch.ones(whole, dtype=x.dtype, device=x.device), self.p, True)
            mask = self.region.shard(mask).clone()
        return x * mask

    def extra_repr(self) -> str:
        return f"p={self.p}, sequence shard {self.region.rank} of {self.region.parts}"


class GatherToSequence:
    """Forward hook on a norm whose output feeds column-parallel linears (GPT's qkv, fc_in; Llama's
    q, k, v, gate, up; the head): its shard is gathered along the sequence once for all of them
    (`GatherSequence`), in place of 1-D Megatron's f (`layers.CopyToGroup`)."""

    def __init__(self, region: SequenceRegion):
        self.region = region

    def __call__(self, module, arguments, output):
        return GatherSequence.apply(output, self.region)


# ----- the config rule (strategy.sequence_parallel, strategy.tensor_overlap), for every strategy's check

def sequence_errors(cfg, mode, tensor: int) -> list:
    """strategy.sequence_parallel needs the 1-D grid and positions that split into t equal shards;
    strategy.tensor_overlap needs sequence_parallel. Each error names the field and the fix."""
    strategy, errors = cfg.strategy, []
    sequence, overlap = strategy.get("sequence_parallel", False), strategy.get("tensor_overlap", False)
    wire = strategy.get("tensor_collective_dtype", "compute")
    if wire not in ("compute", "fp32"):
        errors.append(f"strategy.tensor_collective_dtype={wire}: need compute (the 1-D grid's partial sums "
                      f"reduced in bf16/fp16 under mixed precision, as Megatron-LM) or fp32. "
                      f"Fix: strategy.tensor_collective_dtype=compute.")
    if overlap and not sequence:
        errors.append("strategy.tensor_overlap=true chunks the sequence-parallel all-gathers and reduce-scatters "
                      "under the neighbouring products, which needs them. Fix: strategy.sequence_parallel=true, or "
                      "strategy.tensor_overlap=false.")
    if not sequence:
        return errors
    if strategy.get("schedule") in ZERO_BUBBLE:
        errors.append(f"strategy.sequence_parallel=true with strategy.schedule={strategy.schedule}: the split "
                      f"backward runs a weight's gradient (W) apart from the input's (I), but a column linear "
                      f"computes both in one autograd node around the all-gather of its saved input shard (and an "
                      f"overlapped row linear around its chunked collectives), which W would run again (not "
                      f"built). Fix: strategy.sequence_parallel=false, or strategy.schedule=one_f_one_b.")
    if strategy.name == "pipefisher":
        errors.append("strategy.sequence_parallel=true: pipefisher's K-FAC factors pair each linear's input with "
                      "its output gradient token by token, which a row-parallel linear's sequence shard breaks "
                      "(not built). Fix: strategy.sequence_parallel=false.")
    elif mode != "1d":
        errors.append(f"strategy.sequence_parallel=true splits the 1-D grid's whole residual stream along the "
                      f"sequence; strategy.tensor_parallel={mode or 'none'} "
                      f"{'has no tensor grid' if mode in (None, 'none') else 'already splits it'}. Fix: "
                      f"strategy.tensor_parallel=1d, or strategy.sequence_parallel=false.")
    elif cfg.data.sequence_length % tensor:
        below = cfg.data.sequence_length // tensor * tensor
        errors.append(f"data.sequence_length={cfg.data.sequence_length} is not divisible by the {tensor} tensor "
                      f"ranks of strategy.tensor_grid={strategy.tensor_grid}: strategy.sequence_parallel=true "
                      f"gives each rank an equal 1/{tensor} of the positions. Fix: data.sequence_length="
                      f"{' or '.join(str(v) for v in ([below] if below else []) + [below + tensor])}, "
                      f"or strategy.sequence_parallel=false.")
    return errors
