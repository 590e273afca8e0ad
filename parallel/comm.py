"""The one place every collective and point-to-point call passes through, counted logically.

Logical volume (docs/evidence.md, `comm_bytes_per_step`): per process, for a full tensor of N elements on a group of
g ranks, all-reduce moves 2(g-1)/g·N, all-gather and reduce-scatter (g-1)/g·N, broadcast and
send/recv N. We count these, not the wire bytes: gloo on CPU may implement a reduce-scatter as an
all-reduce, which changes what crosses the wire but not the algorithm's volume.

Strict point-to-point mode (`record_point_to_point`, switched on by trainer.check_point_to_point_order
and in every multi-process test): each rank records the sends and receives it issues, per peer, and
`check_point_to_point_order` compares both sides of every pair. NCCL matches a pair's operations in
issue order and ignores tags, so the k-th operation of rank a toward b must be the other end of the
k-th of b toward a, with the same size and dtype; gloo matches by tag and would hide the mismatch.
The tag is compared too: two same-sized messages swapped would run on NCCL, into the wrong buffers.

Flight record (`recorder`, a parallel.flight.FlightRecorder, set by the run's watchdog): every
operation issued here is recorded, and every wait on it (a synchronous call, or `wait()` on the
returned handle) is the rank's current wait while it blocks (docs/faults.md, "When it hangs").
"""

from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple, Optional

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


class IssuedOperation(NamedTuple):
    """One send or receive as a rank issued it: what NCCL matches against the peer's operation."""

    kind: str  # "send" | "receive"
    peer: int  # global rank of the other end
    elements: int
    dtype: str
    tag: int

    def __str__(self) -> str:
        direction = "to" if self.kind == "send" else "from"
        return f"{self.kind} {direction} rank {self.peer}: {self.elements} × {self.dtype}, tag {self.tag}"


class PointToPointOrderError(RuntimeError):
    """Two ranks issued their point-to-point operations in orders NCCL would mismatch or deadlock on."""


class Communicator:
    """Counted wrappers over torch.distributed; bytes are kept by kind and by group name.

    With `record_point_to_point()`, sends and receives are also recorded in issue order per peer
    (`issued`), for `check_point_to_point_order` (the module docstring says why).
    """

    def __init__(self):
        self.bytes_by_kind = defaultdict(float)
        self.bytes_by_group = defaultdict(float)
        self.calls_by_kind = defaultdict(int)
        self.issued = None  # peer -> [IssuedOperation] in issue order, while recording
        self.recorder = None  # a FlightRecorder while a run's watchdog watches this rank

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
        return self._recorded("all_reduce", group, tensor, async_op, lambda: dist.all_reduce(
            tensor, op=op, group=group.process_group, async_op=async_op))

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, group: Group, async_op=False):
        """Gather equal shards along dim 0 into `output` (the full tensor is what is counted)."""
        if group.size == 1:
            output.copy_(shard)
            return None
        self._counted("all_gather", group, output)
        return self._recorded("all_gather", group, output, async_op, lambda: dist.all_gather_single(
            output, shard, group=group.process_group, async_op=async_op))

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, group: Group,
                       op=dist.ReduceOp.SUM, async_op=False):
        if group.size == 1:
            shard.copy_(full)
            return None
        self._counted("reduce_scatter", group, full)
        return self._recorded("reduce_scatter", group, full, async_op, lambda: dist.reduce_scatter_single(
            shard, full, op=op, group=group.process_group, async_op=async_op))

    def broadcast(self, tensor: torch.Tensor, source: int, group: Group, async_op=False):
        """Broadcast from global rank `source` to the group."""
        if group.size == 1:
            return None
        self._counted("broadcast", group, tensor)
        return self._recorded("broadcast", group, tensor, async_op, lambda: dist.broadcast(
            tensor, src=source, group=group.process_group, async_op=async_op))

    def send(self, tensor: torch.Tensor, destination: int, group: Group, tag: int = 0):
        """Post an asynchronous send to global rank `destination`; returns the work handle.

        A distinct `tag` per message lets a receiver take messages in any order: one channel
        between two ranks may carry activations one way and gradients the other, interleaved.
        """
        self.count("send_recv", group.name, tensor.numel(), tensor.element_size(), 2)
        self._record("send", destination, tensor, tag)
        work = dist.isend(tensor, dst=destination, group=group.process_group, tag=tag)
        return self._recorded_point_to_point("send", group, destination, tensor, work)

    def receive(self, tensor: torch.Tensor, source: int, group: Group, tag: int = 0):
        """Post a receive from global rank `source`; wait on the returned handle before use.
        Only the sender's side is counted."""
        self._record("receive", source, tensor, tag)
        work = dist.irecv(tensor, src=source, group=group.process_group, tag=tag)
        return self._recorded_point_to_point("receive", group, source, tensor, work)

    # ----- flight record
    def _recorded(self, kind: str, group: Group, tensor: torch.Tensor, async_op: bool, call):
        """Run `call` (the collective) recorded: a synchronous call is a wait; an asynchronous
        one returns a handle whose wait is."""
        if self.recorder is None:
            return call()
        operation = self.recorder.issue(kind, group.name, group.ranks,
                                        nbytes=tensor.numel() * tensor.element_size())
        if async_op:
            return self.recorder.track(operation, call())
        with self.recorder.waiting(operation):
            return call()

    def _recorded_point_to_point(self, kind: str, group: Group, peer: int, tensor: torch.Tensor, work):
        if self.recorder is None:
            return work
        operation = self.recorder.issue(kind, group.name, group.ranks, peer=peer,
                                        nbytes=tensor.numel() * tensor.element_size())
        return self.recorder.track(operation, work)

    # ----- strict point-to-point mode
    def record_point_to_point(self) -> None:
        """Start recording every send and receive this rank issues, per peer, in issue order."""
        if self.issued is None:
            self.issued = defaultdict(list)

    def _record(self, kind: str, peer: int, tensor: torch.Tensor, tag: int) -> None:
        if self.issued is not None:
            self.issued[peer].append(IssuedOperation(kind, peer, tensor.numel(), str(tensor.dtype), tag))

    def check_point_to_point_order(self) -> int:
        """Compare what every rank issued toward every peer since the last check; clear the record.

        Collective over the whole world (call it on every rank at the same point, e.g. each step's
        end). The exchange is evidence, not training traffic: it is not counted. Raises
        PointToPointOrderError on every rank, naming the pair, k and both operations, at the first
        mismatch. Returns the number of operations compared on this rank.
        """
        if self.issued is None:
            return 0
        mine = {peer: list(operations) for peer, operations in self.issued.items()}
        self.issued.clear()
        everyone = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            if self.recorder is None:
                dist.all_gather_object(everyone, mine)
            else:  # a rank may wait here too: record it (the world group, as objects)
                world = tuple(range(dist.get_world_size()))
                with self.recorder.waiting(self.recorder.issue("all_gather_object", "world", world)):
                    dist.all_gather_object(everyone, mine)
        problem = first_order_mismatch(everyone)
        if problem is not None:
            raise PointToPointOrderError(problem)
        return sum(len(operations) for operations in mine.values())

    def host_device(self, tensor: torch.Tensor, group_name: str = "host"):
        """Count one host<->device copy of `tensor` (L2L's transfers)."""
        self.count("host_device", group_name, tensor.numel(), tensor.element_size(), 1)


def first_order_mismatch(issued_by_rank: list) -> Optional[str]:
    """The first pair of ranks whose k-th operations toward each other are not one message's two ends.

    `issued_by_rank[r]` maps each peer to the IssuedOperations rank r issued toward it, in order.
    None when every pair matches: opposite kinds, same elements, dtype and tag, equal lengths.
    """
    for rank, issued in enumerate(issued_by_rank):
        for peer in sorted(issued):
            if not 0 <= peer < len(issued_by_rank):
                return f"rank {rank} issued {issued[peer][0]}, a rank outside the {len(issued_by_rank)} compared"
            if peer > rank or rank not in issued_by_rank[peer]:
                problem = _pair_mismatch(rank, peer, issued[peer], issued_by_rank[peer].get(rank, []))
                if problem is not None:
                    return problem
    return None


def _pair_mismatch(rank: int, peer: int, mine: list, theirs: list) -> Optional[str]:
    for index in range(max(len(mine), len(theirs))):
        first = mine[index] if index < len(mine) else None
        second = theirs[index] if index < len(theirs) else None
        if first is None or second is None or not _match(first, second):
            return (f"point-to-point order mismatch between ranks {rank} and {peer} at operation #{index}: "
                    f"rank {rank} issued {first or 'nothing'}, rank {peer} issued {second or 'nothing'}. "
                    f"NCCL matches a pair's sends and receives in issue order (tags ignored), so this run "
                    f"would pair the wrong messages or deadlock on GPUs; gloo hid it by matching tags.")
    return None


def _match(first: IssuedOperation, second: IssuedOperation) -> bool:
    return {first.kind, second.kind} == {"send", "receive"} and first[2:] == second[2:]
