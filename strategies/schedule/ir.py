"""The schedule IR: small frozen actions, per-rank lists of them, and the one table of dependencies.

A `Plan` is everything one optimizer step does on every pipeline rank, as data. Generators build
compute-only plans, passes add communication, the validator checks them, the simulator times them,
the executor runs one rank's list. Nothing here imports torch.

Compact string form of an action (stage, letter, micro-batch, optional arrow and peer stage):
    "3F1"    forward of stage 3, micro-batch 1        "3B1"    backward of stage 3, micro-batch 1
    "3F1→4"  stage 3 sends mb 1's activation to 4     "4F1←3"  stage 4 receives it from stage 3
    "3B1→2"  stage 3 sends mb 1's gradient to 2       "2B1←3"  stage 2 receives it from stage 3
    "4f1←3"  post (issue) the receive "4F1←3" here    "2b1←3"  post the receive "2B1←3" here
    "3R"     reduce stage 3's gradient over the data-parallel group
    "3I1"    input-gradient half of 3B1 (split backward)  "3W1"  its weight-gradient half
A receive is issued where its post (lowercase letter) stands and waited on at the RECV (uppercase);
a RECV without a post issues and waits at once. NCCL matches a pair of ranks' operations in the
order each side issues them, so where a receive is issued is part of the plan (point_to_point.py).
"""

from __future__ import annotations

import dataclasses
import re
from functools import cache, cached_property, lru_cache
from typing import Callable, Iterable, Iterator, NamedTuple

# -----------------------------------------------------------------------------
# Kinds of action. Plain strings, so that later passes (weight all-gathers, gradient
# reduce-scatters, host<->device copies, K-FAC work units) extend the set by adding rows to KINDS:
# each pass module declares its own table and strategies/schedule/__init__.py registers them all.

FORWARD = "FORWARD"
BACKWARD = "BACKWARD"
SEND_ACTIVATION = "SEND_ACTIVATION"
RECV_ACTIVATION = "RECV_ACTIVATION"
SEND_GRADIENT = "SEND_GRADIENT"
RECV_GRADIENT = "RECV_GRADIENT"
REDUCE_GRADIENT = "REDUCE_GRADIENT"
POST_RECV_ACTIVATION = "POST_RECV_ACTIVATION"  # issue (irecv) a RECV_ACTIVATION ahead of its wait
POST_RECV_GRADIENT = "POST_RECV_GRADIENT"  # issue (irecv) a RECV_GRADIENT ahead of its wait
# Split backward (Qi et al. 2023, "Zero Bubble Pipeline Parallelism" §2): B = I (gradient of the
# stage input, on the critical path: the previous stage waits for it) + W (gradient of the weights,
# needed only by the optimizer, so it can move into bubbles). A plan uses B or I + W per (stage, mb).
BACKWARD_INPUT = "BACKWARD_INPUT"
BACKWARD_WEIGHT = "BACKWARD_WEIGHT"

SEND_ARROW, RECEIVE_ARROW = "→", "←"
_ASCII_ARROWS = {"->": SEND_ARROW, "<-": RECEIVE_ARROW}


class KindInfo(NamedTuple):
    """Per-kind metadata: how the kind is written and what it costs (compute or communication)."""

    letter: str  # compact letter; together with `arrow` it identifies the kind
    arrow: str | None  # SEND_ARROW / RECEIVE_ARROW for point-to-point transfers (they name a peer)
    per_micro_batch: bool  # the action belongs to one micro-batch (else: to the whole step)
    is_compute: bool  # counts as busy time in the bubble fraction
    is_communication: bool


KINDS: dict[str, KindInfo] = {
    FORWARD: KindInfo("F", None, True, True, False),
    BACKWARD: KindInfo("B", None, True, True, False),
    BACKWARD_INPUT: KindInfo("I", None, True, True, False),
    BACKWARD_WEIGHT: KindInfo("W", None, True, True, False),
    SEND_ACTIVATION: KindInfo("F", SEND_ARROW, True, False, True),
    RECV_ACTIVATION: KindInfo("F", RECEIVE_ARROW, True, False, True),
    SEND_GRADIENT: KindInfo("B", SEND_ARROW, True, False, True),
    RECV_GRADIENT: KindInfo("B", RECEIVE_ARROW, True, False, True),
    REDUCE_GRADIENT: KindInfo("R", None, False, False, True),
    POST_RECV_ACTIVATION: KindInfo("f", RECEIVE_ARROW, True, False, True),
    POST_RECV_GRADIENT: KindInfo("b", RECEIVE_ARROW, True, False, True),
}
# The receive each post kind issues, and back.
RECEIVE_OF_POST = {POST_RECV_ACTIVATION: RECV_ACTIVATION, POST_RECV_GRADIENT: RECV_GRADIENT}
POST_OF_RECEIVE = {receive: post for post, receive in RECEIVE_OF_POST.items()}


@cache  # a written form, once taken, never changes kind (register_kinds refuses a clash)
def kind_of(letter: str, arrow: str | None) -> str:
    """The kind written as `letter` (+ `arrow`); ValueError if none is."""
    for kind, info in KINDS.items():
        if (info.letter, info.arrow) == (letter, arrow):
            return kind
    raise ValueError(f"no action kind is written {letter!r}{'' if arrow is None else ' with ' + arrow}")


# -----------------------------------------------------------------------------
# Action


@dataclasses.dataclass(frozen=True, repr=False)
class Action:
    """One unit of work of one stage: compute, a transfer to/from `peer_stage`, or a reduction.

    Identity is the whole tuple: within a plan every action occurs once, which is what lets the
    simulator and the dry run key finish times by action.
    """

    kind: str
    stage: int
    micro_batch: int | None = None
    peer_stage: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; known kinds: {', '.join(KINDS)}")
        info = KINDS[self.kind]
        if (self.micro_batch is not None) != info.per_micro_batch:
            raise ValueError(f"{self.kind} {'needs' if info.per_micro_batch else 'takes no'} micro_batch")
        if (self.peer_stage is not None) != (info.arrow is not None):
            raise ValueError(f"{self.kind} {'needs' if info.arrow else 'takes no'} peer_stage")

    @property
    def info(self) -> KindInfo:
        """This action's row of KINDS."""
        return KINDS[self.kind]

    def __str__(self) -> str:
        micro_batch = "" if self.micro_batch is None else str(self.micro_batch)
        peer = "" if self.info.arrow is None else f"{self.info.arrow}{self.peer_stage}"
        return f"{self.stage}{self.info.letter}{micro_batch}{peer}"

    def __repr__(self) -> str:
        return f"parse_action({str(self)!r})"


_ACTION_PATTERN = re.compile(r"(\d+)([A-Za-z]+)(\d*)(?:(→|←|->|<-)(\d+))?")
_BUBBLE_CELLS = {"·", ".", "-", "None"}


def parse_action(text: str) -> Action:
    """Inverse of `str(action)`: "3F1", "3F1→4", "2B1←3", "3R" (ASCII "->"/"<-" also accepted)."""
    match = _ACTION_PATTERN.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not an action (expected e.g. '3F1', '3F1→4', '2B1←3', '3R')")
    stage, letter, micro_batch, arrow, peer = match.groups()
    kind = kind_of(letter, _ASCII_ARROWS.get(arrow, arrow))
    return Action(kind, int(stage), int(micro_batch) if micro_batch else None, int(peer) if peer else None)


def parse_row(text: str) -> tuple[Action | None, ...]:
    """A whitespace-separated row of actions, "·" (or "-", ".") for a bubble slot: handy for hand-made plans."""
    return tuple(None if cell in _BUBBLE_CELLS else parse_action(cell) for cell in text.split())


@lru_cache(maxsize=1 << 16)  # pure; the passes and the search ask for each transfer's many times
def counterpart(action: Action) -> Action:
    """The other end of a point-to-point transfer: "3F1→4" <-> "4F1←3"; a post's is the send "4f1←3" -> "3F1→4"."""
    if action.info.arrow is None:
        raise ValueError(f"{action} is not a point-to-point transfer")
    if action.kind in RECEIVE_OF_POST:
        return counterpart(posted_receive(action))
    opposite = RECEIVE_ARROW if action.info.arrow == SEND_ARROW else SEND_ARROW
    return Action(kind_of(action.info.letter, opposite), action.peer_stage, action.micro_batch, action.stage)


def is_post(action: Action | None) -> bool:
    """Whether `action` issues a receive ahead of the RECV that waits for it."""
    return action is not None and action.kind in RECEIVE_OF_POST


def posted_receive(post: Action) -> Action:
    """The RECV whose receive `post` issues: "4f1←3" -> "4F1←3"."""
    return Action(RECEIVE_OF_POST[post.kind], post.stage, post.micro_batch, post.peer_stage)


def post_of(receive: Action) -> Action:
    """The action that issues `receive` ahead of it: "4F1←3" -> "4f1←3"."""
    return Action(POST_OF_RECEIVE[receive.kind], receive.stage, receive.micro_batch, receive.peer_stage)


# -----------------------------------------------------------------------------
# Plan


@dataclasses.dataclass(frozen=True)
class Plan:
    """One optimizer step on every pipeline rank: `ranks[r]` is rank r's ordered list of actions.

    `None` is an explicit bubble slot (drawn, never run, costs nothing: idle time comes from
    dependencies). `placement[stage]` is the rank holding that stage.
    """

    ranks: tuple[tuple[Action | None, ...], ...]
    stages: int
    micro_batches: int
    placement: tuple[int, ...]
    name: str = ""

    def __post_init__(self):
        # Accept lists from hand-written plans; store tuples so the plan stays immutable and hashable.
        object.__setattr__(self, "ranks", tuple(tuple(row) for row in self.ranks))
        object.__setattr__(self, "placement", tuple(self.placement))

    @property
    def pipeline_degree(self) -> int:
        """Number of pipeline ranks."""
        return len(self.ranks)

    def rank_of(self, stage: int) -> int:
        """The rank that holds `stage`."""
        return self.placement[stage]

    def stages_on(self, rank: int) -> tuple[int, ...]:
        """The stages held by `rank`, in increasing order (r, r+p, r+2p, ... for looping placement)."""
        return tuple(stage for stage, owner in enumerate(self.placement) if owner == rank)

    def positions(self) -> Iterator[tuple[int, int, Action]]:
        """Every (rank, slot, action) of the plan, bubbles skipped."""
        for rank, row in enumerate(self.ranks):
            for slot, action in enumerate(row):
                if action is not None:
                    yield rank, slot, action

    @cached_property
    def communicates(self) -> bool:
        """Whether point-to-point transfers are explicit (after `add_communication`)."""
        return any(action.info.arrow is not None for _, _, action in self.positions())

    @cached_property
    def needs(self) -> dict[Action, tuple[Action, ...]]:
        """`dependencies` of every action of the plan, computed once: the simulator asks again each
        time it finds an action still blocked, and the layout search simulates a plan per workload."""
        return {action: dependencies(action, self) for _, _, action in self.positions()}

    @cached_property
    def order(self) -> RunOrder:
        """The actions numbered in an order a dry run can start them (`RunOrder`): computed once, since
        the order does not depend on costs, and walked by the simulator once per cost model."""
        return RunOrder.of(self)

    @cached_property
    def kinds(self) -> frozenset[str]:
        """The kinds of action the plan holds: a pass's rule can apply only to plans holding its own kinds."""
        return frozenset(action.kind for _, _, action in self.positions())

    def grid(self, marks: Iterable[tuple[int, int]] = ()) -> str:
        """Rank × slot text grid; the actions at the (rank, slot) `marks` are shown as >>3B1<<."""
        marks = set(marks)
        cells = [[_cell(action, (rank, slot) in marks) for slot, action in enumerate(row)]
                 for rank, row in enumerate(self.ranks)]
        width = max([len(cell) for row in cells for cell in row] + [3])
        slots = max((len(row) for row in cells), default=0)
        lines = [self.name or "plan", ("slot    " + " ".join(f"{slot:<{width}}" for slot in range(slots))).rstrip()]
        lines += [f"rank {rank:<3}" + " ".join(f"{cell:<{width}}" for cell in row).rstrip()
                  for rank, row in enumerate(cells)]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.grid()


def _cell(action: Action | None, marked: bool) -> str:
    text = "·" if action is None else str(action)
    return f">>{text}<<" if marked else text


@dataclasses.dataclass(frozen=True)
class RunOrder:
    """A plan's actions in an order a dry run can start them: each after its rank's previous action
    and every action it `needs`, as numbers the simulator indexes (no action hashed per visit).
    `stuck` is each rank's cursor where the dry run stopped (a cyclic wait), None if all ran."""

    actions: tuple[Action, ...]
    rank: tuple[int, ...]
    previous: tuple[int, ...]  # the number of the rank's previous action; -1 for its first
    needs: tuple[tuple[int, ...], ...]  # the numbers of `Plan.needs`
    stuck: tuple[int, ...] | None

    @classmethod
    def of(cls, plan: Plan) -> RunOrder:
        """Sweep the ranks, each as far as its needs are numbered, until no rank moves."""
        number, cursor, last, entries = {}, [0] * len(plan.ranks), [-1] * len(plan.ranks), []
        moved = True
        while moved:
            moved = False
            for rank, row in enumerate(plan.ranks):
                while cursor[rank] < len(row):
                    action = row[cursor[rank]]
                    if action is not None:
                        needed = tuple(number.get(dependency) for dependency in plan.needs[action])
                        if None in needed:
                            break
                        number[action] = len(entries)
                        entries.append((action, rank, last[rank], needed))
                        last[rank] = number[action]
                    cursor[rank] += 1
                    moved = True
        done = all(cursor[rank] == len(row) for rank, row in enumerate(plan.ranks))
        actions, ranks, previous, needs = zip(*entries) if entries else ((), (), (), ())
        return cls(actions, ranks, previous, needs, None if done else tuple(cursor))


class PlanError(ValueError):
    """A plan that cannot run as written: one sentence saying what is wrong, then the grid with the fault marked."""

    def __init__(self, sentence: str, plan: Plan, marks: Iterable[tuple[int, int]] = ()):
        self.sentence, self.plan, self.marks = sentence, plan, tuple(marks)
        super().__init__(f"{sentence}\n{plan.grid(self.marks)}")


# -----------------------------------------------------------------------------
# Dependencies: the one place that says what must finish before an action may start.
# The order of a rank's own list is implied; these are the edges between actions.


def dependencies(action: Action, plan: Plan) -> tuple[Action, ...]:
    """Actions that must finish before `action` may start (a rank's own list order is implied).

    F(s,i) needs F(s−1,i); B(s,i) needs F(s,i) and B(s+1,i) — the loss lives in the last stage's
    forward, so B(S−1,i) needs only F(S−1,i). In a plan with explicit transfers, a value made on
    another rank arrives through the receive on this rank, and a receive needs its send.
    REDUCE_GRADIENT(s) needs every B(s,·) (every W(s,·) in a split plan). A kind may have several rules (a pass adds predecessors
    to a core kind, e.g. L2L's weight copies before F and B): their predecessors add up.
    Kinds without a rule depend on nothing.
    """
    return tuple(need for rule in _DEPENDENCY_RULES.get(action.kind, ()) for need in rule(action, plan))


def _forward_dependencies(action: Action, plan: Plan) -> tuple[Action, ...]:
    if action.stage == 0:
        return ()
    return (_arrival(plan, RECV_ACTIVATION, Action(FORWARD, action.stage - 1, action.micro_batch), action),)


def _backward_dependencies(action: Action, plan: Plan) -> tuple[Action, ...]:
    """B(s,i) and I(s,i): their forward, and the output gradient from B(s+1,i) or I(s+1,i)."""
    own_forward = Action(FORWARD, action.stage, action.micro_batch)
    if action.stage == plan.stages - 1:
        return (own_forward,)
    upstream_gradient = gradient_producer(plan, action.stage + 1, action.micro_batch)
    return own_forward, _arrival(plan, RECV_GRADIENT, upstream_gradient, action)


def gradient_producer(plan: Plan, stage: int, micro_batch: int) -> Action:
    """The action computing the input gradient of (stage, micro_batch): I in a split plan, else B."""
    return Action(BACKWARD_INPUT if BACKWARD_INPUT in plan.kinds else BACKWARD, stage, micro_batch)


def weight_gradient_producer(plan: Plan, stage: int, micro_batch: int) -> Action:
    """The action after which (stage, micro_batch)'s weight gradient is accumulated: W in a split plan, else B."""
    return Action(BACKWARD_WEIGHT if BACKWARD_WEIGHT in plan.kinds else BACKWARD, stage, micro_batch)


def _arrival(plan: Plan, receive_kind: str, producer: Action, consumer: Action) -> Action:
    """The producer, or — transfers explicit and producer elsewhere — the receive bringing its output."""
    if plan.communicates and plan.rank_of(producer.stage) != plan.rank_of(consumer.stage):
        return Action(receive_kind, consumer.stage, consumer.micro_batch, producer.stage)
    return producer


Rule = Callable[[Action, Plan], tuple[Action, ...]]

# Per kind, the rules whose predecessors add up (core rules first, then those passes register).
_DEPENDENCY_RULES: dict[str, tuple[Rule, ...]] = {
    FORWARD: (_forward_dependencies,),
    BACKWARD: (_backward_dependencies,),
    BACKWARD_INPUT: (_backward_dependencies,),
    # W needs only its own I: the graph I kept holds everything else (Qi et al. 2023 §2).
    BACKWARD_WEIGHT: (lambda action, plan: (Action(BACKWARD_INPUT, action.stage, action.micro_batch),),),
    SEND_ACTIVATION: (lambda action, plan: (Action(FORWARD, action.stage, action.micro_batch),),),
    SEND_GRADIENT: (lambda action, plan: (gradient_producer(plan, action.stage, action.micro_batch),),),
    RECV_ACTIVATION: (lambda action, plan: (counterpart(action),),),
    RECV_GRADIENT: (lambda action, plan: (counterpart(action),),),
    REDUCE_GRADIENT: (lambda action, plan: tuple(
        weight_gradient_producer(plan, action.stage, micro_batch) for micro_batch in range(plan.micro_batches)),),
}


def register_kinds(kinds: dict[str, KindInfo], rules: dict[str, Rule]) -> None:
    """Add a pass module's action kinds and dependency rules (called by strategies/schedule/__init__.py only).

    `rules` may name the module's own kinds or kinds already known: a rule for a known kind adds
    predecessors to it (L2L: F and B wait for their stage's weights). Nothing changes unless the
    whole table is accepted: a kind or written form (letter + arrow) already taken is an error;
    registering an equal table again changes nothing.
    """
    accepted = dict(KINDS)
    for kind, info in kinds.items():
        _check_no_clash(accepted, kind, info)
        accepted[kind] = info
    unknown = sorted(set(rules) - set(accepted))
    if unknown:
        raise ValueError(f"dependency rules for unknown action kinds {unknown}")
    KINDS.update(accepted)
    for kind, rule in rules.items():
        if rule not in _DEPENDENCY_RULES.get(kind, ()):
            _DEPENDENCY_RULES[kind] = _DEPENDENCY_RULES.get(kind, ()) + (rule,)


def _check_no_clash(kinds: dict[str, KindInfo], kind: str, info: KindInfo) -> None:
    """ValueError if `kind` is known with another row, or another kind is written like `info`."""
    clash = [other for other, row in kinds.items() if (row.letter, row.arrow) == (info.letter, info.arrow)]
    if kinds.get(kind, info) != info or clash not in ([], [kind]):
        raise ValueError(f"action kind {kind!r} written {info.letter!r} clashes with {kinds.get(kind) or clash}")
