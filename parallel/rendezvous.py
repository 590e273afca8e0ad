"""Whether ranks that each run their point-to-point operations in issue order, one at a time, finish.

Where a process group's sends and receives share the group's one NCCL communicator (torch 2.11-2.13
once the group is eagerly initialised, e.g. by `init_process_group(device_id=...)`, which Lightning
passes on GPUs; docs/architecture.md, "Point-to-point order"), PyTorch enqueues every one of them on
that communicator's one stream, so a rank's operation k+1 toward any peer starts only after its
operation k finished, and a send finishes only once its receive runs (NCCL gives no buffering
guarantee). The run finishes exactly when this game does: repeatedly take two ranks whose next
operations are the two ends of one message, and retire both. Taking any ready pair is as good as any
other (retiring one never blocks another), so one pass over a worklist decides it; what is left, if
anything, contains a cycle of ranks each waiting for the next.

Used on plans (strategies/schedule/point_to_point.py) and on what real ranks issued (parallel/comm.py).
Pure Python: nothing here imports torch.
"""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence

__all__ = ["retire", "waiting_cycle"]


def retire(sequences: Mapping[int, Sequence[tuple[int, Hashable]]]) -> tuple[list, dict]:
    """(the messages in an order they can retire, {rank: index of its first operation that never
    ran} for the ranks left stuck). `sequences[rank]` is what `rank` issues, in order, each as
    (peer, message): the two ends of a message carry the same `message` key."""
    heads = {rank: 0 for rank in sequences}
    retired, worklist = [], list(sequences)
    while worklist:
        rank = worklist.pop()
        peer = _ready_peer(sequences, heads, rank)
        if peer is not None:
            retired.append(sequences[rank][heads[rank]][1])
            heads[rank] += 1
            heads[peer] += 1
            worklist += [rank, peer]
    return retired, {rank: head for rank, head in heads.items() if head < len(sequences[rank])}


def waiting_cycle(sequences: Mapping[int, Sequence[tuple[int, Hashable]]]) -> tuple[list[int], dict] | None:
    """None if every rank's operations retire (`retire`); else (cycle, heads): `cycle` is
    [r0, r1, ..., r0], each rank's next operation toward the following rank, whose next operation
    is another one; `heads[rank]` is the index of each stuck rank's first operation that never ran."""
    _, stuck = retire(sequences)
    return None if not stuck else (_cycle(sequences, stuck, min(stuck)), stuck)


def _ready_peer(sequences, heads: dict, rank: int) -> int | None:
    """The peer whose next operation is the other end of `rank`'s next one, if it is."""
    if heads[rank] >= len(sequences[rank]):
        return None
    peer, message = sequences[rank][heads[rank]]
    theirs = sequences.get(peer, ())
    head = heads.get(peer, 0)
    return peer if head < len(theirs) and theirs[head] == (rank, message) else None


def _cycle(sequences, stuck: dict, start: int) -> list[int]:
    """Follow "waits for the peer of its next operation" from `start` until a rank repeats.

    Every stuck rank waits for a peer that is stuck too, or that finished without the other end
    (a per-pair mismatch, which callers report first): then the chain ends at that peer.
    """
    path, seen = [start], {start: 0}
    while True:
        peer = sequences[path[-1]][stuck[path[-1]]][0]
        if peer in seen:
            return path[seen[peer]:] + [peer]
        if peer not in stuck:
            return path + [peer]
        seen[peer] = len(path)
        path.append(peer)
