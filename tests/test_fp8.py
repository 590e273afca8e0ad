"""hardware.precision=fp8-mixed (issue 59 item 2): the blocks' linears through torchao's float8 training.

Proven on CPU with torchao's emulation (hardware.fp8_emulate=true: the FP8 casts and scales exact, the
products in high precision). Two claims, each with a tolerance from the formats' rounding:

1. **A strategy under FP8 equals `single` under FP8 with the same recipe** (rowwise: each token's
   row scaled by itself, so a micro-batch or a data shard rounds as the whole batch does; TORCH.md).
   The two runs differ as two bf16-mixed runs do, by the order of fp32 sums (one bf16 rounding,
   u = 2^-8, of an operand), except that an operand landing on the other side of an e4m3 rounding
   boundary moves by one e4m3 step (2^-3 of itself, 32 u) instead of one bf16 step. A perturbation
   of u moves an operand across a boundary with probability ≈ u / 2^-3 = 1/32, so the expected
   perturbation per operand stays ≈ u, but a single element of a product may move by one FP8 step
   of one of its terms. Bound per tensor of first-step gradients: SAME_RECIPE_GRADIENT = 2^-3 of the
   tensor's largest |g| (one e4m3 step of its scale; a gradient off by a factor 2 exceeds it
   8x). Losses: SAME_RECIPE_LOSS_RTOL = 2^-3 · 2^-5 = 2^-8 (one e4m3 step spread
   over the ~1/32 of operands that cross a boundary: the mean over tokens keeps bf16's order).
   Parameters after T SGD steps: Σ_t lr · 2^-3 · max|g_t| per tensor (the reference's trajectory).
2. **FP8 is within a stated tolerance of bf16-mixed.** Forward: each product's two operands are
   rounded to e4m3 (≤ 2^-4 each), so its output to ≤ 2^-3 of Σ|x||w|; backward: the output gradient
   to e5m2 under tensorwise (≤ 2^-3; e4m3 under rowwise, ≤ 2^-4) times an e4m3 operand (≤ 2^-4):
   ≤ 3·2^-4 relative, plus the forward's 2^-3 carried in: FP8_GRADIENT = 2^-2 of each tensor's largest
   |g| (TORCH.md measured 9% per element against fp32, inside it). Losses: the block outputs carry
   ≤ 2^-3 relative, averaged by the residual stream and the mean over tokens: FP8_LOSS_RTOL = 2^-3.
"""

import pytest
import torch

from layerwise.preflight import validate
from strategies.float8 import INSTALL, KFAC, TENSOR_GRID, float8_errors, torchao_available
from tests.ranks import QUICK, compose_config
from tests.references import SgdRun

# the runs and the conversion need torchao; the refusals are checked without it too
needs_torchao = pytest.mark.skipif(not torchao_available(), reason=f"torchao is not installed ({INSTALL})")

FP8 = ("hardware.precision=fp8-mixed", "hardware.fp8_emulate=true")
E4M3_STEP = 2.0 ** -3  # 3 mantissa bits: adjacent e4m3 values differ by 2^-3 of the smaller
SAME_RECIPE_GRADIENT = E4M3_STEP
SAME_RECIPE_LOSS_RTOL = E4M3_STEP * 2.0 ** -5
FP8_GRADIENT = 2.0 ** -2
FP8_LOSS_RTOL = E4M3_STEP


def gradient_excess(actual: SgdRun, expected: SgdRun, fraction: float) -> tuple:
    """Worst per-tensor max|Δg| / (fraction · max|g|) of the first step's gradients, and where."""
    initial = expected.initial
    got, want = actual.gradients(initial), expected.gradients(initial)
    return max(((got[name] - want[name]).abs().max().item() / (fraction * want[name].abs().max().item() + 1e-30), name)
               for name in want if want[name].abs().max() > 0)


def parameter_excess(actual: SgdRun, expected: SgdRun, fraction: float) -> tuple:
    """Worst per-tensor max|Δp| after the last step / Σ_t lr·fraction·max|g_t| (the reference's steps)."""
    trajectory = expected.trajectory
    worst = (0.0, "")
    for name in expected.last:
        bound = sum(fraction * (before[name] - after[name]).abs().max().item()  # lr·fraction·max|g_t|
                    for before, after in zip(trajectory, trajectory[1:]))
        difference = (actual.last[name] - expected.last[name]).abs().max().item()
        worst = max(worst, (difference / (bound + 1e-30), name))
    return worst


def loss_excess(actual: SgdRun, expected: SgdRun, rtol: float) -> float:
    return max(abs(a - b) / (rtol * abs(b)) for a, b in zip(actual.summary["losses"], expected.summary["losses"]))


def excess(actual, expected, gradient: float, loss_rtol: float) -> dict:
    return {"losses": loss_excess(actual, expected, loss_rtol),
            "gradients": gradient_excess(actual, expected, gradient),
            "parameters": parameter_excess(actual, expected, gradient)}


def assert_within(table: dict) -> None:
    print(table)
    assert table["losses"] <= 1 and table["gradients"][0] <= 1 and table["parameters"][0] <= 1, table


_REFERENCES = {}


def fp8_single(tmp_path_factory, *overrides) -> SgdRun:
    if overrides not in _REFERENCES:
        _REFERENCES[overrides] = SgdRun(tmp_path_factory.mktemp("fp8_single"), "strategy=single", *overrides,
                                        initial=True)
    return _REFERENCES[overrides]


# ----- the conversion ----------------------------------------------------------------------------------

@needs_torchao
def test_float8_linear_keeps_the_parameters_and_their_names():
    """Float8Linear shares the nn.Linear's Parameters (same objects) and adds no buffer, so the
    state dict, the optimizer's parameters and checkpoints are unchanged; converting twice is a no-op."""
    from models import build_model
    from strategies.float8 import convert_blocks
    model = build_model("gpt", vocab_size=64, sequence_length=16, layers=2, hidden=16, heads=2, seed=0)
    model.materialise("cpu")
    before = dict(model.named_parameters())
    names = list(model.state_dict())
    linears = sum(type(m) is torch.nn.Linear for block in model.blocks.values() for m in block.modules())
    assert convert_blocks(model, "rowwise", emulate=True) == linears > 0
    assert convert_blocks(model, "rowwise", emulate=True) == linears
    assert list(model.state_dict()) == names
    assert all(parameter is before[name] for name, parameter in model.named_parameters())


# ----- refused before any process starts, with the reason -----------------------------------------------

@pytest.mark.parametrize("overrides, words", [
    (["hardware.precision=fp8-mixed"], "a CPU has no FP8 matrix products"),
    (["hardware=dgx_a100_80g", "hardware.precision=fp8-mixed"], "no FP8 tensor cores"),
    (["hardware=dgx1_v100", "hardware.precision=fp8-mixed"], "no FP8 tensor cores"),
    ([*FP8, "strategy=tp_1d", "strategy.tensor_grid=2"], TENSOR_GRID[:60]),
    ([*FP8, "strategy=one_f_one_b", "strategy.tensor_parallel=1d", "strategy.tensor_grid=2",
      "hardware.devices_per_node=4"], TENSOR_GRID[:60]),
    ([*FP8, "strategy=kfac"], KFAC[:60]),
    ([*FP8, "hardware.fp8_recipe=blockwise"], "hardware.fp8_recipe=blockwise"),
])
def test_fp8_is_refused_where_it_cannot_run(overrides, words):
    errors = float8_errors(compose_config(*QUICK, *overrides))
    assert any(words in error and "Fix:" in error for error in errors), errors


def test_fp8_is_accepted_on_h100_and_refused_without_torchao(monkeypatch):
    """dgx_h100 has an fp8 rate (the datasheet's 1,979 TFLOP/s dense): accepted; without torchao the
    error names the install."""
    cfg = compose_config(*QUICK, "hardware=dgx_h100", "hardware.precision=fp8-mixed")
    monkeypatch.setattr("strategies.float8.torchao_available", lambda: True)
    assert float8_errors(cfg) == []
    monkeypatch.setattr("strategies.float8.torchao_available", lambda: False)
    assert any(INSTALL in error for error in float8_errors(cfg))


@needs_torchao
def test_validation_refuses_fp8_on_cpu_naming_the_emulation():
    from layerwise.config.errors import ConfigError
    with pytest.raises(ConfigError, match="hardware.fp8_emulate=true"):
        validate(compose_config(*QUICK, "hardware.precision=fp8-mixed"))
    validate(compose_config(*QUICK, *FP8))


# ----- every strategy that accepts it equals single under the same recipe -------------------------------

STRATEGIES = {
    "ddp_dp2": ["strategy=ddp"],
    "fsdp2_dp2": ["strategy=fsdp2"],
    "modular_pipeline_pp2": ["strategy=modular_pipeline", "strategy.pipeline_degree=2"],
    "zero_bubble_h1_pp2": ["strategy=one_f_one_b", "strategy.schedule=zero_bubble_h1"],
    "zero_layered_dp2": ["strategy=zero_layered"],
    "l2l": ["strategy=l2l"],
}


@needs_torchao
def test_tensorwise_scales_follow_the_batch_each_rank_sees(tmp_path, tmp_path_factory):
    """Tensorwise: each data rank scales its half of the batch by its own amax, so ddp rounds otherwise
    than single (TORCH.md), measured 0.47 of the same-recipe gradient bound against rowwise's 0.04:
    still inside it, and reported as such rather than as equality."""
    tensorwise = (*FP8, "hardware.fp8_recipe=tensorwise")
    actual = SgdRun(tmp_path, "strategy=ddp", *tensorwise)
    assert_within(excess(actual, fp8_single(tmp_path_factory, *tensorwise), SAME_RECIPE_GRADIENT,
                         SAME_RECIPE_LOSS_RTOL))


@needs_torchao
@pytest.mark.parametrize("case", STRATEGIES)
def test_a_strategy_under_fp8_equals_single_under_the_same_recipe(case, tmp_path, tmp_path_factory):
    """Rowwise, SGD: losses, first-step gradients and parameters within the same-recipe bounds
    (module docstring, 1); every rank's blocks hold Float8Linear (summary's fp8 record)."""
    actual = SgdRun(tmp_path, *STRATEGIES[case], *FP8)
    assert actual.summary["fp8"]["recipe"] == "rowwise" and actual.summary["fp8"]["linears"] > 0, actual.summary["fp8"]
    assert_within(excess(actual, fp8_single(tmp_path_factory, *FP8), SAME_RECIPE_GRADIENT, SAME_RECIPE_LOSS_RTOL))


@needs_torchao
def test_a_pipeline_under_fp8_equals_single_under_adamw(tmp_path_factory):
    """3 AdamW steps, rowwise: losses within the same-recipe bound; parameters within the update rule's
    bound (tolerances.adam_tolerance) for gradients that differ by one e4m3 step of their scale."""
    from layerwise.run.fit import train
    from tests.references import consolidated_parameters, tracing_optimizer
    from tests.tolerances import OptimizerTrace, assert_same_parameters
    common = [*QUICK, "model.layers=4", "data.global_batch_size=16", "trainer.limit_val_batches=0",
              "trainer.val_check_interval=3", "trainer.max_steps=3", *FP8]
    expected_directory, actual_directory = tmp_path_factory.mktemp("fp8_single_adamw"), tmp_path_factory.mktemp("fp8_adamw")
    with tracing_optimizer(expected_directory):
        cfg = compose_config(*common, "strategy=single")
        expected = train(cfg, expected_directory, validate(cfg))
    cfg = compose_config(*common, "strategy=modular_pipeline", "strategy.pipeline_degree=2")
    actual = train(cfg, actual_directory, validate(cfg))
    assert expected["status"] == actual["status"] == "completed"
    worst = max(abs(a - e) / abs(e) for a, e in zip(actual["losses"], expected["losses"]))
    print(f"AdamW fp8 losses, worst relative difference {worst:.3g} (bound {SAME_RECIPE_LOSS_RTOL:.3g})")
    assert worst <= SAME_RECIPE_LOSS_RTOL
    assert_same_parameters(consolidated_parameters(actual_directory, "modular_pipeline"),
                           consolidated_parameters(expected_directory, "single"),
                           OptimizerTrace.load(expected_directory), rounding=SAME_RECIPE_GRADIENT)


# ----- FP8 against bf16-mixed -------------------------------------------------------------------------

@needs_torchao
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_fp8_is_within_its_tolerance_of_bf16(recipe, tmp_path, tmp_path_factory):
    """single under fp8-mixed against single under bf16-mixed (module docstring, 2), and not equal to
    it (the conversion ran: the first step's gradients differ)."""
    actual = fp8_single(tmp_path_factory, *FP8, f"hardware.fp8_recipe={recipe}")
    bf16 = fp8_single(tmp_path_factory, "hardware.precision=bf16-mixed")
    table = excess(actual, bf16, FP8_GRADIENT, FP8_LOSS_RTOL)
    assert_within(table)
    assert table["gradients"][0] > 0


# ----- plan mode: FP8 products at the profile's FP8 rate, MFU against bf16's --------------------------

def test_plan_prices_the_blocks_linears_at_the_fp8_rate_and_states_mfu_against_bf16():
    """dgx_h100 (datasheet: 989 bf16, 1,979 fp8 dense TFLOP/s): under fp8-mixed the device's peak (MFU's
    denominator, layerwise/run/evidence.py reads it) stays bf16's and the blocks' linears run at the fp8
    rate: the stage's linear seconds halve, the head's and attention's products keep bf16's."""
    from cost.step_time import products_seconds
    from layerwise.planning.inputs import device_of, workload_of
    common = ["model=llama3_8b", "hardware=dgx_h100", "hardware.nodes=1", "strategy=modular_pipeline",
              "strategy.pipeline_degree=2", "data.global_batch_size=64", "data.sequence_length=4096", "mode=plan"]
    bf16, fp8 = (compose_config(*common, f"hardware.precision={p}") for p in ("bf16-mixed", "fp8-mixed"))
    assert device_of(fp8).flops_per_second == device_of(bf16).flops_per_second == 9.89e14
    assert device_of(fp8).linear_peak == 1.979e15 and device_of(bf16).linear_peak == 9.89e14
    (blocks_bf16, head_bf16), (blocks_fp8, head_fp8) = (products_seconds(workload_of(c, 8), device_of(c), 1, 2)
                                                        for c in (bf16, fp8))
    assert head_fp8 == head_bf16
    assert 0.5 < blocks_fp8 / blocks_bf16 < 0.6  # linears ÷ 2.001; attention's per-head products unchanged
