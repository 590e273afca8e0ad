"""Counted collectives along any dimension, and the autograd functions tensor parallelism uses.

Everything passes through the layout's Communicator (so the bytes are counted: parallel/comm.py).
torch's single-tensor all-gather / reduce-scatter (parallel/compat.py) work on dim 0; `gather` and `scatter_sum`
move the wanted dimension to the front and back. A group of one is the identity.
"""

import torch

from models.transformer import compute_dtype


def gather(communicator, shard: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Concatenate every member's `shard` along `dim`, in the group's rank order."""
    if group.size == 1:
        return shard
    front = shard.movedim(dim, 0).contiguous()
    full = front.new_empty((group.size * front.shape[0],) + tuple(front.shape[1:]))
    communicator.all_gather(full, front, group)
    return full.movedim(0, dim)


def scatter_sum(communicator, full: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Sum `full` over the group and keep this member's chunk along `dim` (a reduce-scatter)."""
    if group.size == 1:
        return full
    front = full.movedim(dim, 0).contiguous()
    shard = front.new_empty((front.shape[0] // group.size,) + tuple(front.shape[1:]))
    communicator.reduce_scatter(shard, front, group)
    return shard.movedim(0, dim)


def sum_in_place(communicator, tensor: torch.Tensor, group) -> torch.Tensor:
    communicator.all_reduce(tensor, group)
    return tensor


def sum_copy(communicator, tensor: torch.Tensor, group, wire: torch.dtype = torch.float32) -> torch.Tensor:
    """Σ_group of a copy of `tensor`, added in `wire` (`wire_dtype`), returned in `tensor`'s dtype.
    fp32 (strategy.tensor_collective_dtype=fp32): bf16 partial sums would round once per member, the
    unsharded product rounds once; bf16/fp16 (=compute, Megatron-LM's): half the bytes, and each
    all-reduce rounds the sum to the compute dtype (a ring of t adds t − 1 roundings)."""
    wide = tensor.to(torch.float64 if tensor.dtype == torch.float64 else wire, copy=True)
    return sum_in_place(communicator, wide, group).to(tensor.dtype)


def wire_dtype(tensor: torch.Tensor, narrow: bool) -> torch.dtype:
    """The dtype a 1-D grid's partial sum crosses the wire in: under autocast with `narrow`
    (strategy.tensor_collective_dtype=compute) the compute dtype, as Megatron-LM all-reduces its
    row-parallel outputs in the params dtype (megatron/core/tensor_parallel/mappings.py `_reduce`:
    torch.distributed.all_reduce(input_) on the bf16/fp16 activation); else fp32 (float64 stays).
    Read in the forward, where autocast is on, and kept for the backward, where it is not."""
    if tensor.dtype == torch.float64:
        return torch.float64
    device = tensor.device.type
    return torch.get_autocast_dtype(device) if narrow and torch.is_autocast_enabled(device) else torch.float32


class GatherMatmulScatter(torch.autograd.Function):
    """Y = scatter_sum_y( gather_x(X) · gather_w(W) ), the linear of the 2-D and 3-D grids.

    Backward mirrors it (docs/strategies/three_d.md): dY is gathered where Y was scattered; dX = dY·Wᵀ is
    summed-and-scattered where X was gathered; dW = Xᵀ·dY likewise where W was gathered. The
    gathered X and W are saved, so the backward repeats no forward gather. A spec is
    (group, dim) or None (no collective); W is stored [in, out].
    """

    @staticmethod
    def forward(context, x, weight, communicator, x_spec, w_spec, y_spec):
        # Under autocast, cast before gathering, as autocast casts a linear's inputs: the gathers
        # then move compute-dtype bytes. Partial sums are added in fp32 (one rounding, as inside
        # the unsharded matrix product), then rounded to the compute dtype autocast would return.
        dtype = compute_dtype(x)
        x_full = gather(communicator, x.to(dtype), *x_spec) if x_spec else x.to(dtype)
        w_full = gather(communicator, weight.to(dtype), *w_spec) if w_spec else weight.to(dtype)
        context.save_for_backward(x_full, w_full)
        context.specs = (communicator, x_spec, w_spec, y_spec)
        y_partial = x_full @ w_full
        return summed(communicator, y_partial, y_spec).to(dtype)

    @staticmethod
    def backward(context, grad_y):
        x_full, w_full = context.saved_tensors
        communicator, x_spec, w_spec, y_spec = context.specs
        grad_y = grad_y.to(x_full.dtype).contiguous()
        grad_full = gather(communicator, grad_y, *y_spec) if y_spec else grad_y
        grad_x = grad_full @ w_full.t()
        grad_w = x_full.reshape(-1, x_full.shape[-1]).t() @ grad_full.reshape(-1, grad_full.shape[-1])
        # autograd casts each gradient back to its input's dtype (fp32 masters stay fp32)
        return summed(communicator, grad_x, x_spec), summed(communicator, grad_w, w_spec), None, None, None, None


def summed(communicator, partial: torch.Tensor, spec) -> torch.Tensor:
    """Reduce-scatter partial products in fp32 where a spec says so (else: the partial itself)."""
    if not spec:
        return partial
    return scatter_sum(communicator, partial.float() if partial.dtype != torch.float64 else partial, *spec)


class GroupSum(torch.autograd.Function):
    """Σ over a group in the forward, the backward, or both (Megatron's f and g, and their union).

    f = copy_to_group: identity forward; the replicated input's gradient is summed backward.
    g = reduce_from_group: partial sums are added forward; the replicated output's gradient passes.
    sum_over_group: every member uses y = Σ x on its own data, so dx = Σ dy.
    """

    @staticmethod
    def forward(context, x, communicator, group, sum_forward: bool, sum_backward: bool, narrow: bool = False):
        context.communicator, context.group, context.sum_backward = communicator, group, sum_backward
        context.wire = wire_dtype(x, narrow)  # autocast is off in the backward: read it here
        return sum_copy(communicator, x, group, context.wire) if sum_forward else x.view_as(x)

    @staticmethod
    def backward(context, grad_y):
        grad_x = sum_copy(context.communicator, grad_y, context.group, context.wire) if context.sum_backward else grad_y
        return grad_x, None, None, None, None, None


def copy_to_group(x, communicator, group, narrow: bool = False):
    return GroupSum.apply(x, communicator, group, False, True, narrow)


def reduce_from_group(x, communicator, group, narrow: bool = False):
    return GroupSum.apply(x, communicator, group, True, False, narrow)


def sum_over_group(x, communicator, group):
    return GroupSum.apply(x, communicator, group, True, True)


class VocabularyParallelCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy of logits split by vocabulary over `group` (Megatron's algorithm).

    max, Σexp and the target's logit are combined over the group (3 small all-reduces); the
    backward needs no communication: d logits = softmax − onehot on this member's columns.
    Rows whose target is outside this member's columns contribute 0 to its target logit.
    """

    @staticmethod
    def forward(context, logits, targets, offset, communicator, group):
        logits = logits.float()
        maximum = logits.max(dim=-1).values
        communicator.all_reduce(maximum, group, op=torch.distributed.ReduceOp.MAX)
        shifted = logits - maximum.unsqueeze(-1)
        exponentials = shifted.exp()
        total = sum_in_place(communicator, exponentials.sum(-1), group)
        local = targets - offset
        mine = (local >= 0) & (local < logits.shape[-1])
        picked = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        target_logit = sum_in_place(communicator, picked * mine, group)
        context.save_for_backward(exponentials / total.unsqueeze(-1), local, mine)
        return total.log() - target_logit

    @staticmethod
    def backward(context, grad_loss):
        softmax, local, mine = context.saved_tensors
        # −1 at each row's target column, 0 where the target is another member's: a scatter of
        # the mask, not torch.nonzero, whose output size the host would have to wait for
        columns = local.clamp(0, softmax.shape[-1] - 1).unsqueeze(-1)
        grad = softmax.scatter_add(-1, columns, -mine.to(softmax.dtype).unsqueeze(-1))
        return grad * grad_loss.unsqueeze(-1), None, None, None, None
