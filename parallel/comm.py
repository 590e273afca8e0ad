"""The one place every collective and point-to-point call passes through, counted logically.

Logical volume (docs/evidence.md, `comm_bytes_per_step`): per process, for a full tensor of N elements on a group of
g ranks, all-reduce moves 2(g-1)/g·N, all-gather and reduce-scatter (g-1)/g·N, broadcast and
send/recv N, all-to-all the elements this process sends to the *other* ranks (variable splits: the
rows it keeps for itself never leave it; cost/traffic.py `expert_dispatch_traffic`). We count these, not the wire bytes: gloo on CPU may implement a reduce-scatter as an
all-reduce, which changes what crosses the wire but not the algorithm's volume.

Strict point-to-point mode (`record_point_to_point`, switched on by trainer.check_point_to_point_order
and in every multi-process test): each rank records the sends and receives it issues, in issue order,
and `check_point_to_point_order` checks what NCCL needs (docs/architecture.md, "Point-to-point order"):
1. NCCL matches a pair's operations in issue order and ignores tags, so the k-th operation of rank a
   toward b must be the other end of the k-th of b toward a, with the same size and dtype; gloo
   matches by tag and would hide the mismatch. The tag is compared too: two same-sized messages
   swapped would run on NCCL, into the wrong buffers.
2. Where the group's sends and receives share its one communicator (torch 2.11-2.13 with an eagerly
   initialised group: Lightning passes `device_id` on GPUs), a rank runs them one after another in
   issue order across all its peers, so no cycle of ranks may each wait for the next
   (parallel/rendezvous.py). A run that passes this also runs on a communicator per pair (torch
   without device_id), whose streams order less.
3. Collectives (all-reduce, all-gather, reduce-scatter, broadcast, all-to-all) on one group run on
   its one communicator, which NCCL matches by issue order: every member must issue the group's
   collectives in the same sequence, with the same kind, dtype and size (an all-to-all: what rank a
   sends to b is what b expects from a). gloo matches these too, but a mismatch in a group whose
   messages happen to have equal sizes runs here and mixes or deadlocks on GPUs. Each rank records
   its collectives per communicator (`IssuedCollective`, keyed by `Group.channel`: groups that share
   a process group, e.g. `expert` = `data` at e = d, share one sequence) and the check compares the
   members' sequences.

Flight record (`recorder`, a parallel.flight.FlightRecorder, set by the run's watchdog): every
operation issued here is recorded, and every wait on it (a synchronous call, or `wait()` on the
returned handle) is the rank's current wait while it blocks (docs/faults.md, "When it hangs").
"""

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from parallel import compat
from parallel.rendezvous import waiting_cycle

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "broadcast", "host_device", "all_to_all")


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
    # the communicator it runs on, by the name of the group that made it ("world" for the default
    # group): a joint group reusing an axis's process group shares that axis's order (rule 3)
    channel: Optional[str] = None

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


class IssuedCollective(NamedTuple):
    """One collective as a rank issued it on a group (rule 3 of the module docstring). `sends` and
    `receives` are the elements toward / from each member in group order (all-to-all only)."""

    group: str
    ranks: tuple
    kind: str
    elements: int
    dtype: str
    sends: tuple = ()
    receives: tuple = ()

    def __str__(self) -> str:
        sizes = f", sends {list(self.sends)}, receives {list(self.receives)}" if self.kind == "all_to_all" else ""
        return f"{self.kind} on {self.group} {list(self.ranks)}: {self.elements} × {self.dtype}{sizes}"


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
        self.issued = None  # [IssuedOperation] toward every peer, in issue order, while recording
        self.collectives = None  # [IssuedCollective] on every group, in issue order, while recording
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
        return self._recorded("all_gather", group, output, async_op, lambda: compat.all_gather_single(
            output, shard, group=group.process_group, async_op=async_op))

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, group: Group,
                       op=dist.ReduceOp.SUM, async_op=False):
        if group.size == 1:
            shard.copy_(full)
            return None
        self._counted("reduce_scatter", group, full)
        return self._recorded("reduce_scatter", group, full, async_op, lambda: compat.reduce_scatter_single(
            shard, full, op=op, group=group.process_group, async_op=async_op))

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, output_splits, input_splits, group: Group,
                   async_op=False):
        """Send `input_splits[i]` rows of `tensor` (dim 0, in order) to the group's i-th member and
        receive `output_splits[i]` rows from it into `output`, in member order (variable splits:
        torch.distributed.all_to_all_single). Counted: the elements sent to the other members."""
        output_splits, input_splits = [int(n) for n in output_splits], [int(n) for n in input_splits]
        if group.size == 1:
            output.copy_(tensor)
            return None
        row = math.prod(tensor.shape[1:])  # elements per row (a member may send or get no rows)
        me = group.ranks.index(dist.get_rank())
        self.count("all_to_all", group.name, (sum(input_splits) - input_splits[me]) * row, tensor.element_size(),
                   group.size)
        sizes = (tuple(n * row for n in input_splits), tuple(n * row for n in output_splits))
        return self._recorded("all_to_all", group, tensor, async_op, lambda: dist.all_to_all_single(
            output, tensor, output_split_sizes=output_splits, input_split_sizes=input_splits,
            group=group.process_group, async_op=async_op), sizes=sizes)

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
    def _recorded(self, kind: str, group: Group, tensor: torch.Tensor, async_op: bool, call, sizes=((), ())):
        """Run `call` (the collective) recorded: a synchronous call is a wait; an asynchronous
        one returns a handle whose wait is. In strict mode it is also kept for rule 3 (`sizes`: an
        all-to-all's elements toward and from each member)."""
        if self.collectives is not None:
            self.collectives.append(IssuedCollective(group.channel or group.name, tuple(group.ranks), kind,
                                                     tensor.numel(), str(tensor.dtype), *sizes))
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
        """Start recording every send and receive this rank issues, in issue order (all peers in one list:
        on a shared communicator the order across peers matters)."""
        if self.issued is None:
            self.issued = []
        if self.collectives is None:  # rule 3: the groups' collectives too
            self.collectives = []

    def _record(self, kind: str, peer: int, tensor: torch.Tensor, tag: int) -> None:
        if self.issued is not None:
            self.issued.append(IssuedOperation(kind, peer, tensor.numel(), str(tensor.dtype), tag))

    def check_point_to_point_order(self) -> int:
        """Check what every rank issued since the last check (both rules of the module docstring);
        clear the record.

        Collective over the whole world (call it on every rank at the same point, e.g. each step's
        end). The exchange is evidence, not training traffic: it is not counted. Raises
        PointToPointOrderError on every rank, naming the pair, k and both operations at the first
        mismatch, or the ranks of a cycle and each one's waiting operation. Returns the number of
        operations checked on this rank.
        """
        if self.issued is None:
            return 0
        mine = (list(self.issued), list(self.collectives or ()))
        self.issued.clear()
        if self.collectives is not None:
            self.collectives.clear()
        everyone = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            if self.recorder is None:
                dist.all_gather_object(everyone, mine)
            else:  # a rank may wait here too: record it (the world group, as objects)
                world = tuple(range(dist.get_world_size()))
                with self.recorder.waiting(self.recorder.issue("all_gather_object", "world", world)):
                    dist.all_gather_object(everyone, mine)
        problem = (first_order_mismatch([issued for issued, _ in everyone])
                   or first_collective_mismatch([collectives for _, collectives in everyone]))
        if problem is not None:
            raise PointToPointOrderError(problem)
        return len(mine[0])

    def host_device(self, tensor: torch.Tensor, group_name: str = "host"):
        """Count one host<->device copy of `tensor` (L2L's transfers)."""
        self.count("host_device", group_name, tensor.numel(), tensor.element_size(), 1)


def first_order_mismatch(issued_by_rank: list) -> Optional[str]:
    """What NCCL could not run in what the ranks issued (module docstring), or None.

    `issued_by_rank[r]` is the IssuedOperations rank r issued, toward every peer, in issue order.
    First each pair (rule 1): the first pair of ranks whose k-th operations toward each other are
    not one message's two ends (opposite kinds, same elements, dtype and tag; equal lengths). Then
    the whole group (rule 2): the ranks of a cycle each waiting for the next, if the operations
    cannot all run one after another per rank (parallel/rendezvous.py).
    """
    by_pair = [_by_peer(issued) for issued in issued_by_rank]
    for rank, issued in enumerate(by_pair):
        for peer in sorted(issued):
            if not 0 <= peer < len(issued_by_rank):
                return f"rank {rank} issued {issued[peer][0]}, a rank outside the {len(issued_by_rank)} compared"
            if peer > rank or rank not in by_pair[peer]:
                problem = _pair_mismatch(rank, peer, issued[peer], by_pair[peer].get(rank, []))
                if problem is not None:
                    return problem
    return _cycle_across_peers(issued_by_rank)


def first_collective_mismatch(collectives_by_rank: list) -> Optional[str]:
    """Rule 3 of the module docstring, or None: `collectives_by_rank[r]` is the IssuedCollectives
    rank r issued, in issue order. Per group (its name and members), the members' sequences must be
    equally long and agree at every position in kind, dtype and size; at an all-to-all, what member
    a sends to b must be what b receives from a."""
    by_group = defaultdict(dict)  # (name, ranks) -> {rank: [IssuedCollective]}
    for rank, issued in enumerate(collectives_by_rank):
        for collective in issued:
            by_group[(collective.group, collective.ranks)].setdefault(rank, []).append(collective)
    for (name, ranks), sequences in sorted(by_group.items()):
        members = [rank for rank in ranks if rank < len(collectives_by_rank)]
        for index in range(max(len(sequences.get(rank, [])) for rank in members)):
            at = {rank: (sequences.get(rank, []) + [None] * (index + 1))[index] for rank in members}
            problem = _collective_mismatch(name, ranks, index, at)
            if problem is not None:
                return problem
    return None


def _collective_mismatch(name: str, ranks: tuple, index: int, at: dict) -> Optional[str]:
    """The members' `index`-th collectives on one group (`at`: rank -> IssuedCollective or None)."""
    first_rank = min(at)
    first = at[first_rank]
    for rank, collective in at.items():
        same = (first is not None and collective is not None and collective.kind == first.kind
                and collective.dtype == first.dtype
                and (first.kind == "all_to_all" or collective.elements == first.elements))
        if not same:
            return (f"collective order mismatch on group {name} {list(ranks)} at collective #{index}: rank {first_rank} "
                    f"issued {first or 'nothing'}, rank {rank} issued {collective or 'nothing'}. NCCL runs a group's "
                    f"collectives in issue order on its one communicator, so every member must issue the same "
                    f"sequence; this run would mix messages or deadlock on GPUs.")
    if first.kind == "all_to_all":
        for a, sender in at.items():
            for b, receiver in at.items():
                i, j = ranks.index(a), ranks.index(b)
                if sender.sends[j] != receiver.receives[i]:
                    return (f"all-to-all sizes disagree on group {name} {list(ranks)} at collective #{index}: rank {a} "
                            f"sends {sender.sends[j]} elements to rank {b}, which expects {receiver.receives[i]}.")
    return None


def _by_peer(issued: list) -> dict:
    """peer -> the operations toward it, in issue order."""
    by_peer = defaultdict(list)
    for operation in issued:
        by_peer[operation.peer].append(operation)
    return by_peer


def _cycle_across_peers(issued_by_rank: list) -> Optional[str]:
    """Rule 2, once every pair matches: the k-th operation of a toward b and of b toward a are one
    message, keyed (a, b, k) on both sides."""
    sequences = {}
    for rank, issued in enumerate(issued_by_rank):
        count = defaultdict(int)
        sequences[rank] = []
        for operation in issued:
            sequences[rank].append((operation.peer, (min(rank, operation.peer), max(rank, operation.peer),
                                                     count[operation.peer])))
            count[operation.peer] += 1
    stuck = waiting_cycle(sequences)
    if stuck is None:
        return None
    cycle, heads = stuck
    waiting = "; ".join(f"rank {rank} issued {issued_by_rank[rank][heads[rank]]}" for rank in cycle[:-1])
    return (f"point-to-point operations across peers: ranks {' → '.join(map(str, cycle))} wait in a cycle, "
            f"each at an operation toward the next that the next issued only after its own ({waiting}). "
            f"Every pair matches, but where a group's sends and receives share its one NCCL communicator "
            f"(torch 2.11-2.13 with device_id, as Lightning passes on GPUs) a rank runs them one after "
            f"another across its peers, so this run would deadlock on GPUs; gloo hid it.")


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
