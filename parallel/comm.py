"""The one place every collective and point-to-point call passes through, counted logically.

Logical volume (TECHNIQUES.md, notation): per process, for a full tensor of N elements on a group of
g ranks, all-reduce moves 2(g-1)/g·N, all-gather and reduce-scatter (g-1)/g·N, broadcast and
send/recv N. We count these, not the wire bytes: gloo on CPU may implement a reduce-scatter as an
all-reduce, which changes what crosses the wire but not the algorithm's volume.
"""

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "broadcast", "host_device")


def ring_factor(kind: str, group_size: int) -> float:
    """Per-process traffic of one collective as a multiple of the full tensor's size."""
    if group_size <= 1 and kind != "host_device":
        return 0.0
    if kind == "all_reduce":
        return 2 * (group_size - 1) / group_size
    if kind in ("all_gather", "reduce_scatter"):
        return (group_size - 1) / group_size
    return 1.0


@dataclass(frozen=True)
class Group:
    """A named process group: `name` is its family (data, pipeline, ...), `ranks` its members."""

    name: str
    ranks: tuple
    process_group: Optional[object] = None  # None when the group is this rank alone

    @property
    def size(self) -> int:
        return len(self.ranks)


class Communicator:
    """Counted wrappers over torch.distributed; bytes are kept by kind and by group name."""

    def __init__(self):
        self.bytes_by_kind = defaultdict(float)
        self.bytes_by_group = defaultdict(float)
        self.calls_by_kind = defaultdict(int)

    def count(self, kind: str, group_name: str, elements: int, element_size: int, group_size: int):
        volume = elements * element_size * ring_factor(kind, group_size)
        self.bytes_by_kind[kind] += volume
        self.bytes_by_group[group_name] += volume
        self.calls_by_kind[kind] += 1

    def reset(self) -> None:
        self.bytes_by_kind.clear()
        self.bytes_by_group.clear()
        self.calls_by_kind.clear()

    def snapshot(self) -> dict:
        """Bytes per kind since the last reset, every kind present (0.0 when unused)."""
        return {kind: float(self.bytes_by_kind.get(kind, 0.0)) for kind in KINDS}

    def _counted(self, kind: str, group: Group, tensor: torch.Tensor, elements: int = None):
        self.count(kind, group.name, tensor.numel() if elements is None else elements,
                   tensor.element_size(), group.size)

    def all_reduce(self, tensor: torch.Tensor, group: Group, op=dist.ReduceOp.SUM, async_op=False):
        if group.size == 1:
            return None
        self._counted("all_reduce", group, tensor)
        return dist.all_reduce(tensor, op=op, group=group.process_group, async_op=async_op)

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, group: Group, async_op=False):
        """Gather equal shards along dim 0 into `output` (the full tensor is what is counted)."""
        if group.size == 1:
            output.copy_(shard)
            return None
        self._counted("all_gather", group, output)
        return dist.all_gather_into_tensor(output, shard, group=group.process_group,
                                           async_op=async_op)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, group: Group,
                       op=dist.ReduceOp.SUM, async_op=False):
        if group.size == 1:
            shard.copy_(full)
            return None
        self._counted("reduce_scatter", group, full)
        return dist.reduce_scatter_tensor(shard, full, op=op, group=group.process_group,
                                          async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, source: int, group: Group, async_op=False):
        """Broadcast from global rank `source` to the group."""
        if group.size == 1:
            return None
        self._counted("broadcast", group, tensor)
        return dist.broadcast(tensor, src=source, group=group.process_group, async_op=async_op)

    def send(self, tensor: torch.Tensor, destination: int, group: Group, tag: int = 0):
        """Post an asynchronous send to global rank `destination`; returns the work handle.

        A distinct `tag` per message lets a receiver take messages in any order: one channel
        between two ranks may carry activations one way and gradients the other, interleaved.
        """
        self.count("send_recv", group.name, tensor.numel(), tensor.element_size(), 2)
        return dist.isend(tensor, dst=destination, group=group.process_group, tag=tag)

    def receive(self, tensor: torch.Tensor, source: int, group: Group, tag: int = 0):
        """Post a receive from global rank `source`; wait on the returned handle before use.
        Only the sender's side is counted."""
        return dist.irecv(tensor, src=source, group=group.process_group, tag=tag)

    def host_device(self, tensor: torch.Tensor, group_name: str = "host"):
        """Count one host<->device copy of `tensor` (L2L's transfers)."""
        self.count("host_device", group_name, tensor.numel(), tensor.element_size(), 1)
