"""Stage-boundary messages (issue 56): in the compute dtype under mixed precision, scattered over the
1-D tensor group and all-gathered on arrival (Narayanan et al. 2021 §4.1).

On a pipeline 2 × 1-D tensor 2 layout (4 gloo ranks, strict point-to-point order on), under
bf16-mixed and plain SGD: bf16 messages equal `single` within the boundary rounding's tolerance
(tolerances.BF16_MESSAGE_*), scattered messages deliver exactly the elements whole ones do
(bit-identical runs), the bytes counted per kind are the formula's (16-bit messages halve send_recv,
scattering divides it by t and adds the receivers' all-gathers), and receive buffers shrink as much.
fp32 messages are today's path (no copy, no cast). Under 16-mixed an overflowing gradient message is
an inf the agreed scaler skips on every rank.
"""

import pytest
import torch

from layerwise.config.errors import ConfigError
from layerwise.preflight import validate
from layerwise.run.fit import train
from models import build_model
from parallel.comm import Group
from strategies.modular_pipeline import training_plan
from strategies.schedule import (POST_RECV_ACTIVATION, RECV_ACTIVATION, RECV_GRADIENT, SEND_ACTIVATION, SEND_GRADIENT,
                                 Action)
from strategies.stages import BoundaryScatter, Peers, StageWork
from tests.ranks import QUICK, compose_config
from tests.references import SgdComparison, SgdRun, bf16_adamw_against_single, sgd_reference
from tests.tolerances import BF16_MESSAGE_GRADIENT_SCALE_ATOL, EXACT_RTOL, assert_same_with_bf16_messages

BF16 = "hardware.precision=bf16-mixed"
# The grid's partial sums in fp32: the BF16_MESSAGE_* bound was derived for one more bf16 rounding
# per message on top of fp32 sums (bf16 sums, strategy.tensor_collective_dtype=compute, the default,
# are tests/test_tensor_collective_dtype.py's; with them these runs measured 0.14-0.16× of it too).
GRID = ["strategy=modular_pipeline", "strategy.pipeline_degree=2", "strategy.tensor_parallel=1d",
        "strategy.tensor_grid=2", "hardware.devices_per_node=4", "strategy.tensor_collective_dtype=fp32"]
TENSOR_RANKS = 2
# What crosses the boundaries, from today's path to both features on (bf16-mixed throughout).
VARIANTS = {"fp32_whole": ["strategy.message_dtype=fp32", "strategy.scatter_gather=false"],
            "bf16_whole": ["strategy.message_dtype=compute", "strategy.scatter_gather=false"],
            "bf16_scattered": ["strategy.message_dtype=compute", "strategy.scatter_gather=true"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each variant's SGD run (3 steps, its weights after step 1 and the last)."""
    return {name: SgdRun(tmp_path_factory.mktemp(name), *GRID, BF16, *overrides)
            for name, overrides in VARIANTS.items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return sgd_reference(tmp_path_factory, "strategy=single", BF16)


def test_bf16_messages_equal_single_under_sgd(runs, reference):
    """Losses, first-step gradients and parameters after 3 steps against single (bf16-mixed), with
    today's fp32 messages printed beside for scale."""
    for name in ("fp32_whole", "bf16_scattered"):
        comparison = SgdComparison(runs[name], reference)
        assert_same_with_bf16_messages(comparison, name)


def test_scattered_messages_deliver_the_same_elements(runs):
    """Each tensor rank's copy of a boundary tensor is bit-identical (1-D: the row-parallel
    all-reduce and the column input's backward all-reduce leave every rank the same sum), so the
    gathered slices are the whole message: the runs are bit-identical, losses and weights."""
    scattered, whole = runs["bf16_scattered"], runs["bf16_whole"]
    assert scattered.summary["losses"] == whole.summary["losses"]
    for weights in ("first", "last"):
        mine, theirs = getattr(scattered, weights), getattr(whole, weights)
        assert mine.keys() == theirs.keys()
        different = [name for name in mine if not torch.equal(mine[name], theirs[name])]
        assert not different, different


def message_bytes(cfg, wire_bytes: int, scattered: bool) -> dict:
    """The formula, max over pipeline ranks (what summary.json reports per kind): each send carries
    the micro-batch's activation (rows × length × hidden) in `wire_bytes`, 1/t of it when scattered;
    each receive then all-gathers the whole over the t tensor ranks, (t−1)/t of it (parallel/comm.py)."""
    plan = training_plan(cfg.strategy, cfg.model.layers)
    rows = cfg.data.global_batch_size // cfg.strategy.micro_batches  # one data replica
    piece = rows * cfg.data.sequence_length * cfg.model.hidden * wire_bytes
    split = TENSOR_RANKS if scattered else 1
    sends = [sum(a is not None and a.kind in (SEND_ACTIVATION, SEND_GRADIENT) for a in row) for row in plan.ranks]
    receives = [sum(a is not None and a.kind in (RECV_ACTIVATION, RECV_GRADIENT) for a in row) for row in plan.ranks]
    gathered = (TENSOR_RANKS - 1) / TENSOR_RANKS if scattered else 0.0
    return {"send_recv": max(count * piece / split for count in sends),
            "all_gather": max(count * piece * gathered for count in receives)}


def test_counted_bytes_follow_the_formula(runs):
    before = runs["fp32_whole"].summary["comm_bytes_per_step"]
    for name, wire_bytes, scattered in (("fp32_whole", 4, False), ("bf16_whole", 2, False),
                                        ("bf16_scattered", 2, True)):
        run = runs[name]
        counted, formula = run.summary["comm_bytes_per_step"], message_bytes(run.cfg, wire_bytes, scattered)
        print(f"{name}: send_recv {counted['send_recv']:.0f} (formula {formula['send_recv']:.0f}, "
              f"{counted['send_recv'] / before['send_recv']:.3g}× fp32 whole), all_gather {counted['all_gather']:.0f} "
              f"(formula {formula['all_gather']:.0f}); all_reduce {counted['all_reduce']:.0f}; memory meter's "
              f"peak {run.summary['peak_compute_bytes']:.0f} B")
        for kind, value in formula.items():
            assert counted[kind] == pytest.approx(value, rel=EXACT_RTOL, abs=0), (name, kind)
        assert counted["all_reduce"] == before["all_reduce"]  # the grid's and the data's, untouched
    assert runs["bf16_whole"].summary["comm_bytes_per_step"]["send_recv"] == before["send_recv"] / 2
    assert runs["bf16_scattered"].summary["comm_bytes_per_step"]["send_recv"] == before["send_recv"] / 4


# ----- AdamW: losses and parameters against single's traced update ----------------------------------

def test_bf16_messages_equal_single_under_adamw(tmp_path_factory):
    """3 AdamW steps: losses within BF16_LOSS_RTOL; parameters within the update rule's bound
    (tolerances.adam_tolerance) for gradients that differ by the bf16 messages' rounding
    (BF16_MESSAGE_GRADIENT_SCALE_ATOL of their scale, in place of fp32's ADAM_ROUNDING)."""
    bf16_adamw_against_single(tmp_path_factory, GRID, rounding=BF16_MESSAGE_GRADIENT_SCALE_ATOL)



# ----- the paths themselves: fp32 is today's, buffers shrink ----------------------------------------

class Posted:
    """A communicator stand-in that records each receive buffer posted (no message ever comes)."""

    def __init__(self):
        self.buffers = []

    def receive(self, tensor, source, group, tag=0):
        self.buffers.append(tensor)
        return None


def stage_work(message_dtype=None, scatter=None, communicator=None) -> StageWork:
    """Stage 1 of a 2-stage GPT (hidden 16) on pipeline rank 1, batch 8 × 16 in 2 micro-batches."""
    model = build_model("gpt", vocab_size=64, sequence_length=16, layers=2, hidden=16, heads=2, seed=0)
    peers = Peers([0, 1], Group("pipeline", (0, 1)), Group("data", (1,)), communicator or Posted())
    work = StageWork(model, 2, 1, 2, peers, message_dtype=message_dtype, scatter=scatter)
    work.start({key: torch.zeros(8, 16, dtype=torch.long) for key in ("tokens", "targets")}, True)
    return work


def test_fp32_messages_are_todays_path():
    """message_dtype=fp32 under bf16-mixed (and any dtype under 32-true or "-true"): the tensor sent
    is the stage's own tensor, no copy or cast, and the buffer received is the stage's input."""
    work = stage_work()
    sent = torch.randn(4, 16, 16)
    assert work.message(sent) is sent
    assert work.unpacked(sent) is sent


def test_receive_buffers_shrink_with_the_message():
    """The buffer a posted receive holds while the rank works on: whole fp32 (today) → whole bf16
    (half) → this rank's slice of t = 2 (a quarter)."""
    post = Action(POST_RECV_ACTIVATION, 1, 0, 0)  # stage 1's activation of micro-batch 0, from stage 0
    sizes = {}
    for name, dtype, scatter in (("fp32_whole", None, None), ("bf16_whole", torch.bfloat16, None),
                                 ("bf16_scattered", torch.bfloat16, BoundaryScatter(Group("tensor", (1, 5)), 0))):
        communicator = Posted()
        work = stage_work(dtype, scatter, communicator)
        work.post_receive(post)
        buffer, = communicator.buffers
        sizes[name] = buffer.numel() * buffer.element_size()
    print(f"receive buffer bytes per message: {sizes}")
    whole = 4 * 16 * 16 * 4  # a micro-batch of 4 sequences × 16 tokens × hidden 16, fp32
    assert sizes == {"fp32_whole": whole, "bf16_whole": whole // 2, "bf16_scattered": whole // 4}


# ----- fp16: an overflowing gradient message is caught ------------------------------------------

FP16 = ["hardware.precision=16-mixed", "+hardware.peak_flops.fp16=2.5e10"]  # as test_precision's fp16 runs
POISONED_STEP = 3  # the third optimizer step (global_step 2 in before_optimizer_step)


def overflowing_gradient_message(send_gradient):
    """StageWork.send_gradient whose fp32 input gradient holds 1e6 — finite in fp32, beyond fp16's
    65504 — in its first element at the POISONED_STEP-th training step (forked ranks inherit it)."""
    def send(self, action):
        if self.training and self.training_steps == POISONED_STEP and action.micro_batch == 0:
            self.state.inputs[(action.stage, action.micro_batch)].view(-1)[0] = 1e6
        send_gradient(self, action)
    return send


def counting_steps(start):
    def counted(self, batch, training, releases=None):
        self.training_steps = getattr(self, "training_steps", 0) + int(training)
        start(self, batch, training, releases)
    return counted


def test_an_fp16_gradient_message_that_overflows_skips_the_step_everywhere(monkeypatch, tmp_path):
    """Under 16-mixed the gradient message is the loss-scaled gradient cast to fp16: a value beyond
    fp16's range arrives as inf, the receiving stage's gradients hold inf, and the agreed scaler
    skips that step on every rank — the run equals one whose step was skipped by an inf written into
    a gradient (test_precision.poison_one_gradient), loss for loss, the step after included."""
    from strategies.modular_pipeline import ModularPipelineStrategy
    from tests.test_precision import poison_one_gradient

    common = [*QUICK, "trainer.max_steps=4", "trainer.val_check_interval=4", "model.layers=4",
              "strategy=modular_pipeline", *FP16]
    monkeypatch.setattr(StageWork, "start", counting_steps(StageWork.start))
    monkeypatch.setattr(StageWork, "send_gradient", overflowing_gradient_message(StageWork.send_gradient))
    message = train(compose_config(*common), tmp_path / "message", 2)
    monkeypatch.undo()
    monkeypatch.setattr(ModularPipelineStrategy, "before_optimizer_step",
                        poison_one_gradient(ModularPipelineStrategy, 0, step=POISONED_STEP - 1))
    gradient = train(compose_config(*common), tmp_path / "gradient", 2)
    assert message["status"] == gradient["status"] == "completed"
    print(f"losses, overflowing message: {message['losses']}; inf written into a gradient: {gradient['losses']}")
    assert message["losses"] == gradient["losses"]


def test_an_unknown_message_dtype_is_named_before_launch():
    cfg = compose_config(*QUICK, "strategy=one_f_one_b", "strategy.message_dtype=bf16")
    with pytest.raises(ConfigError, match="strategy.message_dtype=bf16: need one of compute, fp32. Fix:"):
        validate(cfg)
