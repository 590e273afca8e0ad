"""Reference runs: the one-process runs every strategy is compared with (AdamW with its traced
update, plain SGD with its weights after every step), the SGD cases of every strategy, and the
trainer callbacks that save step checkpoints and traces. Tolerances: tests/tolerances.py."""

from collections import namedtuple
from contextlib import contextmanager
from pathlib import Path

from tests.ranks import QUICK, compose_config
from tests.tolerances import (GRADIENT_RTOL, LOSS_RTOL, PARAMETER_RTOL, assert_same_gradients, assert_same_losses,
                              assert_same_parameters_after_sgd, gradient_atol, optimizer_trace_callback,
                              sgd_parameter_atol, tolerance_excess)


def consolidated_parameters(run_directory, strategy_name: str, checkpoint: str = "last") -> dict:
    """The full model's state dict from a run's `last` (or another named) checkpoint, whatever the strategy.

    layerwise.tools.export's reading, the one users export with: a single file is already whole; a per-rank
    directory is merged one pipeline position at a time by the strategy module's
    `consolidate(rank_state_dicts, layout)` (pipelines: disjoint keys; shards: concatenated).
    """
    from pathlib import Path

    from layerwise.tools.export import merged_state
    return merged_state(Path(run_directory) / "checkpoints" / f"{checkpoint}.ckpt", strategy_name)


def cached_references(tmp_path_factory, run):
    """`reference(layers) -> (summary, directory)`: single-process runs made once per module with
    that module's `run(directory, *overrides)`, so every strategy case compares with the same one;
    each leaves its OptimizerTrace (AdamW runs: `assert_same_parameters(..., OptimizerTrace.load(directory))`)."""
    cache = {}

    def reference(layers):
        if layers not in cache:
            directory = tmp_path_factory.mktemp(f"single{layers}")
            with tracing_optimizer(directory):
                cache[layers] = (run(directory, "strategy=single", f"model.layers={layers}"), directory)
        return cache[layers]
    return reference


# ----- plain SGD: an oracle that sees a gradient's scale -----------------------------------------
#
# AdamW and LAMB divide each step by a running gradient norm, so a constant factor on a gradient
# (summed instead of averaged over replicas) barely moves their weights. Plain SGD at a constant
# learning rate steps by exactly lr·g: every "equals single" test also runs it, and compares
#   1. the losses of every step,
#   2. the gradient of the first step, recovered exactly as g = (p0 − p1)/lr from the reference's
#      initial weights p0 (its own step-0 checkpoint) and each run's weights after step 1,
#   3. the parameters after SGD_STEPS steps.
# Mutation tests (test_mutations.py) prove these very assertions fail on known bugs.

# The margin: a factor-2 error on step 1's gradient moves a weight by lr·|g|. At lr 0.5 that exceeds
# the parameter tolerance (sgd_parameter_atol + 1e-5·|p|, ≈ 3e-5 + 1e-5·|p| here) on 84.8% of the
# 61,854 weights with a gradient, by a median 25× (the rest are mostly query/key weights, whose
# gradient is ~1e-5 at initialisation; kfac at lr 0.01: 83.0%, median 40×);
# the gradient comparison sees it as a relative error of 1 against GRADIENT_RTOL = 1e-5. At lr 1 the
# loss already rises at step 3. (test_mutations.test_sgd_learning_rates_make_a_factor_two_visible)
SGD_LEARNING_RATE = 0.5
SGD_STEPS = 3
SGD_OVERRIDES = ["optimizer=sgd", "optimizer.momentum=0", "optimizer.weight_decay=0",
                 "optimizer.warmup_steps=0", "optimizer.lr_schedule=constant",
                 f"optimizer.lr={SGD_LEARNING_RATE}"]
# One model for every SGD comparison, so one single-process reference serves every strategy:
# 4 blocks (2 pipeline stages × 2 loops), 16 sequences (4 micro-batches × 2 replicas × 2 rows),
# no validation (the comparison reads training losses and checkpoints only).
SGD_MODEL = ["model.layers=4", "data.global_batch_size=16", "trainer.limit_val_batches=0",
             f"trainer.val_check_interval={SGD_STEPS}"]
# K-FAC's preconditioned gradient B⁻¹∇W A⁻¹ is 25–300× the plain one here (damping 1e-3; B, built
# from per-token output gradients, is tiny). Steps that large amplify round-off chaotically: at
# lr 0.5 PipeFisher and kfac end 5× the parameter tolerance apart after 3 steps (1.1× at 0.1), and
# at 0.05 the loss rises. At 0.01 they stay 0.03× apart, the loss falls, and a factor 2 on a
# gradient still shows (test_mutations.test_sgd_learning_rates_make_a_factor_two_visible).
KFAC_SGD_LEARNING_RATE = 0.01
KFAC_SGD = ["model.layers=4", "strategy.refresh_interval=2", "strategy.micro_batches=4",
            f"optimizer.lr={KFAC_SGD_LEARNING_RATE}"]

# Every strategy's SGD comparison, by test id: the run's overrides, its world size, and its
# reference's overrides (empty: `strategy=single`). Ids: dp{n} data replicas, pp{p} pipeline
# stages, v{v} loops, m{m} micro-batches, q{q} tensor grid edge, p{t} 1-D tensor ranks, k{k} K-FAC
# refresh interval, const = L2L's constant-memory variant.
SgdCase = namedtuple("SgdCase", "overrides world reference", defaults=((),))
# llama_tiny at the SGD size: 4 query heads sharing 2 kv heads (GQA), SwiGLU 64 wide, RMSNorm, RoPE.
LLAMA = ("model=llama_tiny", "model.heads=4", "model.kv_heads=2", "model.ffn_hidden=64")
LLAMA_REFERENCE = ("strategy=single", *LLAMA)
SGD_CASES = {
    "ddp_dp2": SgdCase(["strategy=ddp"], 2),
    "modular_pipeline_pp2_v2_m4": SgdCase(["strategy=modular_pipeline", "strategy.pipeline_degree=2"], 2),
    "modular_pipeline_pp2_dp2_v2_m4": SgdCase(["strategy=modular_pipeline", "strategy.pipeline_degree=2",
                                               "hardware.devices_per_node=4"], 4),
    "gpipe_pp2_m4": SgdCase(["strategy=gpipe"], 2),
    "one_f_one_b_pp2_m4": SgdCase(["strategy=one_f_one_b"], 2),
    # ZB-H1 (split backward I + W): p = 2, m = 4 and p = 4, m = 8 (W lags I by up to 3 on rank 3)
    "zero_bubble_h1_pp2_m4": SgdCase(["strategy=one_f_one_b", "strategy.schedule=zero_bubble_h1"], 2),
    "zero_bubble_h1_pp4_m8": SgdCase(["strategy=one_f_one_b", "strategy.schedule=zero_bubble_h1",
                                      "strategy.pipeline_degree=4", "strategy.layers_per_stage=1",
                                      "strategy.micro_batches=8", "hardware.devices_per_node=4"], 4),
    # ZB-H1 with data replicas (REDUCE after each stage's last W) and over a 1-D tensor grid
    "zero_bubble_h1_pp2_dp2_m4": SgdCase(["strategy=one_f_one_b", "strategy.schedule=zero_bubble_h1",
                                          "hardware.devices_per_node=4"], 4),
    "zero_bubble_h1_pp2_p2_m4": SgdCase(["strategy=one_f_one_b", "strategy.schedule=zero_bubble_h1",
                                         "strategy.tensor_parallel=1d", "strategy.tensor_grid=2",
                                         "hardware.devices_per_node=4"], 4),
    # ZB-H2: 2p − 1 micro-batches between F and W, Ws at the tail; p = 2, m = 4 and p = 4, m = 8 (m ≥ 2p − 1)
    "zero_bubble_h2_pp2_m4": SgdCase(["strategy=one_f_one_b", "strategy.schedule=zero_bubble_h2"], 2),
    "zero_bubble_h2_pp4_m8": SgdCase(["strategy=one_f_one_b", "strategy.schedule=zero_bubble_h2",
                                      "strategy.pipeline_degree=4", "strategy.layers_per_stage=1",
                                      "strategy.micro_batches=8", "hardware.devices_per_node=4"], 4),
    # ZBV: the V placement, 2 stages per rank (rank 0 holds the first and the last); p = 2, m = 4 and p = 4, m = 8
    "zbv_pp2_m4": SgdCase(["strategy=one_f_one_b", "strategy.schedule=zbv", "strategy.layers_per_stage=1"], 2),
    "zbv_pp4_m8": SgdCase(["strategy=one_f_one_b", "strategy.schedule=zbv", "strategy.pipeline_degree=4",
                           "strategy.layers_per_stage=1", "model.layers=8", "strategy.micro_batches=8",
                           "hardware.devices_per_node=4"], 4, ("strategy=single", "model.layers=8")),
    "interleaved_1f1b_pp2_v2_m4": SgdCase(["strategy=interleaved_1f1b"], 2),
    "zero_layered_dp2_m4": SgdCase(["strategy=zero_layered"], 2),
    "zero_layered_pp2_dp2_m4": SgdCase(["strategy=zero_layered", "strategy.pipeline_degree=2",
                                        "hardware.devices_per_node=4"], 4),
    # zero_layered with a split backward (ZB-H1): one reduce-scatter per stage after its last W
    "zero_layered_zero_bubble_h1_pp2_dp2_m4": SgdCase(["strategy=zero_layered", "strategy.pipeline_degree=2",
                                                       "strategy.schedule=zero_bubble_h1", "strategy.layers_per_stage=2",
                                                       "hardware.devices_per_node=4"], 4),
    # ... and ZBV: 2 stages per rank, backward runs that start at a W (gathered by "Aw")
    "zero_layered_zbv_pp2_dp2_m4": SgdCase(["strategy=zero_layered", "strategy.pipeline_degree=2",
                                            "strategy.schedule=zbv", "strategy.layers_per_stage=1",
                                            "hardware.devices_per_node=4"], 4),
    # ... and ZB-H2: 2p − 1 micro-batches between F and W, the reduce-scatters after the tail's Ws
    "zero_layered_zero_bubble_h2_pp2_dp2_m4": SgdCase(["strategy=zero_layered", "strategy.pipeline_degree=2",
                                                       "strategy.schedule=zero_bubble_h2", "strategy.layers_per_stage=2",
                                                       "hardware.devices_per_node=4"], 4),
    "zero_depth_first_dp2_m4": SgdCase(["strategy=zero_depth_first"], 2),
    "fsdp2_dp2_m4": SgdCase(["strategy=fsdp2"], 2),
    "three_d_q2": SgdCase(["strategy=three_d", "hardware.devices_per_node=8"], 8),
    "tp_1d_p2": SgdCase(["strategy=tp_1d", "strategy.tensor_grid=2"], 2),
    "tp_2d_q2": SgdCase(["strategy=tp_2d", "hardware.devices_per_node=4"], 4),
    "l2l_m4": SgdCase(["strategy=l2l", "hardware.devices_per_node=1"], 1),
    "l2l_dp2_m2_const": SgdCase(["strategy=l2l", "strategy.micro_batches=2", "strategy.constant_memory=true"], 2),
    # LayerDrop (issue 34): the same (seed, step) mask in the run and in its single reference.
    "l2l_m4_layer_drop": SgdCase(["strategy=l2l", "hardware.devices_per_node=1", "strategy.layer_drop=0.5"], 1,
                                 ("strategy=single", "strategy.layer_drop=0.5")),
    "l2l_dp2_m2_const_layer_drop": SgdCase(["strategy=l2l", "strategy.micro_batches=2", "strategy.constant_memory=true",
                                            "strategy.layer_drop=0.5"], 2, ("strategy=single", "strategy.layer_drop=0.5")),
    "ddp_dp2_layer_drop": SgdCase(["strategy=ddp", "strategy.layer_drop=0.5"], 2,
                                  ("strategy=single", "strategy.layer_drop=0.5")),
    # Composed layouts (issue 14): a tensor grid inside each pipeline stage, × data or ZeRO shards.
    "modular_pipeline_pp2_p2_m4": SgdCase(["strategy=modular_pipeline", "strategy.tensor_parallel=1d",
                                           "strategy.tensor_grid=2", "hardware.devices_per_node=4"], 4),
    "modular_pipeline_pp2_v2_2d_q2_m4": SgdCase(["strategy=modular_pipeline", "strategy.tensor_parallel=2d",
                                                 "strategy.tensor_grid=2", "hardware.devices_per_node=8"], 8),
    "zero_layered_pp2_p2_dp2_m4": SgdCase(["strategy=zero_layered", "strategy.pipeline_degree=2",
                                           "strategy.tensor_parallel=1d", "strategy.tensor_grid=2",
                                           "hardware.devices_per_node=8"], 8),
    "zero_layered_pp2_2d_q2_dp2_m4": SgdCase(["strategy=zero_layered", "strategy.pipeline_degree=2",
                                              "strategy.tensor_parallel=2d", "strategy.tensor_grid=2",
                                              "hardware.devices_per_node=16"], 16),
    "one_f_one_b_pp2_3d_q2_m4": SgdCase(["strategy=one_f_one_b", "strategy.tensor_parallel=3d",
                                         "strategy.tensor_grid=2", "hardware.devices_per_node=16"], 16),
    "pipefisher_gpipe_pp2_p2_dp2_m4_k2": SgdCase(["strategy=pipefisher", "strategy.schedule=gpipe",
                                                  "strategy.layers_per_stage=2", "strategy.tensor_parallel=1d",
                                                  "strategy.tensor_grid=2", "hardware.devices_per_node=8", *KFAC_SGD],
                                                 8, ("strategy=kfac", "strategy.factor_blocks=2", *KFAC_SGD)),
    "pipefisher_gpipe_pp2_dp2_m4_k2": SgdCase(["strategy=pipefisher", "strategy.schedule=gpipe",
                                               "strategy.layers_per_stage=2", "hardware.devices_per_node=4",
                                               *KFAC_SGD], 4, ("strategy=kfac", *KFAC_SGD)),
    "pipefisher_zero_bubble_h1_pp2_m4_k2": SgdCase(["strategy=pipefisher", "strategy.schedule=zero_bubble_h1",
                                                    "strategy.layers_per_stage=2", *KFAC_SGD], 2,
                                                   ("strategy=kfac", *KFAC_SGD)),
    # ... on ZB-H2 and on the V (K-FAC's a and g captured through I and W; two stages per rank for ZBV)
    "pipefisher_zero_bubble_h2_pp2_m4_k2": SgdCase(["strategy=pipefisher", "strategy.schedule=zero_bubble_h2",
                                                    "strategy.layers_per_stage=2", *KFAC_SGD], 2,
                                                   ("strategy=kfac", *KFAC_SGD)),
    "pipefisher_zbv_pp2_m4_k2": SgdCase(["strategy=pipefisher", "strategy.schedule=zbv",
                                         "strategy.layers_per_stage=1", *KFAC_SGD], 2, ("strategy=kfac", *KFAC_SGD)),
    # ZBV over a 1-D tensor grid (each of the V's stages split over 2 ranks)
    "zbv_pp2_p2_m4": SgdCase(["strategy=one_f_one_b", "strategy.schedule=zbv", "strategy.layers_per_stage=1",
                              "strategy.tensor_parallel=1d", "strategy.tensor_grid=2", "hardware.devices_per_node=4"], 4),
    # The Llama family (issue 29): one case per strategy family against its own single reference.
    "llama_ddp_dp2": SgdCase(["strategy=ddp", *LLAMA], 2, LLAMA_REFERENCE),
    "llama_interleaved_1f1b_pp2_v2_m4": SgdCase(["strategy=interleaved_1f1b", *LLAMA], 2, LLAMA_REFERENCE),
    "llama_zero_layered_pp2_dp2_m4": SgdCase(["strategy=zero_layered", "strategy.pipeline_degree=2",
                                              "hardware.devices_per_node=4", *LLAMA], 4, LLAMA_REFERENCE),
    "llama_fsdp2_dp2_m4": SgdCase(["strategy=fsdp2", *LLAMA], 2, LLAMA_REFERENCE),
    "llama_tp_1d_p2": SgdCase(["strategy=tp_1d", "strategy.tensor_grid=2", *LLAMA], 2, LLAMA_REFERENCE),
    "llama_tp_2d_q2": SgdCase(["strategy=tp_2d", "hardware.devices_per_node=4", *LLAMA], 4, LLAMA_REFERENCE),
    "llama_three_d_q2": SgdCase(["strategy=three_d", "hardware.devices_per_node=8", *LLAMA], 8, LLAMA_REFERENCE),
    "llama_l2l_dp2_m2_const": SgdCase(["strategy=l2l", "strategy.micro_batches=2", "strategy.constant_memory=true",
                                       *LLAMA], 2, LLAMA_REFERENCE),
    "llama_modular_pipeline_pp2_v2_2d_q2_m4": SgdCase(["strategy=modular_pipeline", "strategy.tensor_parallel=2d",
                                                       "strategy.tensor_grid=2", "hardware.devices_per_node=8",
                                                       *LLAMA], 8, LLAMA_REFERENCE),
    "llama_zero_layered_pp2_p2_dp2_m4": SgdCase(["strategy=zero_layered", "strategy.pipeline_degree=2",
                                                 "strategy.tensor_parallel=1d", "strategy.tensor_grid=2",
                                                 "hardware.devices_per_node=8", *LLAMA], 8, LLAMA_REFERENCE),
    "llama_one_f_one_b_pp2_3d_q2_m4": SgdCase(["strategy=one_f_one_b", "strategy.tensor_parallel=3d",
                                               "strategy.tensor_grid=2", "hardware.devices_per_node=16", *LLAMA],
                                              16, LLAMA_REFERENCE),
    "llama_pipefisher_gpipe_pp2_p2_dp2_m4_k2": SgdCase(
        ["strategy=pipefisher", "strategy.schedule=gpipe", "strategy.layers_per_stage=2",
         "strategy.tensor_parallel=1d", "strategy.tensor_grid=2", "hardware.devices_per_node=8", *KFAC_SGD, *LLAMA],
        8, ("strategy=kfac", "strategy.factor_blocks=2", *KFAC_SGD, *LLAMA)),
}


def step_checkpoints(steps):
    """A trainer callback that also saves `checkpoints/step{n}.ckpt` after each step n in `steps`
    (n = 0: before the first step), through the strategy's own save, like `last.ckpt`."""
    import lightning.pytorch as pl

    class StepCheckpoints(pl.Callback):
        @staticmethod
        def save(trainer, step):
            trainer.save_checkpoint(Path(trainer.default_root_dir) / "checkpoints" / f"step{step}.ckpt",
                                    weights_only=False)

        def on_train_start(self, trainer, module):
            if 0 in steps:
                self.save(trainer, 0)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
            if trainer.global_step in steps:
                self.save(trainer, trainer.global_step)
    return StepCheckpoints()


@contextmanager
def trainer_callbacks(*callbacks):
    """Within the block, every trainer layerwise.run.fit builds gets these callbacks too (the ranks are
    forked from this process, so the patched trainer factory reaches them)."""
    import layerwise.run.fit as run_module

    original = run_module.build_trainer

    def build_trainer(*arguments, **keywords):
        trainer = original(*arguments, **keywords)
        trainer.callbacks.extend(callbacks)
        return trainer
    run_module.build_trainer = build_trainer
    try:
        yield
    finally:
        run_module.build_trainer = original


def tracing_optimizer(run_directory):
    """Within the block, the one-process AdamW/LAMB run into `run_directory` (a reference) leaves its
    OptimizerTrace there, for `assert_same_parameters`."""
    return trainer_callbacks(optimizer_trace_callback(run_directory))


def train_with_callbacks(cfg, directory, callbacks, one_thread: bool):
    """layerwise.run.fit.train with these trainer callbacks added."""
    import torch

    import layerwise.run.fit as run_module
    from layerwise.preflight import validate

    threads = torch.get_num_threads()
    if one_thread:
        torch.set_num_threads(1)
    try:
        with trainer_callbacks(*callbacks):
            return run_module.train(cfg, directory, validate(cfg))
    finally:
        torch.set_num_threads(threads)


def train_saving_steps(cfg, directory, steps=(1,), trace=False):
    """layerwise.run.fit.train, with checkpoints after the given steps too (and, with `trace`, the
    OptimizerTrace of a one-process AdamW/LAMB run). One thread, as every forked rank has
    (layerwise.run.launch): a one-process run in this process would otherwise spin several OpenMP
    threads on cores other tests share (10× slower under load)."""
    callbacks = [step_checkpoints(tuple(steps))] + ([optimizer_trace_callback(directory)] if trace else [])
    return train_with_callbacks(cfg, directory, callbacks, one_thread=True)


class SgdRun:
    """One run under SGD_OVERRIDES: its summary, and its consolidated weights after step 1 and the
    last; a reference (`initial`) also keeps its weights after every step from 0 (`trajectory`)."""

    def __init__(self, directory, *overrides, initial=False, steps=SGD_STEPS):
        cfg = compose_config(*QUICK, *SGD_MODEL, *SGD_OVERRIDES, f"trainer.max_steps={steps}", *overrides)
        self.cfg, self.learning_rate = cfg, float(cfg.optimizer.lr)
        self.strategy = cfg.strategy.name
        self.summary = train_saving_steps(cfg, directory, range(steps + 1) if initial else (1,))
        assert self.summary["status"] == "completed", self.summary.get("error")
        assert self.summary["steps"] == steps and self.summary["strategy"] == self.strategy
        self.trajectory = ([consolidated_parameters(directory, self.strategy, f"step{step}")
                            for step in range(steps + 1)] if initial else None)
        self.initial = self.trajectory[0] if initial else None
        self.first = consolidated_parameters(directory, self.strategy, "step1")
        self.last = consolidated_parameters(directory, self.strategy)

    def gradients(self, initial: dict) -> dict:
        """The first step's gradient: p1 = p0 − lr·g under plain SGD, so g = (p0 − p1)/lr."""
        return {name: (initial[name] - self.first[name]) / self.learning_rate for name in initial}


_SGD_REFERENCES = {}  # reference overrides -> SgdRun, made once per session


def sgd_reference(tmp_path_factory, *overrides) -> SgdRun:
    """The one-process reference (default `strategy=single`) under SGD, with its initial weights."""
    overrides = overrides or ("strategy=single",)
    if overrides not in _SGD_REFERENCES:
        directory = tmp_path_factory.mktemp("sgd_reference")
        _SGD_REFERENCES[overrides] = SgdRun(directory, *overrides, initial=True)
    return _SGD_REFERENCES[overrides]


class SgdComparison:
    """A run against its reference under SGD: `check()` is every SGD equality test's assertion,
    `excess()` says by how much each comparison exceeded its tolerance (> 1 fails)."""

    def __init__(self, actual: SgdRun, expected: SgdRun):
        self.actual, self.expected = actual, expected
        assert actual.learning_rate == expected.learning_rate, (actual.learning_rate, expected.learning_rate)
        self.actual_gradients = actual.gradients(expected.initial)
        self.expected_gradients = expected.gradients(expected.initial)
        self.parameter_atol = sgd_parameter_atol(expected.trajectory, expected.learning_rate)

    def check(self) -> None:
        print(f"{self.actual.strategy} vs {self.expected.strategy} under SGD, worst difference / "
              f"tolerance: " + ", ".join(f"{kind} {value:.3g} ({where})"
                                         for kind, (value, where) in self.excess().items()))
        assert_same_losses(self.actual.summary["losses"], self.expected.summary["losses"])
        assert_same_gradients(self.actual_gradients, self.expected_gradients, self.expected.initial,
                              self.expected.learning_rate)
        assert_same_parameters_after_sgd(self.actual.last, self.expected.last, self.parameter_atol)

    def excess(self) -> dict:
        """Worst |actual − expected| / (atol + rtol·|expected|) of each comparison, and where."""
        import torch
        losses = tolerance_excess(torch.tensor(self.actual.summary["losses"]),
                                  torch.tensor(self.expected.summary["losses"]), LOSS_RTOL, 0.0)
        gradients = max((tolerance_excess(self.actual_gradients[name], self.expected_gradients[name],
                                          GRADIENT_RTOL, gradient_atol(self.expected_gradients[name],
                                                                       self.expected.initial[name],
                                                                       self.expected.learning_rate)), name)
                        for name in self.expected_gradients)
        parameters = max((tolerance_excess(self.actual.last[name], self.expected.last[name],
                                           PARAMETER_RTOL, self.parameter_atol[name]), name)
                         for name in self.expected.last)
        return {"losses": (losses, "losses"), "gradients": gradients, "parameters": parameters}


def compare_under_sgd(case: str, tmp_path, tmp_path_factory) -> SgdComparison:
    """Run SGD_CASES[case] and compare it with its (cached) reference run."""
    overrides, world, reference = SGD_CASES[case]
    expected = sgd_reference(tmp_path_factory, *reference)
    comparison = SgdComparison(SgdRun(tmp_path, *overrides), expected)
    assert comparison.actual.summary["world_size"] == world, comparison.actual.summary["layout"]
    return comparison


def bf16_adamw_against_single(tmp_path_factory, overrides, rounding: float) -> dict:
    """3 AdamW steps of `overrides` under bf16-mixed against single's traced update: losses within
    BF16_LOSS_RTOL, parameters within adam_tolerance for gradients that differ by `rounding` of their
    scale (the bf16 rounding a switch adds, in place of fp32's ADAM_ROUNDING). Returns the summary."""
    import torch

    from layerwise.preflight import validate
    from layerwise.run.fit import train
    from tests.tolerances import BF16_LOSS_RTOL, OptimizerTrace, assert_same_parameters
    common = [*QUICK, "model.layers=4", "data.global_batch_size=16", "trainer.limit_val_batches=0",
              "trainer.val_check_interval=3", "trainer.max_steps=3", "hardware.precision=bf16-mixed"]
    expected_directory, actual_directory = tmp_path_factory.mktemp("single_adamw"), tmp_path_factory.mktemp("adamw")
    runs = []
    for directory, extra, trace in ((expected_directory, ["strategy=single"], True), (actual_directory, overrides, False)):
        cfg = compose_config(*common, *extra)
        with (tracing_optimizer(directory) if trace else contextmanager(lambda: (yield))()):
            summary = train(cfg, directory, validate(cfg))
        assert summary["status"] == "completed", summary.get("error")
        runs.append(summary)
    expected, actual = runs
    print(f"AdamW losses, worst relative difference: "
          f"{max(abs(a - e) / abs(e) for a, e in zip(actual['losses'], expected['losses'])):.3g}")
    torch.testing.assert_close(torch.tensor(actual["losses"]), torch.tensor(expected["losses"]),
                               rtol=BF16_LOSS_RTOL, atol=0)
    assert_same_parameters(consolidated_parameters(actual_directory, "modular_pipeline"),
                           consolidated_parameters(expected_directory, "single"),
                           OptimizerTrace.load(expected_directory), rounding=rounding)
    return actual
