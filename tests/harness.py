"""Test helpers: compose configs like train.py does, and run functions on forked gloo ranks.

`run_on_ranks` is the launcher train.py uses (layerwise.run.launch.run_ranks): ranks are forked, get
MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK/LOCAL_RANK/NODE_RANK in their own environment (the test
process's environment is never touched), destroy their process group on the way out, and are
killed if any rank fails; the failing rank's traceback is raised here.
"""

import os
from collections import namedtuple
from pathlib import Path

from hydra import compose, initialize_config_dir

from layerwise.config.store import register_schemas
from layerwise.run.launch import RankError, run_ranks  # noqa: F401  (re-exported for tests)

CONFIG_DIRECTORY = str(Path(__file__).resolve().parent.parent / "conf")
# Every multi-process test runs the strict point-to-point check (NCCL's issue order; parallel/comm.py).
STRICT_POINT_TO_POINT = "trainer.check_point_to_point_order=true"
QUICK = ["logger=none", "trainer.progress=none", "trainer.limit_val_batches=1",
         "data.global_batch_size=8", "data.sequence_length=32", "model.layers=2", "model.hidden=32",
         "model.heads=2", "data.max_bytes=2000000", STRICT_POINT_TO_POINT]


def compose_config(*overrides: str):
    """The composed (unvalidated) config for these overrides, as train.py would see it, with the
    strict point-to-point check on (first, so a test that means to turn it off still can)."""
    register_schemas()
    with initialize_config_dir(config_dir=CONFIG_DIRECTORY, version_base="1.3"):
        return compose(config_name="config", overrides=[STRICT_POINT_TO_POINT, *overrides])


def run_on_ranks(function, world_size: int, *arguments):
    assert "LOCAL_RANK" not in os.environ, "a previous test leaked LOCAL_RANK"
    return run_ranks(function, world_size, *arguments, timeout=300)


# ----- Tolerances: every one a test uses, and why it is that size ------------------------------------
#
# Two runs of one computation in fp32 whose sums run in another order (micro-batches accumulated
# in another order, all-reduces, sharded matrix products) differ by round-off, a few ulp (2^-23 ≈
# 1.2e-7 relative) per operation. Each fp32 tolerance sits above the largest such difference
# measured (`SgdComparison.check` prints worst |actual − expected| / tolerance: ≤ 0.02 for losses,
# ≤ 0.04 for parameters, ≤ 0.47 for gradients, where one ulp of a recovered weight is half the
# recovery term) and far below the effect of every bug in test_mutations.py (≥ 1e4× on the
# comparison that sees it best, ≥ 20× on the first that fails).
#
# K-FAC's damped inverses run in float64 (strategies/kfac.py `damped_inverse`): in fp32, Cholesky of
# A + λ_A·I (condition number up to ~1/λ ≈ 1e3) would magnify the ~1e-7 differences between equal
# factors summed in another order (pipeline vs one process) beyond these tolerances; in float64 the
# inverses agree to ~1e-13, so PipeFisher is held to the same fp32 tolerances as every strategy.

# fp32 loss of every step ("equals single"). Largest measured: 1.8e-7 relative (tp_2d, SGD).
LOSS_RTOL = 1e-5
# fp32 parameters after k steps. Largest measured under SGD: 3.3e-2 of this tolerance (PipeFisher).
PARAMETER_RTOL = 1e-5
# The key part of the fused qkv bias has an analytically zero gradient (softmax ignores a constant
# added to every key), so its computed gradient is round-off, which Adam normalises into steps of
# up to lr: those entries drift by ~1e-6 between equal computations summed in another order.
PARAMETER_ATOL = 1e-5
# First-step gradient g = (p0 − p1)/lr under plain SGD (harness.SgdComparison), per element:
GRADIENT_RTOL = 1e-5
# ... plus this fraction of the tensor's largest |g| as atol: entries that are sums of cancelling
# terms (the qkv key bias: analytically 0) carry round-off of the tensor's scale, not their own.
# Sized by K-FAC: B⁻¹ ∇W A⁻¹ multiplies ∇W's round-off by the damped factors' condition number:
# 1.0e-5 of max |g| measured (PipeFisher vs kfac, block 0 fc_out, at an entry near the maximum);
# first-order gradients differ by ≤ 1.3e-6 of max |g| beyond the recovery rounding below.
GRADIENT_SCALE_ATOL = 3e-5
# ... plus the rounding of recovering g from fp32 weights: p1 = p0 − lr·g is stored to the nearest
# fp32, so two runs' p1 may differ by one ulp ≤ 2^-23·|p| although their g agree; p0 − p1 is exact
# (Sterbenz), so g carries GRADIENT_RECOVERY_EPS·max|p0|/lr (2 ulp: |p1| may exceed |p0|).
GRADIENT_RECOVERY_EPS = 2 * 2.0 ** -23
# bf16 keeps 8 bits of mantissa (relative step 2^-8 ≈ 4e-3): two equal computations whose fp32
# reductions run in another order round differently in a few matrix products per step.
BF16_LOSS_RTOL = 1e-2
# A bf16 forward against an fp32 one (L2L's cross mixed precision vs a plain step): not two
# roundings of one computation but ~10 matrix products whose inputs lose 16 bits each (2^-9 relative).
BF16_VERSUS_FP32_LOSS_RTOL = 2e-2
# CUDA against CPU (the GPU-only L2L test): other kernels, other blocking of every reduction.
DEVICE_LOSS_RTOL = 1e-4
# One tensor-parallel operator's shards against the chunks of the unsharded result (test_three_d):
# a single product or norm, whose only difference is the order of its own sums; atol is relative to
# the largest entry (OPERATOR_SCALE_ATOL × max|expected|) so entries near zero do not fail spuriously.
OPERATOR_RTOL = 1e-6
OPERATOR_SCALE_ATOL = 1e-6
# float64 sums of the same terms grouped differently (K-FAC factor split in token halves): 2^-52 ≈
# 2.2e-16 per addition, over ~15 terms.
FLOAT64_RTOL = 1e-12
FLOAT64_ATOL = 1e-15
# Byte counts and simulated times: integers and (g−1)/g factors computed in float64, exact up to
# float64 rounding; anything but rounding is a different count.
EXACT_RTOL = 1e-12
# Estimates, not equalities, keep their literal next to the quantity they bound (not numerics):
# test_models (initial std within 10% of a finite sample, 6N FLOPs within 5%), test_setup_memory
# and test_l2l's memory tests (allocator slack, 5%), test_schedule (pytest.approx defaults on
# simulated makespans, which are exact sums of unit costs).


def assert_same_losses(actual, expected):
    import torch
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=LOSS_RTOL, atol=0,
                               msg=lambda m: f"losses of every step: {m}")


def assert_same_parameters(actual: dict, expected: dict):
    import torch
    assert actual.keys() == expected.keys(), set(actual) ^ set(expected)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=PARAMETER_RTOL,
                                   atol=PARAMETER_ATOL, msg=lambda m: f"{name}: {m}")


def gradient_atol(expected, initial, learning_rate: float) -> float:
    """The absolute part of a gradient tensor's tolerance: GRADIENT_SCALE_ATOL of its largest
    entry, plus the rounding of recovering it from fp32 weights (GRADIENT_RECOVERY_EPS)."""
    return (GRADIENT_SCALE_ATOL * float(expected.abs().max())
            + GRADIENT_RECOVERY_EPS * float(initial.abs().max()) / learning_rate)


def assert_same_gradients(actual: dict, expected: dict, initial: dict, learning_rate: float):
    """First-step gradients g = (p0 − p1)/lr equal, tensor by tensor (see the tolerance table)."""
    import torch
    assert actual.keys() == expected.keys(), set(actual) ^ set(expected)
    for name, gradient in expected.items():
        torch.testing.assert_close(actual[name], gradient, rtol=GRADIENT_RTOL,
                                   atol=gradient_atol(gradient, initial[name], learning_rate),
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")


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
    that module's `run(directory, *overrides)`, so every strategy case compares with the same one."""
    cache = {}

    def reference(layers):
        if layers not in cache:
            directory = tmp_path_factory.mktemp(f"single{layers}")
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
# the parameter tolerance (1e-5 + 1e-5·|p|) on 86.7% of the 61,854 weights with a gradient, by a
# median 60× (the rest are mostly query/key weights, whose gradient is ~1e-5 at initialisation);
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
SGD_CASES = {
    "ddp_dp2": SgdCase(["strategy=ddp"], 2),
    "modular_pipeline_pp2_v2_m4": SgdCase(["strategy=modular_pipeline", "strategy.pipeline_degree=2"], 2),
    "modular_pipeline_pp2_dp2_v2_m4": SgdCase(["strategy=modular_pipeline", "strategy.pipeline_degree=2",
                                               "hardware.devices_per_node=4"], 4),
    "gpipe_pp2_m4": SgdCase(["strategy=gpipe"], 2),
    "one_f_one_b_pp2_m4": SgdCase(["strategy=one_f_one_b"], 2),
    "interleaved_1f1b_pp2_v2_m4": SgdCase(["strategy=interleaved_1f1b"], 2),
    "zero_layered_dp2_m4": SgdCase(["strategy=zero_layered"], 2),
    "zero_layered_pp2_dp2_m4": SgdCase(["strategy=zero_layered", "strategy.pipeline_degree=2",
                                        "hardware.devices_per_node=4"], 4),
    "zero_depth_first_dp2_m4": SgdCase(["strategy=zero_depth_first"], 2),
    "fsdp2_dp2_m4": SgdCase(["strategy=fsdp2"], 2),
    "three_d_q2": SgdCase(["strategy=three_d", "hardware.devices_per_node=8"], 8),
    "tp_1d_p2": SgdCase(["strategy=tp_1d", "strategy.tensor_grid=2"], 2),
    "tp_2d_q2": SgdCase(["strategy=tp_2d", "hardware.devices_per_node=4"], 4),
    "l2l_m4": SgdCase(["strategy=l2l", "hardware.devices_per_node=1"], 1),
    "l2l_dp2_m2_const": SgdCase(["strategy=l2l", "strategy.micro_batches=2", "strategy.constant_memory=true"], 2),
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


def train_saving_steps(cfg, directory, steps=(1,)):
    """layerwise.run.fit.train, with checkpoints after the given steps too (the ranks are forked from
    this process, so the patched trainer factory reaches them). One thread, as every forked rank
    has (layerwise.run.launch): a one-process run in this process would otherwise spin several OpenMP
    threads on cores other tests share (10× slower under load)."""
    import torch

    import layerwise.run.fit as run_module
    from layerwise.preflight import validate

    original, threads = run_module.build_trainer, torch.get_num_threads()

    def build_trainer(*arguments, **keywords):
        trainer = original(*arguments, **keywords)
        trainer.callbacks.append(step_checkpoints(tuple(steps)))
        return trainer
    run_module.build_trainer = build_trainer
    torch.set_num_threads(1)
    try:
        return run_module.train(cfg, directory, validate(cfg))
    finally:
        run_module.build_trainer = original
        torch.set_num_threads(threads)


class SgdRun:
    """One run under SGD_OVERRIDES: its summary, and its consolidated weights after steps 0 (when
    saved), 1 and the last."""

    def __init__(self, directory, *overrides, initial=False, steps=SGD_STEPS):
        cfg = compose_config(*QUICK, *SGD_MODEL, *SGD_OVERRIDES, f"trainer.max_steps={steps}", *overrides)
        self.learning_rate = float(cfg.optimizer.lr)
        self.strategy = cfg.strategy.name
        self.summary = train_saving_steps(cfg, directory, (0, 1) if initial else (1,))
        assert self.summary["status"] == "completed", self.summary.get("error")
        assert self.summary["steps"] == steps and self.summary["strategy"] == self.strategy
        self.initial = consolidated_parameters(directory, self.strategy, "step0") if initial else None
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

    def check(self) -> None:
        print(f"{self.actual.strategy} vs {self.expected.strategy} under SGD, worst difference / "
              f"tolerance: " + ", ".join(f"{kind} {value:.3g} ({where})"
                                         for kind, (value, where) in self.excess().items()))
        assert_same_losses(self.actual.summary["losses"], self.expected.summary["losses"])
        assert_same_gradients(self.actual_gradients, self.expected_gradients, self.expected.initial,
                              self.expected.learning_rate)
        assert_same_parameters(self.actual.last, self.expected.last)

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
                                           PARAMETER_RTOL, PARAMETER_ATOL), name)
                         for name in self.expected.last)
        return {"losses": (losses, "losses"), "gradients": gradients, "parameters": parameters}


def compare_under_sgd(case: str, tmp_path, tmp_path_factory) -> SgdComparison:
    """Run SGD_CASES[case] and compare it with its (cached) reference run."""
    overrides, world, reference = SGD_CASES[case]
    expected = sgd_reference(tmp_path_factory, *reference)
    comparison = SgdComparison(SgdRun(tmp_path, *overrides), expected)
    assert comparison.actual.summary["world_size"] == world, comparison.actual.summary["layout"]
    return comparison


def tolerance_excess(actual, expected, rtol: float, atol: float) -> float:
    """max |a − e| / (atol + rtol·|e|): above 1 exactly where torch.testing.assert_close fails."""
    import torch
    difference = (actual.double() - expected.double()).abs()
    allowed = atol + rtol * expected.double().abs()
    ratio = torch.where(difference == 0, 0.0, difference / allowed)  # 0/0 is a match, x/0 infinite
    return float(ratio.max()) if ratio.numel() else 0.0


# What a checkpoint holds that is evidence, not training state: the evidence callback's wall-clock
# step times (they differ between any two runs) and the version string.
NOT_TRAINING_STATE = ("callbacks", "pytorch-lightning_version")


def checkpoint_files(run_directory) -> dict:
    """`last.ckpt` of a run, as {file name: path}: the single file, or every `rank{r}.pt`."""
    from pathlib import Path

    path = Path(run_directory) / "checkpoints" / "last.ckpt"
    if path.is_file():
        return {path.name: path}
    assert path.is_dir(), f"{path}: no checkpoint"
    return {p.name: p for p in sorted(path.glob("rank*.pt"), key=lambda p: int(p.stem[4:]))}


# Lightning marks the epoch finished when max_steps ends the fit, so a last checkpoint written at the
# end of training (on_train_end) and one written after the last batch (checkpoint_every_n_steps
# divides max_steps) differ in these counters while their training state is the same: skip them
# (`skip=SAVED_AT_ANOTHER_HOOK`) only when the two runs saved at different hooks.
SAVED_AT_ANOTHER_HOOK = ("epoch", "loops")


def assert_same_checkpoints(directory_a, directory_b, skip=()) -> int:
    """The two runs' final checkpoints hold the same training state, bit for bit, on every rank.

    Compared tensor by tensor (dtype, shape and bytes, so -0.0 ≠ 0.0 and NaN = NaN): the model's
    state dict, every optimizer's state (AdamW's and LAMB's step, exp_avg, exp_avg_sq) and param
    groups, the schedulers, the loops' counters, and whatever a strategy adds (PipeFisher's `kfac`:
    factors, inverses, pending captures). Only NOT_TRAINING_STATE and `skip` are skipped. Returns the
    number of tensors compared.
    """
    import torch

    files_a, files_b = checkpoint_files(directory_a), checkpoint_files(directory_b)
    assert files_a.keys() == files_b.keys(), (list(files_a), list(files_b))
    compared = 0
    for name in files_a:
        a, b = (torch.load(files[name], weights_only=False, map_location="cpu") for files in (files_a, files_b))
        skipped = set(NOT_TRAINING_STATE) | set(skip)
        keys = set(a) - skipped
        assert keys == set(b) - skipped, f"{name}: {sorted(set(a) ^ set(b))}"
        assert {"state_dict", "optimizer_states"} <= keys, f"{name}: {sorted(keys)}"
        for key in sorted(keys):
            compared += _assert_same_state(a[key], b[key], f"{name}:{key}")
    assert compared > 0
    return compared


def _assert_same_state(a, b, where: str) -> int:
    """Recursive exact equality of checkpoint contents; the number of tensors compared."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: tensor vs {type(b).__name__}"
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{where}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
        same = torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
        if not same:
            difference = (a.double() - b.double()).abs().max().item() if a.is_floating_point() else "n/a"
            raise AssertionError(f"{where}: tensors differ (largest difference {difference})")
        return 1
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(map(str, set(a) ^ set(b)))}"
        return sum(_assert_same_state(a[key], b[key], f"{where}.{key}") for key in a)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        return sum(_assert_same_state(x, y, f"{where}[{index}]") for index, (x, y) in enumerate(zip(a, b)))
    assert a == b, f"{where}: {a!r} vs {b!r}"
    return 0
