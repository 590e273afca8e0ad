"""What a pipeline rank really ran, observed below the executor, against its claims and its plan.

1. Executed order. The executor's records (schedule.json's `executed_last_step`) are made by
   iterating the plan, so comparing them with the plan proves little. Here each rank is watched from
   underneath instead: torch.distributed's isend/irecv (peer and tag, beneath the Communicator),
   and the stage's own first block (a forward pre-hook; the backward is a gradient hook on
   the stage's input; a split backward's W, a gradient hook on the block's first weight). The micro-batch of a forward is read from the data, not from a counter: on
   stage 0 from which chunk of the batch the tokens are, on later stages from which received message
   the input tensor is. The observed per-rank sequence must equal schedule.json's claim, and the
   observed sends and receives toward each peer must equal the plan's transfers (`issue_sequences`).
2. Bubble. The measured bubble fraction (the median over sampled steps, the first excluded) must be
   within a stated bound of the simulated one, on a model where compute dominates communication.

Test ids: {schedule}_pp2_m4 = 2 pipeline ranks, 4 micro-batches; looped = looped breadth-first with
2 stages per rank (modular_pipeline); interleaved = interleaved 1F1B; zbv = split backward on the V
placement (rank 0 holds stages 0 and 3, rank 1 stages 1 and 2, which hands its output over locally).
"""

import inspect
import json
import os

import pytest

from layerwise.run.fit import fit_rank, train
from layerwise.preflight import validate
from strategies.modular_pipeline import training_plan
from strategies.schedule import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, POST_RECV_ACTIVATION, POST_RECV_GRADIENT, RECV_ACTIVATION,
                                 RECV_GRADIENT, REDUCE_GRADIENT, SEND_ACTIVATION, SEND_GRADIENT, is_post,
                                 issue_sequences, parse_action, posted_receive)
from tests.ranks import QUICK, compose_config, run_on_ranks

RANKS = 2
MICRO_BATCHES = 4
STEPS = 3
GRADIENT_KINDS = {SEND_GRADIENT, RECV_GRADIENT, POST_RECV_GRADIENT}


def decode_tag(tag: int):
    """The wire format of a pipeline message's tag (strategies/stages.py): (sender stage · m +
    micro-batch) · 2 + 1 for a gradient. -> (sender stage, micro-batch, "activation" | "gradient")."""
    stage, micro_batch = divmod(tag // 2, MICRO_BATCHES)
    return stage, micro_batch, "gradient" if tag % 2 else "activation"


# ----------------------------------------------------------------------------- observation in each rank

def observed_fit(rank, cfg, directory, world):
    """fit_rank, watched from below the executor; returns this rank's events, one list per training step."""
    import torch.distributed as dist

    from strategies.modular_pipeline import ModularPipelineStrategy

    steps, watching = [], [False]
    received, embedded = {}, {}  # id(tensor) -> (tensor, which message / micro-batch it is); kept alive
    produced, running = {}, {}  # a stage output's data_ptr -> (output, (stage, micro-batch)); stage -> micro-batch

    def watch_transfer(name, kind):
        original = getattr(dist, name)
        signature = inspect.signature(original)

        def watched(*args, **kwargs):
            arguments = signature.bind(*args, **kwargs).arguments
            if watching[0]:
                peer = arguments.get("dst", arguments.get("src"))
                message = decode_tag(arguments.get("tag", 0))
                steps[-1].append((kind, peer, *message))
                if kind == "receive":
                    received[id(arguments["tensor"])] = (arguments["tensor"], message)
            return original(*args, **kwargs)
        setattr(dist, name, watched)
    watch_transfer("isend", "send")
    watch_transfer("irecv", "receive")

    def stage_starts(stage):
        def before(module, args):
            if not watching[0]:
                return
            hidden = args[0]
            if stage == 0:
                micro_batch = embedded[id(hidden)][1]
            elif id(hidden) in received:
                sender, micro_batch, what = received[id(hidden)][1]
                assert (sender, what) == (stage - 1, "activation"), (stage, sender, what)
            else:  # the previous stage ran on this rank (the V's turn): its output's storage, detached
                sender, micro_batch = produced[hidden.data_ptr()][1]
                assert sender == stage - 1, (stage, sender)
            running[stage] = micro_batch
            steps[-1].append(("forward", stage, micro_batch))
            if hidden.requires_grad:  # fires when the stage's backward reaches its input
                hidden.register_hook(lambda gradient: backward_reached(stage, micro_batch))
        return before

    def stage_ends(stage):
        def after(module, args, output):
            if watching[0]:
                produced[output.data_ptr()] = (output, (stage, running[stage]))
        return after

    def backward_reached(stage, micro_batch):
        # Once per micro-batch: stage 0's split backward runs whole at its W (strategies/stages.py)
        if ("backward", stage, micro_batch) not in steps[-1]:
            steps[-1].append(("backward", stage, micro_batch))

    def weight_computed(stage):
        def hook(gradient):
            if watching[0]:
                steps[-1].append(("weight", stage))
        return hook

    def tokens_embedded(module, args, output):
        if watching[0]:
            tokens = args[0]  # a chunk (view) of the batch: its offset says which micro-batch it is
            embedded[id(output)] = (output, tokens.storage_offset() // tokens.numel())

    original_setup, original_run_step = ModularPipelineStrategy.setup, ModularPipelineStrategy.run_step

    def setup(self, trainer):
        original_setup(self, trainer)
        model, per_stage = self.lightning_module.model, self.layers_per_stage
        split = BACKWARD_WEIGHT in self.plan.kinds  # W: the first weight's gradient (B computes it too)
        for name, block in model.blocks.items():
            if int(name) % per_stage == 0:
                block.register_forward_pre_hook(stage_starts(int(name) // per_stage))
            if int(name) % per_stage == per_stage - 1:
                block.register_forward_hook(stage_ends(int(name) // per_stage))
                if split:
                    next(block.parameters()).register_hook(weight_computed(int(name) // per_stage))
        if model.embed is not None:
            model.embed.register_forward_hook(tokens_embedded)

    def run_step(self, batch):
        steps.append([])
        watching[0] = True
        try:
            return original_run_step(self, batch)
        finally:
            watching[0] = False
            received.clear()
            embedded.clear()
            produced.clear()

    ModularPipelineStrategy.setup, ModularPipelineStrategy.run_step = setup, run_step
    fit_rank(rank, cfg, directory, world)
    return steps


# ----------------------------------------------------------------------------- what the claims say

def claimed_events(row: list, placement=None) -> list:
    """schedule.json's executed row as the events a watcher sees: a forward and a backward; a send at
    its SEND; a receive issued at its post, or at its RECV when it has none (a posted RECV only waits);
    a REDUCE on a single replica calls nothing. Stage c runs on rank `placement[c]`, by default
    c mod p (looping, and GPipe's one stage per rank)."""
    rank_of = (lambda stage: stage % RANKS) if placement is None else placement.__getitem__
    actions = [parse_action(text) for text in row]
    posted = {posted_receive(action) for action in actions if is_post(action)}
    events = []
    for action in actions:
        what = "gradient" if action.kind in GRADIENT_KINDS else "activation"
        if action.kind == BACKWARD_INPUT and action.stage == 0:
            continue  # no consumer for its gradient: stage 0's W runs the whole backward (StageWork)
        if action.kind in (FORWARD, BACKWARD, BACKWARD_INPUT):
            events.append(("forward" if action.kind == FORWARD else "backward", action.stage, action.micro_batch))
        elif action.kind == BACKWARD_WEIGHT:  # the watcher cannot tell a weight gradient's micro-batch
            events.append(("weight", action.stage))  # (the stage's last block's, reached before its input)
            events += [("backward", 0, action.micro_batch)] if action.stage == 0 else []
        elif action.kind in (SEND_ACTIVATION, SEND_GRADIENT):
            events.append(("send", rank_of(action.peer_stage), action.stage, action.micro_batch, what))
        elif action.kind in (POST_RECV_ACTIVATION, POST_RECV_GRADIENT) or (
                action.kind in (RECV_ACTIVATION, RECV_GRADIENT) and action not in posted):
            events.append(("receive", rank_of(action.peer_stage), action.peer_stage, action.micro_batch, what))
        else:
            assert action.kind in (RECV_ACTIVATION, RECV_GRADIENT, REDUCE_GRADIENT), action
    return events


def planned_transfers(plan, rank: int, peer: int) -> list:
    """The plan's sends and receives of `rank` toward `peer`, in issue order, as watcher events."""
    events = []
    for issued in issue_sequences(plan).get((rank, peer), []):
        message = issued.message  # the send action: its stage and micro-batch make the tag
        what = "gradient" if message.kind == SEND_GRADIENT else "activation"
        kind = "send" if issued.action.kind in (SEND_ACTIVATION, SEND_GRADIENT) else "receive"
        events.append((kind, peer, message.stage, message.micro_batch, what))
    return events


ORDER_CASES = {
    "looped_pp2_v2_m4": ["strategy=modular_pipeline"],
    "one_f_one_b_pp2_m4": ["strategy=one_f_one_b"],
    "zero_bubble_h1_pp2_m4": ["strategy=one_f_one_b", "strategy.schedule=zero_bubble_h1"],
    "zero_bubble_h2_pp2_m4": ["strategy=one_f_one_b", "strategy.schedule=zero_bubble_h2"],
    "zbv_pp2_m4": ["strategy=one_f_one_b", "strategy.schedule=zbv", "strategy.layers_per_stage=1"],
    "interleaved_pp2_v2_m4": ["strategy=interleaved_1f1b"],
}


@pytest.mark.parametrize("case", list(ORDER_CASES))
def test_observed_order_equals_the_claimed_order_and_the_planned_transfers(case, tmp_path):
    cfg = compose_config(*QUICK, *ORDER_CASES[case], "model.layers=4", f"strategy.micro_batches={MICRO_BATCHES}",
                         f"trainer.max_steps={STEPS}", "trainer.limit_val_batches=0")
    world = validate(cfg)
    assert world == RANKS
    observed = run_on_ranks(observed_fit, world, cfg, tmp_path, world)
    claimed = json.loads((tmp_path / "schedule.json").read_text())["executed_last_step"]
    plan = training_plan(cfg.strategy, cfg.model.layers)
    for rank in range(RANKS):
        steps = observed[rank]
        assert len(steps) == STEPS
        assert steps[-1] == claimed_events(claimed[rank], plan.placement), f"rank {rank}: observed ≠ schedule.json"
        assert all(step == steps[-1] for step in steps), f"rank {rank}: steps ran different orders"
        stages = {event[1] for event in steps[-1] if event[0] == "forward"}
        assert stages == set(plan.stages_on(rank))
        for kind in ("forward", "backward"):  # each of its stages × micro-batches exactly once
            ran = sorted(event[1:] for event in steps[-1] if event[0] == kind)
            assert ran == sorted((stage, i) for stage in stages for i in range(MICRO_BATCHES)), kind
        weights = sorted(event[1] for event in steps[-1] if event[0] == "weight")
        assert weights == (sorted(list(stages) * MICRO_BATCHES) if BACKWARD_WEIGHT in plan.kinds else [])
        peer = 1 - rank
        transfers = [event for event in steps[-1] if event[0] in ("send", "receive")]
        assert all(event[1] == peer for event in transfers)
        assert transfers == planned_transfers(plan, rank, peer), f"rank {rank}: observed ≠ plan's transfers"
        assert len(transfers) > 0


# ----------------------------------------------------------------------------- measured vs simulated bubble

# A model where compute dominates communication: a stage's forward is ~4·10⁸ multiply-adds
# (2 sequences × 128 tokens, 512 wide; 35-60 ms on one core) while a message is 512 KiB.
BUBBLE_MODEL = ["model.layers=4", "model.hidden=512", "model.heads=4", "data.sequence_length=128",
                "model.dropout=0.0"]
BUBBLE_STEPS = 5  # the median is over steps 2-5 (the strategy leaves out the first, warm-up, step)
# |measured − simulated| ≤ 0.10 (absolute). Why: the simulation's cost model is uniform stages,
# backward = 2 × forward, free communication; the measurement also holds (a) the real backward /
# forward ratio on a CPU (1.9-2.3 here), (b) the embedding and the head on the end stages (the
# last stage's forward is ~10% longer), (c) each message's latency on the critical path (a few ms
# per hop: gloo's threads share the 2 cores with the compute) and the flat-bucket copies of the
# gradient reductions, 5-10 ms per stage, and (d) other processes on a shared machine preempting
# one rank while the other waits. Measured on a 2-core machine at load average 5: looped 0.146
# and 0.159 vs 0.111; GPipe 0.17-0.21 vs 0.200. With 64 tokens per sequence instead of 128,
# (c) doubles in share and looped measured 0.215-0.219: the bound is not met by a smaller model.
# It still means something: two ranks that did not overlap at all would measure ≥ 0.5, ≥ 0.3 away
# from either simulated value. Not a timing assertion: a ratio of times on the same clock.
BUBBLE_BOUND = 0.10


@pytest.mark.parametrize("strategy, simulated", [("gpipe", 1 / 5), ("modular_pipeline", 1 / 9)],
                         ids=["gpipe_pp2_m4", "looped_pp2_v2_m4"])
def test_measured_bubble_is_within_the_bound_of_the_simulated(strategy, simulated, tmp_path):
    cfg = compose_config(*QUICK, f"strategy={strategy}", f"strategy.micro_batches={MICRO_BATCHES}", *BUBBLE_MODEL,
                         f"trainer.max_steps={BUBBLE_STEPS}", "trainer.limit_val_batches=0",
                         "trainer.measure_every_n_steps=1")  # every step sampled
    summary = train(cfg, tmp_path, validate(cfg))
    bubble = summary["bubble_fraction"]
    # (p − 1)/(v·m + p − 1) under unit costs: v = 1 (GPipe), v = 2 (looped, 2 stages per rank)
    assert bubble["simulated"] == pytest.approx(simulated, abs=1e-12)
    load = os.getloadavg()[0]
    print(f"{strategy}: measured bubble {bubble['measured']:.3f}, simulated {bubble['simulated']:.3f}, "
          f"load average {load:.1f}")
    assert abs(bubble["measured"] - bubble["simulated"]) <= BUBBLE_BOUND, \
        f"measured {bubble['measured']:.3f} vs simulated {bubble['simulated']:.3f} (load average {load:.1f})"
