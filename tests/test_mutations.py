"""The equality oracles can fail: each test injects one known bug and the SGD comparison catches it.

Every test runs a case of references.SGD_CASES, the very run and assertions of an "equals single under
SGD" test (references.SgdComparison.check: losses, first-step gradients, parameters after
SGD_STEPS steps, with the tolerances of the table in tolerances.py), with one bug patched in. Ranks are
forked from this process, so a monkeypatch applied here reaches them. Each test prints by how much
every comparison exceeded its tolerance (worst |actual − expected| / (atol + rtol·|expected|), above
1 fails) and the AssertionError that check() raised; run with -s to see them.
"""

import pytest
import torch

from layerwise.run import data as data_lib
from layerwise.run.fit import load_corpus
from layerwise.run.task import model_arguments, objective_of
from models import build_model
from strategies.buckets import GradientBuckets
from strategies.l2l import HostStore, step_only
from strategies.pipefisher import PipeFisherStrategy
from strategies.sharding import FlatShard
from strategies.stages import StageWork, stage_parameters
from strategies.tensor_parallel.grids import Style
from strategies.tensor_parallel.parallelize import BLOCK_PLAN
from strategies.zero_layered import ShardedStageWork
from tests.ranks import QUICK, compose_config
from tests.references import (SGD_CASES, SGD_MODEL, SGD_OVERRIDES, compare_under_sgd, consolidated_parameters,
                              sgd_reference, train_with_callbacks)
from tests.tolerances import (LOSS_RTOL, OptimizerTrace, PARAMETER_RTOL, adam_parameter_excess, assert_same_losses,
                              assert_same_parameters, optimizer_trace_callback, sgd_parameter_atol,
                              tolerance_excess)


@pytest.fixture(autouse=True)
def references_without_the_bug(tmp_path_factory):
    """The reference runs are cached for the session: make them before a test patches its bug in."""
    for reference in sorted({case.reference for case in SGD_CASES.values()}):
        sgd_reference(tmp_path_factory, *reference)


def assert_caught(comparison, bug: str) -> dict:
    """check() must raise; returns {comparison: (worst difference / tolerance, where)}."""
    excess = comparison.excess()
    with pytest.raises(AssertionError) as caught:
        comparison.check()
    first_lines = "\n    ".join(str(caught.value).strip().splitlines()[:4])
    print(f"\n[mutation] {bug}: " + ", ".join(f"{kind} {value:.3g}× tolerance ({where})"
                                             for kind, (value, where) in excess.items())
          + f"\n  check() raised: {first_lines}")
    assert max(value for value, _ in excess.values()) > 1
    return excess


def caught_at_step_one(excess: dict) -> None:
    """The first step's gradient comparison alone sees the bug (not only its later consequences)."""
    assert excess["gradients"][0] > 1, excess


# ----- (a) data-parallel gradients summed instead of averaged

def test_zero_summing_instead_of_averaging_is_caught(monkeypatch, tmp_path, tmp_path_factory):
    """FlatShard.accumulate divides the reduce-scattered sum by 1 instead of n = 2."""
    original = FlatShard.accumulate
    monkeypatch.setattr(FlatShard, "accumulate", lambda self, piece, replicas: original(self, piece, 1))
    excess = assert_caught(compare_under_sgd("zero_layered_dp2_m4", tmp_path, tmp_path_factory),
                           "(a) ZeRO sums the data-parallel gradients")
    caught_at_step_one(excess)


def test_pipeline_summing_instead_of_averaging_is_caught(monkeypatch, tmp_path, tmp_path_factory):
    """StageWork.wait_for_reductions leaves the all-reduced sum: its division by n = 2 is undone."""
    original = StageWork.wait_for_reductions

    def wait_and_sum(self):
        original(self)
        for parameter in self.model.parameters():  # this rank's stages only
            if parameter.grad is not None:
                parameter.grad.mul_(self.peers.data_group.size)
    monkeypatch.setattr(StageWork, "wait_for_reductions", wait_and_sum)
    excess = assert_caught(compare_under_sgd("modular_pipeline_pp2_dp2_v2_m4", tmp_path, tmp_path_factory),
                           "(a) the pipeline sums the data-parallel gradients")
    caught_at_step_one(excess)


# ----- (b) one micro-batch dropped from accumulation

def test_dropped_micro_batch_is_caught(monkeypatch, tmp_path, tmp_path_factory):
    """The last micro-batch's backward runs (its input gradient still flows to the previous stage)
    but its weight gradients are thrown away: 3 of 4 micro-batches are accumulated."""
    original = StageWork.backward

    def backward_dropping_the_last(self, action):
        if action.micro_batch != self.micro_batches - 1:
            return original(self, action)
        parameters = stage_parameters(self.model, action.stage, self.stages, self.layers_per_stage)
        kept = [None if p.grad is None else p.grad.clone() for p in parameters]
        original(self, action)
        for parameter, gradient in zip(parameters, kept):  # in place: .grad may be a view of a bucket
            if gradient is None:
                parameter.grad.zero_()
            else:
                parameter.grad.copy_(gradient)
    monkeypatch.setattr(StageWork, "backward", backward_dropping_the_last)
    excess = assert_caught(compare_under_sgd("modular_pipeline_pp2_v2_m4", tmp_path, tmp_path_factory),
                           "(b) one micro-batch dropped from accumulation")
    caught_at_step_one(excess)


# ----- (c) one stage's data-parallel reduction skipped

def test_skipped_stage_reduction_is_caught(monkeypatch, tmp_path, tmp_path_factory):
    """Stage 0 (embedding + block 0) is never all-reduced: each replica steps on its own half-batch.
    Its buckets are posted from its last backward (strategy.overlap_reduction) or at REDUCE_GRADIENT:
    both go through GradientBuckets._post, which skips them here."""
    original = GradientBuckets._post
    monkeypatch.setattr(GradientBuckets, "_post",
                        lambda self, bucket: None if bucket.stage == 0 else original(self, bucket))
    excess = assert_caught(compare_under_sgd("modular_pipeline_pp2_dp2_v2_m4", tmp_path, tmp_path_factory),
                           "(c) stage 0's data-parallel reduction skipped")
    caught_at_step_one(excess)


# ----- (d) ZeRO gathers the weights of the wrong stage

def test_zero_gathering_the_wrong_stage_is_caught(monkeypatch, tmp_path, tmp_path_factory):
    """Gathers of stage 1 (block 1) fetch stage 2's shards (block 2: the same shapes, so nothing
    fails loudly); gradients still land in stage 1's shards."""
    original = ShardedStageWork.gather

    def gather_the_wrong_stage(self, action):
        if action.stage != 1:
            return original(self, action)
        right = self.shards_of[1]
        self.shards_of[1] = self.shards_of[2]
        try:
            original(self, action)
        finally:
            self.shards_of[1] = right
    monkeypatch.setattr(ShardedStageWork, "gather", gather_the_wrong_stage)
    excess = assert_caught(compare_under_sgd("zero_layered_dp2_m4", tmp_path, tmp_path_factory),
                           "(d) ZeRO gathers stage 2's weights for stage 1")
    assert excess["losses"][0] > 1, excess  # the forward itself is wrong


# ----- (e) a 3-D linear with its input and output axis roles swapped

def test_three_d_swapped_axis_roles_are_caught(monkeypatch, tmp_path, tmp_path_factory):
    """mlp.fc_out is parallelised as a "first" linear: its axis roles (j, k) are swapped, so it reads
    fc_in's output layout L(k, j) as L(j, k). The shapes agree (q × q), so nothing fails loudly.
    The plan is patched here too, so the checkpoint is consolidated with the roles it was cut with."""
    monkeypatch.setitem(BLOCK_PLAN, "mlp.fc_out", Style("linear", "first"))
    excess = assert_caught(compare_under_sgd("three_d_q2", tmp_path, tmp_path_factory),
                           "(e) 3-D fc_out with input/output axis roles swapped")
    assert excess["losses"][0] > 1, excess


# ----- (f) PipeFisher's factors not synchronised across data-parallel replicas

def test_unsynchronised_kfac_factors_are_caught(monkeypatch, tmp_path, tmp_path_factory):
    """The factor sync units do nothing: each replica inverts the curvature of its own half-batch."""
    monkeypatch.setattr(PipeFisherStrategy, "_sync", lambda self, action: None)
    excess = assert_caught(compare_under_sgd("pipefisher_gpipe_pp2_dp2_m4_k2", tmp_path, tmp_path_factory),
                           "(f) PipeFisher factors not synchronised over data")
    caught_at_step_one(excess)


# ----- (g) L2L updating a layer with the previous step's gradient

def test_l2l_stale_gradient_is_caught(monkeypatch, tmp_path, tmp_path_factory):
    """The host store steps each layer with the gradient it received one step earlier (step 1, which
    has none, uses its own, as a warm-up would): step 1 is right, so only the parameters after
    SGD_STEPS steps and the later losses can see it."""
    previous = {}

    def update_with_the_previous_gradient(self, parameters):
        current = {id(p): p.grad.clone() for p in parameters if p.grad is not None}
        for parameter in parameters:
            if id(parameter) in previous and parameter.grad is not None:
                parameter.grad.copy_(previous[id(parameter)])
        step_only(self.optimizer, parameters)
        previous.update(current)
    monkeypatch.setattr(HostStore, "update", update_with_the_previous_gradient)
    excess = assert_caught(compare_under_sgd("l2l_m4", tmp_path, tmp_path_factory),
                           "(g) L2L updates with the previous step's gradient")
    assert excess["gradients"][0] <= 1 < excess["parameters"][0], excess


# ----- AdamW: the update rule's tolerance (tolerances.adam_tolerance) still sees optimizer bugs
#
# AdamW normalises a gradient's scale away (that is what the SGD comparisons are for), but a bug in
# the optimizer itself must still fail an "equals single" AdamW comparison: losses of every step and
# parameters within tolerances.adam_tolerance. 5 steps of the default AdamW (lr 3e-3, warm-up 20).

ADAMW_STEPS = 5
ADAMW_MODEL = ["model.layers=4", "data.global_batch_size=16", "trainer.limit_val_batches=0",
               f"trainer.val_check_interval={ADAMW_STEPS}", f"trainer.max_steps={ADAMW_STEPS}"]
ADAMW_CASE = "zero_layered_dp2_m4"  # ZeRO keeps the optimizer state in flat shards: a bug's likely home


def adamw_run(directory, *overrides, trace=False):
    cfg = compose_config(*QUICK, *ADAMW_MODEL, *overrides)
    callbacks = [optimizer_trace_callback(directory)] if trace else []
    summary = train_with_callbacks(cfg, directory, callbacks, one_thread=True)
    assert summary["status"] == "completed", summary.get("error")
    return summary, consolidated_parameters(directory, cfg.strategy.name)


@pytest.fixture(scope="module")
def adamw_reference(tmp_path_factory):
    directory = tmp_path_factory.mktemp("adamw_single")
    summary, parameters = adamw_run(directory, "strategy=single", trace=True)
    return summary, parameters, OptimizerTrace.load(directory)


def assert_caught_under_adamw(reference, actual, bug: str) -> dict:
    """The AdamW comparison (losses, then parameters) must fail; returns the worst excess of each."""
    expected_summary, expected, trace = reference
    summary, parameters = actual
    excess = {"losses": (tolerance_excess(torch.tensor(summary["losses"]), torch.tensor(expected_summary["losses"]),
                                          LOSS_RTOL, 0.0), "losses"),
              **adam_parameter_excess(parameters, expected, trace)}
    print(f"\n[mutation] {bug}: " + ", ".join(f"{kind} {value:.3g}× tolerance ({where})"
                                             for kind, (value, where) in excess.items()))
    with pytest.raises(AssertionError):
        assert_same_losses(summary["losses"], expected_summary["losses"])
        assert_same_parameters(parameters, expected, trace)
    assert max(value for value, _ in excess.values()) > 1
    return excess


def test_adamw_rule_passes_the_unmutated_case(adamw_reference, tmp_path):
    """The control: the same case without a bug is within every tolerance."""
    expected_summary, expected, trace = adamw_reference
    summary, parameters = adamw_run(tmp_path, *SGD_CASES[ADAMW_CASE].overrides)
    assert_same_losses(summary["losses"], expected_summary["losses"])
    assert_same_parameters(parameters, expected, trace)


def test_adamw_wrong_learning_rate_is_caught(adamw_reference, monkeypatch, tmp_path):
    """The warm-up is one step ahead (lr·(t+1)/20 at step t): every step a little too long."""
    from layerwise.run import optim
    original = optim.learning_rate_factor
    monkeypatch.setattr(optim, "learning_rate_factor", lambda step, config, steps: original(step + 1, config, steps))
    excess = assert_caught_under_adamw(adamw_reference, adamw_run(tmp_path, *SGD_CASES[ADAMW_CASE].overrides),
                                       "AdamW warm-up one step ahead")
    assert excess["masked"][0] > 10, excess


def test_adamw_dropped_optimizer_state_is_caught(adamw_reference, monkeypatch, tmp_path):
    """Each rank's AdamW forgets its moments before step 3 (as a rebuilt or reloaded-empty optimizer
    would): step 3 is a bias-corrected first step, sign(g)·lr, instead of m̂/√v̂."""
    original, calls = torch.optim.AdamW.step, []

    def step_forgetting_the_state(self, *arguments, **keywords):
        calls.append(1)
        if len(calls) == 3:
            self.state.clear()
        return original(self, *arguments, **keywords)
    monkeypatch.setattr(torch.optim.AdamW, "step", step_forgetting_the_state)
    excess = assert_caught_under_adamw(adamw_reference, adamw_run(tmp_path, *SGD_CASES[ADAMW_CASE].overrides),
                                       "AdamW moments dropped before step 3")
    assert excess["masked"][0] > 10, excess


# ----- the oracle's own inputs

def test_initial_weights_are_the_seeded_model(tmp_path_factory):
    """p0 of g = (p0 − p1)/lr is the reference's step-0 checkpoint: bit-identical to models.build_model
    at the seed, which every strategy materialises its parts from."""
    cfg = compose_config(*QUICK, *SGD_MODEL, *SGD_OVERRIDES, "strategy=single")
    vocabulary = data_lib.model_vocab_size(load_corpus(cfg), objective_of(cfg.model))
    model = build_model(cfg.model.architecture, device="meta", **model_arguments(cfg.model, vocabulary, cfg.seed))
    model.materialise(torch.device("cpu"))
    seeded = {f"model.{name}": value for name, value in model.state_dict().items()}
    initial = sgd_reference(tmp_path_factory).initial
    assert seeded.keys() == initial.keys()
    assert all(torch.equal(seeded[name], initial[name]) for name in seeded)


# ----- the learning rates: a factor 2 on a gradient is visible in the parameters

@pytest.mark.parametrize("reference", ["single", "kfac"])
def test_sgd_learning_rates_make_a_factor_two_visible(reference, tmp_path_factory):
    """A factor-2 error on step 1's gradient moves each weight by lr·|g| beyond the right one: for
    most elements with a gradient that is many times the parameter tolerance (the margin)."""
    case = {"single": (), "kfac": SGD_CASES["pipefisher_gpipe_pp2_dp2_m4_k2"].reference}[reference]
    run = sgd_reference(tmp_path_factory, *case)
    gradients, atol = run.gradients(run.initial), sgd_parameter_atol(run.trajectory, run.learning_rate)
    ratios = torch.cat([(run.learning_rate * gradients[name].abs()
                         / (atol[name] + PARAMETER_RTOL * run.first[name].abs())).reshape(-1)
                        for name in gradients])
    ratios = ratios[torch.cat([g.reshape(-1) for g in gradients.values()]) != 0]
    visible = float((ratios > 1).double().mean())
    print(f"\n[margin] {reference}, lr {run.learning_rate}: a factor-2 gradient error exceeds the parameter "
          f"tolerance on {visible:.1%} of the {ratios.numel()} elements with a gradient; median "
          f"lr·|g| / tolerance {float(ratios.median()):.0f}×; losses {run.summary['losses']}")
    assert visible > 0.8 and float(ratios.median()) > 10
    assert run.summary["losses"][-1] < run.summary["losses"][0]  # lr small enough to descend
