"""NCCL's point-to-point rules: where each receive is issued, and the check that the ranks agree.

NCCL matches the sends and receives between two ranks in the order each side *issues* them and
ignores tags. Which stream runs them depends on the communicator PyTorch picks
(docs/architecture.md, "Point-to-point order", cites the sources):
- a dedicated communicator per pair (torch without `device_id`, lazy initialisation): a rank's
  operations toward one peer run on one stream, one after the other;
- the group's one communicator (torch 2.11-2.13 once the group is eagerly initialised: Lightning
  passes `device_id` on GPUs, and every `new_group` inherits it): a rank's operations toward *all*
  its peers run on one stream, in issue order.
So two rules, both checked on every plan (`check_point_to_point_order`, called by `validate_plan`):
1. per pair: the k-th operation rank a issues toward rank b is the other end of the k-th operation
   b issues toward a, for every k; otherwise NCCL pairs the wrong messages (garbage, or a size
   mismatch) or waits for ever;
2. across peers: the ranks can run their operations one at a time in issue order, each a send
   meeting its receive (parallel/rendezvous.py): no cycle of ranks each waiting for the next. This
   is what one shared stream per rank needs, and it implies that a stream per pair finishes too.
Gloo matches by tag and hides both.

`add_receive_posts` makes every plan follow both and still post receives early (an early receive
lets the message land while the rank computes: GPipe went from 1.11x to 0.944x of
torch.pipelining's step time when receives were posted early):

1. one order of all the plan's messages (`message_order`): by the unit-cost simulated time each
   message's send is issued, then the time its receive is waited on, then sender and slot. Kahn's
   algorithm keeps each rank's fixed sends in list order and puts a message before any send its
   receiver issues after waiting on it (the dry run guarantees such an order exists: every
   ordering constraint is a happens-before of the dry run);
2. each receive is posted ("4f1←3") right after the rank's previous operation in that order,
   toward any peer; the RECV ("4F1←3") stays where the value is consumed and only waits. A post
   that would stand right before its own RECV is left out: the RECV issues and waits at once,
   which is the same order.
Every rank then issues a subsequence of one order, so the pairs agree (rule 1) and every wait
points forward in it (rule 2). Posting by each pair's order alone, as this pass once did, broke
rule 2 on rings of ranks (looped and interleaved placements with p >= 3: rank 0 posted its receive
from rank p-1 before its first send to rank 1, and every rank waited for the next).
No grouped calls (batch_isend_irecv) are needed: with posts in place, every plan the dry run
accepts has an order all ranks follow.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import heapq
from collections import defaultdict
from typing import NamedTuple

from parallel.rendezvous import retire, waiting_cycle

from .ir import (SEND_ARROW, Action, Plan, PlanError, counterpart, is_post, post_of, posted_receive)
from .simulate import simulate, unit_cost

__all__ = ["add_receive_posts", "check_point_to_point_order", "issue_order", "issue_sequences", "message_order",
           "most_sends_held", "pair_orders", "release_points", "send_completions", "send_releases"]


class Message(NamedTuple):
    """One point-to-point message of a plan, with where and when (unit cost) each end runs."""

    send: Action
    sender: int
    send_slot: int
    send_time: float
    receiver: int
    receive_slot: int
    receive_time: float


class Issued(NamedTuple):
    """One operation a rank issues toward a peer: the message's send (on the sender) or its receive."""

    slot: int
    action: Action  # the SEND, the post, or a RECV without a post
    message: Action  # the message's send action: the same on both sides


# -----------------------------------------------------------------------------
# One order of all the plan's messages


def message_order(plan: Plan) -> list[Message]:
    """Every message of the plan, in one order every rank's issue order follows (module docstring)."""
    return _common_order(_messages(plan))


def pair_orders(plan: Plan) -> dict[tuple[int, int], list[Message]]:
    """(a, b) with a < b -> every message between ranks a and b, in the order both sides issue them."""
    by_pair = defaultdict(list)
    for message in message_order(plan):
        by_pair[tuple(sorted((message.sender, message.receiver)))].append(message)
    return dict(sorted(by_pair.items()))


def _messages(plan: Plan) -> list[Message]:
    """Every send whose receive is in the plan, with the slots and unit-cost times of both ends."""
    where = {action: (rank, slot) for rank, slot, action in plan.positions()}
    timeline = simulate(_without_posts(plan), unit_cost)
    start = {record.action: record.start for row in timeline.ranks for record in row}
    messages = []
    for action, (rank, slot) in where.items():
        if action.info.arrow == SEND_ARROW and counterpart(action) in where:
            receiver, receive_slot = where[counterpart(action)]
            messages.append(Message(action, rank, slot, start[action], receiver, receive_slot,
                                    start[counterpart(action)]))
    return messages


def _common_order(messages: list[Message]) -> list[Message]:
    """Kahn's algorithm over the messages' ordering constraints, earliest send first among the ready."""
    successors, waiting = _constraints(messages)
    ready = [_priority(message) for message in messages if not waiting[message]]
    heapq.heapify(ready)
    order = []
    while ready:
        message = heapq.heappop(ready)[-1]
        order.append(message)
        for successor in successors[message]:
            waiting[successor] -= 1
            if not waiting[successor]:
                heapq.heappush(ready, _priority(successor))
    return order


def _priority(message: Message) -> tuple:
    return message.send_time, message.receive_time, message.sender, message.send_slot, message


def _constraints(messages: list[Message]) -> tuple[dict, dict]:
    """Edges "must come first": a rank's sends in list order; a receive before the sends issued after its wait."""
    successors, waiting = defaultdict(list), {message: 0 for message in messages}

    def edge(first: Message, then: Message) -> None:
        successors[first].append(then)
        waiting[then] += 1

    for rank in {message.sender for message in messages}:
        sends = sorted((m for m in messages if m.sender == rank), key=lambda m: m.send_slot)
        for first, then in zip(sends, sends[1:]):
            edge(first, then)
        slots = [send.send_slot for send in sends]
        for received in (m for m in messages if m.receiver == rank):
            later = bisect.bisect_right(slots, received.receive_slot)  # the first send after its wait
            if later < len(sends):  # the later sends follow it through the chain
                edge(received, sends[later])
    return successors, waiting


# -----------------------------------------------------------------------------
# The pass


def add_receive_posts(plan: Plan) -> Plan:
    """Issue each receive as early as NCCL's issue-order rules allow (module docstring).

    Expects a plan with its transfers and no posts yet. A plan whose dry run is stuck is returned
    unchanged: the validator then names the cyclic wait, which no placement of posts would cure.
    """
    if any(is_post(action) for _, _, action in plan.positions()):
        raise ValueError(f"plan {plan.name!r} already has its receive posts")
    try:
        order = message_order(plan)
    except PlanError:
        return plan
    after = [defaultdict(list) for _ in plan.ranks]  # per rank: slot (-1: step start) -> posts issued after it
    for rank, row in enumerate(plan.ranks):
        _place_posts(row, rank, [m for m in order if rank in (m.sender, m.receiver)], after[rank])
    return dataclasses.replace(plan, ranks=[_with_posts(row, after[rank]) for rank, row in enumerate(plan.ranks)])


def _with_posts(row, after: dict) -> list:
    """`row` with the posts of `after` (slot -> posts) inserted right after their slots."""
    return [*after[-1], *(step for slot, action in enumerate(row) for step in [action, *after[slot]])]


def _place_posts(row, rank: int, order: list[Message], after: dict) -> None:
    """Rank `rank`'s posts: each right after the rank's previous operation in `order` (its messages, any peer)."""
    anchor = -1  # the slot of this rank's previous operation in the order; -1: the step's start
    for message in order:
        if message.sender == rank:
            anchor = message.send_slot
        elif _next_action_slot(row, anchor) == message.receive_slot:
            anchor = message.receive_slot  # the post would stand right before its RECV: let the RECV issue it
        else:
            after[anchor].append(post_of(counterpart(message.send)))


def _next_action_slot(row, slot: int) -> int | None:
    return next((index for index in range(slot + 1, len(row)) if row[index] is not None), None)


def _without_posts(plan: Plan) -> Plan:
    return dataclasses.replace(plan, ranks=[[a for a in row if not is_post(a)] for row in plan.ranks])


# -----------------------------------------------------------------------------
# The rule


def issue_sequences(plan: Plan) -> dict[tuple[int, int], list[Issued]]:
    """(rank, peer) -> the operations `rank` issues toward `peer`, in issue order.

    A send is issued at its SEND; a receive at its post, or at its RECV when it has none.
    """
    posted = {(rank, posted_receive(action)) for rank, _, action in plan.positions() if is_post(action)}
    sequences = defaultdict(list)
    for rank, slot, action in plan.positions():
        if action.info.arrow is None or (rank, action) in posted:
            continue  # not a transfer, or a RECV that only waits for its posted receive
        message = action if action.info.arrow == SEND_ARROW else counterpart(action)
        sequences[rank, plan.rank_of(action.peer_stage)].append(Issued(slot, action, message))
    return sequences


def issue_order(plan: Plan) -> dict[int, list[Issued]]:
    """rank -> the operations `rank` issues toward all its peers, in issue order (what one shared
    communicator's stream runs)."""
    ordered = defaultdict(list)
    for (rank, _), sequence in issue_sequences(plan).items():
        ordered[rank].extend(sequence)
    return {rank: sorted(sequence, key=lambda issued: issued.slot) for rank, sequence in sorted(ordered.items())}


def check_point_to_point_order(plan: Plan) -> None:
    """PlanError at the first break of either rule (module docstring): both sides marked at the first
    pair whose k-th operations are not one message's two ends; else every rank of a cycle marked."""
    sequences = issue_sequences(plan)
    for rank, peer in sorted(sequences):
        if rank < peer:
            mine, theirs = sequences[rank, peer], sequences.get((peer, rank), [])
            for index in range(max(len(mine), len(theirs))):
                _check_match(plan, rank, peer, index, mine, theirs)
    _check_no_cycle(plan)


def _check_no_cycle(plan: Plan) -> None:
    """Rule 2: every rank's operations run one at a time, in issue order, each meeting its other end."""
    ordered = issue_order(plan)
    sequences = {rank: [(_peer(plan, rank, issued), issued.message) for issued in sequence]
                 for rank, sequence in ordered.items()}
    stuck = waiting_cycle(sequences)
    if stuck is None:
        return
    cycle, heads = stuck
    waiting = [ordered[rank][heads[rank]] for rank in cycle[:-1]]
    raise PlanError(
        f"ranks {' → '.join(map(str, cycle))} wait in a cycle: each one's next point-to-point operation "
        f"is toward the next rank, which issues its other end only later "
        f"({'; '.join(f'rank {rank}: {_describe(issued)}' for rank, issued in zip(cycle, waiting))}). "
        f"Every pair agrees, but on a group's one NCCL communicator (torch 2.11-2.13 with device_id, as "
        f"Lightning passes on GPUs) a rank runs its sends and receives toward all peers in issue order: "
        f"NCCL would wait for ever. Issue receives where add_receive_posts puts them.",
        plan, [(rank, issued.slot) for rank, issued in zip(cycle, waiting)])


def _peer(plan: Plan, rank: int, issued: Issued) -> int:
    sender, receiver = plan.rank_of(issued.message.stage), plan.rank_of(issued.message.peer_stage)
    return receiver if rank == sender else sender


def _check_match(plan: Plan, rank: int, peer: int, index: int, mine: list, theirs: list) -> None:
    first = mine[index] if index < len(mine) else None
    second = theirs[index] if index < len(theirs) else None
    if first is not None and second is not None and first.message == second.message:
        return
    marks = [(side, issued.slot) for side, issued in ((rank, first), (peer, second)) if issued is not None]
    raise PlanError(
        f"NCCL matches the point-to-point operations of two ranks in the order each side issues them "
        f"(tags ignored): operation #{index} of rank {rank} toward rank {peer} is {_describe(first)}, "
        f"but operation #{index} of rank {peer} toward rank {rank} is {_describe(second)} — NCCL would "
        f"pair the wrong messages or wait for ever. Issue receives where add_receive_posts puts them.",
        plan, marks)


def _describe(issued: Issued | None) -> str:
    if issued is None:
        return "nothing (its sequence ends)"
    role = "the send" if issued.action == issued.message else "the receive"
    return f"{role} {issued.action} (message {issued.message}, slot {issued.slot})"


# -----------------------------------------------------------------------------
# When a send's buffer may be released


@functools.lru_cache(maxsize=16)  # plans are frozen; every step of a run asks for the same few
def send_releases(plan: Plan) -> dict[int, dict[Action, tuple[Action, ...]]]:
    """rank -> {RECV on that rank: the rank's sends whose receive the peer is proven to have issued
    once this RECV has been waited for} (docs/strategies/pipeline_memory.md: why this cannot deadlock).

    The proof is the pair's own traffic: the peer issued the receive of our send S before it sent the
    message M this RECV waits for (its post, or its RECV when it has none, stands earlier in the
    peer's row than M's SEND). So when M has arrived, S's receive is outstanding at the peer and S's
    `wait()` needs nothing more from this rank. A send proven before it is issued is listed at the
    first RECV after it. Sends toward one peer are proven in issue order, since the peer issues
    their receives in that order (NCCL's rule, `check_point_to_point_order`); sends never proven
    (the step's last ones) are waited for in FINISH."""
    where = {action: (rank, slot) for rank, slot, action in plan.positions()}
    issued_at = {}  # message (its SEND) -> slot on the receiver where its receive is issued
    for (rank, _), sequence in issue_sequences(plan).items():
        for issued in sequence:
            if issued.action != issued.message:
                issued_at[issued.message] = issued.slot
    releases = {}
    for rank, row in enumerate(plan.ranks):
        releases[rank] = _releases_of_row(plan, rank, row, where, issued_at)
    return releases


def _releases_of_row(plan: Plan, rank: int, row, where: dict, issued_at: dict) -> dict:
    proven = defaultdict(lambda: -1)  # peer rank -> latest slot of its row known to have run
    unproven, releases = defaultdict(list), {}  # peer rank -> its sends not yet proven, in issue order
    for slot, action in enumerate(row):
        if action is None:
            continue
        if action.info.arrow == SEND_ARROW and counterpart(action) in where:
            unproven[where[counterpart(action)][0]].append(action)
        elif action.info.arrow is not None and not is_post(action):  # a RECV: its message has arrived
            sender, send_slot = where[counterpart(action)]
            proven[sender] = max(proven[sender], send_slot)
            ready = [send for peer, sends in unproven.items() for send in _proven_prefix(sends, issued_at, proven[peer])]
            if ready:
                releases[action] = tuple(ready)
    return releases


def _proven_prefix(sends: list, issued_at: dict, proven: int) -> list:
    """Pop and return the leading sends whose receive the peer issued before slot `proven` (the
    peer issues them in this order, so the proven ones are a prefix)."""
    count = next((index for index, send in enumerate(sends) if issued_at[send] >= proven), len(sends))
    ready = sends[:count]
    del sends[:count]
    return ready


@functools.lru_cache(maxsize=16)
def send_completions(plan: Plan) -> dict[int, dict[Action, int | None]]:
    """rank -> {SEND on that rank: the slot of the rank's row from which NCCL reports it complete
    (`work.is_completed()`), None if not before the step's end} (docs/strategies/pipeline_memory.md).

    An NCCL send completes once the transfer has run, which needs its receive issued at the peer:
    no earlier than the later of its own issue and the peer's post (or RECV, when it has none) of
    it, and — on a group's one communicator, which runs each rank's operations toward all peers one
    after another (module docstring; what GPUs run) — no earlier than the operations both ranks
    issued before it (`_transfer_times`). Issue times are read off the plan's unit-cost simulated
    timeline — the one `add_receive_posts` orders the messages by, so the count is a property of
    the plan (and has the closed form the search uses) and not of one device's speeds; transfers
    take no time there. The send is complete from the first later action of its row that starts at
    or after that time."""
    timeline = simulate(plan, unit_cost)
    start = {record.action: record.start for row in timeline.ranks for record in row}
    ran = _transfer_times(plan, start)
    completions = {}
    for rank, row in enumerate(plan.ranks):
        completions[rank] = {send: _first_slot_from(row, slot, ran[send], start)
                             for slot, send in enumerate(row) if send in ran}
    return completions


def _transfer_times(plan: Plan, start: dict) -> dict[Action, float]:
    """message (its SEND) -> when it has run: both ends issued, and every operation either rank
    issued before it has run (one stream per rank), in the order the messages can retire."""
    ordered = issue_order(plan)
    issued_at = {(rank, issued.message): start[issued.action] for rank, sequence in ordered.items()
                 for issued in sequence}
    retired, _ = retire({rank: [(_peer(plan, rank, issued), issued.message) for issued in sequence]
                         for rank, sequence in ordered.items()})
    ran, last = {}, defaultdict(float)  # rank -> when its previous operation ran
    for message in retired:
        ends = (plan.rank_of(message.stage), plan.rank_of(message.peer_stage))
        ran[message] = max(*(issued_at[end, message] for end in ends), *(last[end] for end in ends))
        for end in ends:
            last[end] = ran[message]
    return ran


def _first_slot_from(row, slot: int, time: float, start: dict) -> int | None:
    return next((later for later in range(slot + 1, len(row)) if row[later] is not None and start[row[later]] >= time),
                None)


@functools.lru_cache(maxsize=8)
def _every_ranks_proofs(plan: Plan, completes_when_received: bool) -> tuple:
    """send_releases and send_completions are computed for every rank at once: the layout search
    asks release_points for three ranks of each plan it prices (cost/memory.held_sends)."""
    return send_releases(plan), send_completions(plan) if completes_when_received else None


def release_points(plan: Plan, rank: int, completes_when_received: bool = False) -> dict[Action, tuple[Action, ...]]:
    """{action of `rank`'s row: the sends `StageWork.release_sends` drops when it runs} — the
    executor's rule replayed: it checks before each SEND and after each RECV's wait, per peer in
    issue order, and drops a send the plan proves received (`send_releases`: gloo and the fake
    group, whose sends complete only in `wait()`) or, with `completes_when_received` (NCCL), one
    whose work reports completion (`send_completions`). The drop at a SEND comes before its own send."""
    proofs, completions = _every_ranks_proofs(plan, completes_when_received)
    proofs, completions = proofs[rank], completions[rank] if completes_when_received else {}
    where = {action: (peer, slot) for peer, slot, action in plan.positions()}
    queues, proven, points = defaultdict(list), set(), {}
    for slot, action in enumerate(plan.ranks[rank]):
        if action is None or action.info.arrow is None or is_post(action):
            continue  # the executor checks only at a SEND and after a RECV's wait
        proven.update(proofs.get(action, ()))

        def done(send, now=slot) -> bool:
            return send in proven or completions.get(send, len(plan.ranks[rank])) <= now
        released = tuple(send for queue in queues.values() for send in _pop_while(queue, done))
        if released:
            points[action] = released
        if action.info.arrow == SEND_ARROW and counterpart(action) in where:
            queues[where[counterpart(action)][0]].append(action)
    return points


def _pop_while(queue: list, done) -> list:
    count = next((index for index, send in enumerate(queue) if not done(send)), len(queue))
    ready = queue[:count]
    del queue[:count]
    return ready


def most_sends_held(plan: Plan, rank: int, completes_when_received: bool = False) -> int:
    """Most sends `StageWork` holds at once on `rank` (`release_points`): the executor's `most_held`
    on gloo and in the dry run, and on NCCL with `completes_when_received`."""
    releases = release_points(plan, rank, completes_when_received)
    held, most = set(), 0
    for action in plan.ranks[rank]:
        if action is None:
            continue
        held.difference_update(releases.get(action, ()))
        if action.info.arrow == SEND_ARROW:
            held.add(action)
            most = max(most, len(held))
    return most
