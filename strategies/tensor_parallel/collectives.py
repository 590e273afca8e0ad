"""Counted collectives along any dimension, and the autograd functions tensor parallelism uses.

Everything passes through the layout's Communicator (so the bytes are counted, DESIGN.md §9).
torch's all_gather_into_tensor / reduce_scatter_tensor work on dim 0; `gather` and `scatter_sum`
move the wanted dimension to the front and back. A group of one is the identity.
"""

import torch


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


class GatherMatmulScatter(torch.autograd.Function):
    """Y = scatter_sum_y( gather_x(X) · gather_w(W) ), the linear of the 2-D and 3-D grids.

    Backward mirrors it (TECHNIQUES §4): dY is gathered where Y was scattered; dX = dY·Wᵀ is
    summed-and-scattered where X was gathered; dW = Xᵀ·dY likewise where W was gathered. The
    gathered X and W are saved, so the backward repeats no forward gather. A spec is
    (group, dim) or None (no collective); W is stored [in, out].
    """

    @staticmethod
    def forward(context, x, weight, communicator, x_spec, w_spec, y_spec):
        x_full = gather(communicator, x, *x_spec) if x_spec else x
        w_full = gather(communicator, weight, *w_spec) if w_spec else weight
        context.save_for_backward(x_full, w_full)
        context.specs = (communicator, x_spec, w_spec, y_spec)
        y_partial = x_full @ w_full
        return scatter_sum(communicator, y_partial, *y_spec) if y_spec else y_partial

    @staticmethod
    def backward(context, grad_y):
        x_full, w_full = context.saved_tensors
        communicator, x_spec, w_spec, y_spec = context.specs
        grad_full = gather(communicator, grad_y.contiguous(), *y_spec) if y_spec else grad_y
        grad_x = grad_full @ w_full.t()
        grad_w = x_full.reshape(-1, x_full.shape[-1]).t() @ grad_full.reshape(-1, grad_full.shape[-1])
        grad_x = scatter_sum(communicator, grad_x, *x_spec) if x_spec else grad_x
        grad_w = scatter_sum(communicator, grad_w, *w_spec) if w_spec else grad_w
        return grad_x, grad_w, None, None, None, None


class SumOverGroup(torch.autograd.Function):
    """y = Σ_group x on every member; each member uses y on its own data, so dx = Σ_group dy."""

    @staticmethod
    def forward(context, x, communicator, group):
        context.communicator, context.group = communicator, group
        return sum_in_place(communicator, x.clone(), group)

    @staticmethod
    def backward(context, grad_y):
        return sum_in_place(context.communicator, grad_y.clone(), context.group), None, None


class CopyToGroup(torch.autograd.Function):
    """Megatron's f: identity forward; the replicated input's gradient is summed backward."""

    @staticmethod
    def forward(context, x, communicator, group):
        context.communicator, context.group = communicator, group
        return x.view_as(x)

    @staticmethod
    def backward(context, grad_y):
        return sum_in_place(context.communicator, grad_y.clone(), context.group), None, None


class ReduceFromGroup(torch.autograd.Function):
    """Megatron's g: partial sums are added forward; the replicated output's gradient passes."""

    @staticmethod
    def forward(context, x, communicator, group):
        return sum_in_place(communicator, x.clone(), group)

    @staticmethod
    def backward(context, grad_y):
        return grad_y, None, None


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
        grad = softmax.clone()
        rows = torch.nonzero(mine).squeeze(-1)
        grad[rows, local[rows]] -= 1.0
        return grad * grad_loss.unsqueeze(-1), None, None, None, None
