"""Flat, padded ZeRO-3 shards of a group of tensors (docs/strategies/zero_layered.md: 1/n of weights, grads, optimizer).

A `FlatShard` replaces the parameters of some modules by plain leaf tensors whose data it swaps in
and out: the modules compute as before, the optimizer only ever sees the shard. Layout of a group
of tensors t_1..t_k, flattened in order and zero-padded to a multiple of n:

    full = [t_1 | t_2 | ... | t_k | pad]     (n·S elements)      rank r keeps full[r·S : (r+1)·S]

Everything here is one rank's view; the communicator is passed in (no global state).
"""

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Entry:
    """One original parameter inside a flat group: where it lives in the model and in the buffer."""

    name: str  # full name in the model ("blocks.3.attention.qkv.weight")
    shape: tuple
    offset: int  # first element in the unpadded flat layout

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


def owner(model: nn.Module, name: str):
    """(module, attribute) holding the parameter `name` of `model`."""
    path, _, attribute = name.rpartition(".")
    return model.get_submodule(path), attribute


class FlatShard:
    """A group of parameters held as this rank's 1/n flat shard; gathered only while computed.

    1. setup: flatten, pad to n·S, keep slice r as an nn.Parameter (the optimizer's); the modules'
       parameters become plain leaf tensors (empty between uses);
    2. gather → install: all-gather the shards into a fresh full buffer, point the leaves at it;
    3. gradients accumulate into one flat full buffer (the leaves' .grad are views of it), which is
       reduce-scattered (sum) into this rank's slice; the caller averages and accumulates.
    """

    def __init__(self, model: nn.Module, names: list, rank: int, size: int, matrix: bool, group=None):
        self.group = group  # where it is gathered and reduce-scattered (None: the caller's data group)
        offsets, entries = 0, []
        for name in names:
            shape = tuple(model.get_parameter(name).shape)
            entries.append(Entry(name, shape, offsets))
            offsets += entries[-1].numel
        self.entries, self.size, self.unpadded = entries, size, offsets
        self.shard_size = -(-offsets // size)  # ceil: every rank's slice has the same length
        device = model.get_parameter(names[0]).device
        local = self._local_slice(model, rank, device)
        # 2-D for a group of matrices, so optimizer parameter groups decay it as they decay matrices.
        self.parameter = nn.Parameter(local.view(1, -1) if matrix else local)
        self.leaves = [self._replace(model, entry, device) for entry in entries]
        self.full = None  # the installed full buffer, or None
        self.gradient = None  # the flat full gradient of the current backward run

    @torch.no_grad()
    def _local_slice(self, model: nn.Module, rank: int, device: torch.device) -> torch.Tensor:
        """Elements [r·S, (r+1)·S) of the padded flat layout, copied from the parameters overlapping
        them: the full flat group is never built, so cutting a stage needs no second copy of it."""
        start, end = rank * self.shard_size, (rank + 1) * self.shard_size
        local = torch.zeros(self.shard_size, device=device)  # the padding stays zero
        for entry in self.entries:
            first, last = max(start, entry.offset), min(end, entry.offset + entry.numel)
            if first < last:
                flat = model.get_parameter(entry.name).reshape(-1)
                local[first - start:last - start] = flat[first - entry.offset:last - entry.offset]
        return local

    @property
    def padded(self) -> int:
        return self.shard_size * self.size

    @staticmethod
    def _replace(model: nn.Module, entry: Entry, device: torch.device) -> torch.Tensor:
        module, attribute = owner(model, entry.name)
        del module._parameters[attribute]
        leaf = torch.empty(0, device=device).requires_grad_()
        setattr(module, attribute, leaf)  # a plain tensor attribute: the module computes with it
        return leaf

    # ----- weights
    def post_gather(self, communicator, group):
        """Start the all-gather of the shards into a fresh buffer; returns (work, buffer)."""
        full = torch.empty(self.padded, device=self.parameter.device)
        return communicator.all_gather(full, self.parameter.detach().view(-1), group, async_op=True), full

    def install(self, full: torch.Tensor) -> None:
        self.full = full
        for leaf, entry in zip(self.leaves, self.entries):
            leaf.data = full[entry.offset:entry.offset + entry.numel].view(entry.shape)

    def release(self) -> None:
        """Drop the full weights (saved activations refer to them by position, see ShardedStageWork)."""
        self.full = None
        for leaf in self.leaves:
            leaf.data = torch.empty(0, device=self.parameter.device)
            leaf.grad = None

    # ----- gradients
    def attach_gradients(self) -> None:
        """Backward accumulates in place into views of one flat buffer: no copy before the reduce-scatter.

        The buffer lives until the reduce-scatter takes it: a split backward's Ws of one stage span
        several runs (strategies/schedule/zero.py) and are reduce-scattered once, after the last."""
        if self.gradient is None:
            self.gradient = torch.zeros(self.padded, device=self.parameter.device)
        for leaf, entry in zip(self.leaves, self.entries):
            leaf.grad = self.gradient[entry.offset:entry.offset + entry.numel].view(entry.shape)

    def post_reduce_scatter(self, communicator, group):
        """Start summing the flat gradient into this rank's slice; returns (work, slice, full gradient)."""
        for leaf in self.leaves:
            leaf.grad = None
        gradient, self.gradient = self.gradient, None
        piece = torch.empty(self.shard_size, device=self.parameter.device)
        return communicator.reduce_scatter(piece, gradient, group, async_op=True), piece, gradient

    def accumulate(self, piece: torch.Tensor, replicas: int) -> None:
        """Average over replicas and add into the shard's gradient (depth-first adds m times)."""
        piece = piece.div_(replicas).view_as(self.parameter)
        if self.parameter.grad is None:
            self.parameter.grad = piece
        else:
            self.parameter.grad.add_(piece)

    # ----- checkpoints and export
    def describe(self) -> dict:
        return {"entries": [(e.name, e.shape, e.offset) for e in self.entries],
                "shard_size": self.shard_size, "size": self.size}


def unshard(description: dict, pieces: list) -> dict:
    """Full tensors by name from every rank's shard (in data-parallel rank order)."""
    full = torch.cat([piece.reshape(-1) for piece in pieces])
    return {name: full[offset:offset + torch.Size(shape).numel()].view(shape).clone()
            for name, shape, offset in description["entries"]}


class ShardContainer(nn.Module):
    """Holds the shard parameters under the model (so the task's optimizer sees exactly them) and
    records their layout as extra state, so a per-rank checkpoint can be consolidated offline."""

    def __init__(self, shards: dict):
        super().__init__()
        # (stage, kind) -> FlatShard, named "stage{stage}_{kind}" in the state dict (a module name
        # must be a string); the name is only ever written, never parsed back.
        self.shards = {f"stage{stage}_{kind}": shard for (stage, kind), shard in shards.items()}
        self.flat = nn.ParameterDict({name: shard.parameter for name, shard in self.shards.items()})

    def get_extra_state(self) -> dict:
        return {name: shard.describe() for name, shard in self.shards.items()}

    def set_extra_state(self, state: dict) -> None:
        if state != self.get_extra_state():
            raise ValueError("checkpoint shards were cut for another model or layout; resume with the "
                             "same model.*, strategy.* and hardware.devices_per_node")
