"""Selective recomputation (`strategy.activation_recompute=selective`, Korthikanti et al. 2022 §5):
only the core attention (models.CoreAttention: Q·Kᵀ, softmax, scores·V) reruns in the backward.

Numbers: the rerun is the same computation on the same q, k, v (and, with preserve_rng_state, the
same RNG state), so every strategy's losses, first-step gradients and parameters are bit-identical
to its own `none` run, under SGD and AdamW, with dropout > 0 (the embedding's, the attention
output's and the MLP's masks: the core has none of its own). Each strategy's `none` run equals
`single` within tests/tolerances.py (tests/references.py SGD_CASES); bit-identity carries that over.
Memory: what the core no longer keeps, measured by the meter block by block, against plan mode's
count (cost/memory.py with `recompute_attention`), for the fused (flash) and the math kernel.
"""

from dataclasses import replace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from cost.memory import block_extra_bytes, block_saved_bytes, memory
from layerwise.config.errors import ConfigError
from layerwise.planning.inputs import as_planned, training_plan_of, workload_of
from layerwise.preflight import validate
from layerwise.run.fit import train
from models import CoreAttention, build_model, describe_block
from parallel.memory import ComputeMemoryMeter
from strategies.modular_pipeline import build
from strategies.recompute import RecomputedForward, apply_activation_recompute, attention_share, backward_factor
from strategies.split_backward import input_gradient
from strategies.schedule import flop_cost, simulate
from tests.ranks import QUICK, compose_config
from tests.references import LLAMA, SGD_OVERRIDES, consolidated_parameters, train_saving_steps

STEPS = 2  # the second step: new dropout masks on updated weights (and AdamW moments)
GPT = ("model.dropout=0.1",)  # Llama has no dropout
STRATEGIES = {
    "single": ("strategy=single",),
    "modular_pipeline_pp2": ("strategy=modular_pipeline", "model.layers=4"),
    "zero_layered_dp2": ("strategy=zero_layered",),
    "tp_1d_q2": ("strategy=tp_1d", "strategy.tensor_grid=2"),
    # a split backward: I reruns the core (it lies on the input's path), W needs none of it
    "zero_bubble_h1_pp2": ("strategy=one_f_one_b", "strategy.schedule=zero_bubble_h1", "model.layers=4"),
}
OPTIMIZERS = {"sgd": tuple(SGD_OVERRIDES), "adamw": ("optimizer=adamw",)}
# Each strategy with both models and both optimizers across the table (every run is two runs).
CASES = [("single", "gpt", "sgd"), ("single", "gpt", "adamw"), ("single", "llama", "sgd"),
         ("modular_pipeline_pp2", "gpt", "adamw"), ("modular_pipeline_pp2", "llama", "sgd"),
         ("zero_layered_dp2", "gpt", "sgd"), ("zero_layered_dp2", "llama", "adamw"),
         ("tp_1d_q2", "gpt", "adamw"), ("tp_1d_q2", "llama", "sgd"),
         ("zero_bubble_h1_pp2", "gpt", "sgd")]


def run(directory, *overrides):
    cfg = compose_config(*QUICK, f"trainer.max_steps={STEPS}", "trainer.limit_val_batches=0",
                         f"trainer.val_check_interval={STEPS}", "trainer.measure_every_n_steps=1", *overrides)
    summary = train_saving_steps(cfg, directory, steps=(1,))
    assert summary["status"] == "completed", summary.get("error")
    return summary


@pytest.mark.parametrize("strategy, model, optimizer", CASES, ids=["-".join(case) for case in CASES])
def test_selective_recompute_is_bit_identical_to_none(strategy, model, optimizer, tmp_path):
    """Losses, the parameters after step 1 (under SGD without momentum p1 = p0 − lr·g: the first
    step's gradients) and after the last step are bit-identical; the meter's peak is lower (the
    core's log-sum-exp per head and token is not kept: the rerun did happen)."""
    overrides = (*STRATEGIES[strategy], *(GPT if model == "gpt" else LLAMA), *OPTIMIZERS[optimizer])
    name = overrides[0].removeprefix("strategy=")
    summaries, weights = {}, {}
    for mode in ("none", "selective"):
        summaries[mode] = run(tmp_path / mode, *overrides, f"strategy.activation_recompute={mode}")
        weights[mode] = [consolidated_parameters(tmp_path / mode, name, checkpoint) for checkpoint in ("step1", "last")]
    assert summaries["selective"]["losses"] == summaries["none"]["losses"]
    for recomputed, kept in zip(weights["selective"], weights["none"]):
        assert recomputed.keys() == kept.keys()
        for key, value in kept.items():
            assert torch.equal(recomputed[key], value), key
    peaks = {mode: summary["peak_compute_bytes"] for mode, summary in summaries.items()}
    print(f"{strategy} {model} {optimizer}: peak compute bytes none {peaks['none']:.0f}, selective {peaks['selective']:.0f}")
    assert peaks["selective"] < peaks["none"]


def test_a_split_backward_reruns_the_core_attention_once_in_i_and_never_in_w():
    """Zero-bubble schedules keep a micro-batch's graph from I to W. The core attention has no
    weights, so it lies on I's path only: I reruns it once per block, W reruns nothing (under `full`
    the W of each weight inside a block would unpack the checkpoint's tensors and rerun the block
    again: why the zero-bubble schedules refuse `full`)."""
    calls = {}
    for mode in ("selective", "full"):
        model = build_model("gpt", vocab_size=64, sequence_length=16, layers=2, hidden=32, heads=2, dropout=0.1)
        apply_activation_recompute(model, mode)
        count = [0]
        for block in model.blocks.values():
            recomputed = block if mode == "full" else block.attention.core_attention
            original = recomputed.forward.forward

            def counted(*arguments, original=original):
                count[0] += 1
                return original(*arguments)
            recomputed.forward.forward = counted
        stage_input = model.embed(torch.randint(0, 64, (2, 16))).detach().requires_grad_()
        output = stage_input
        for block in model.blocks.values():
            output = block(output)
        forwards = count[0]
        _, pending = input_gradient(output, torch.ones_like(output), stage_input, list(model.blocks.parameters()))
        after_i = count[0] - forwards
        pending.run()
        calls[mode] = (forwards, after_i, count[0] - forwards - after_i)
    assert calls["selective"] == (2, 2, 0)  # (forward, I, W) per block
    assert calls["full"][2] > 0
    print(f"(forward, I, W) runs of the recomputed modules over 2 blocks: {calls}")


def test_zero_bubble_refuses_full_and_accepts_selective():
    overrides = ("strategy=one_f_one_b", "strategy.schedule=zero_bubble_h1", "model.layers=4")
    validate(compose_config(*QUICK, *overrides, "strategy.activation_recompute=selective"))
    with pytest.raises(ConfigError) as caught:
        validate(compose_config(*QUICK, *overrides, "strategy.activation_recompute=full"))
    assert "Fix: strategy.activation_recompute=none or selective" in str(caught.value)


def test_selective_wraps_only_the_core_attention_and_keeps_parameter_names():
    for architecture, extra in (("gpt", {}), ("bert", {}), ("llama", {"kv_heads": 2})):
        model = build_model(architecture, vocab_size=64, sequence_length=16, layers=2, hidden=32, heads=4, **extra)
        names = [name for name, _ in model.named_parameters()]
        apply_activation_recompute(model, "selective")
        apply_activation_recompute(model, "selective")  # Lightning may set up twice: wrapped once
        assert [name for name, _ in model.named_parameters()] == names
        for block in model.blocks.values():
            assert isinstance(block.attention.core_attention, CoreAttention)
            assert isinstance(block.attention.core_attention.forward, RecomputedForward)
            assert not isinstance(block.attention.core_attention.forward.forward, RecomputedForward)
            assert not isinstance(block.forward, RecomputedForward)


def test_backward_factor_adds_the_core_attentions_share_of_the_forward():
    """4·s·h of 2·W + 4·s·h FLOPs per token: GPT (W = 12h²) s / (6h + s); plan mode's
    core_attention_seconds prices the same 4·b·s²·h per block."""
    gpt = describe_block("gpt", hidden=32, heads=2)
    assert attention_share(gpt, 32) == pytest.approx(32 / (6 * 32 + 32), rel=1e-12)
    assert backward_factor("selective", attention_share(gpt, 32)) == pytest.approx(2 + 1 / 7, rel=1e-12)
    assert (backward_factor("none"), backward_factor("full")) == (2.0, 3.0)
    cfg = compose_config("strategy=modular_pipeline", "model.layers=4", "strategy.activation_recompute=selective",
                         "data.sequence_length=32", "model.hidden=32", "model.heads=2")
    strategy = build(cfg, 2)
    assert strategy.attention_share == pytest.approx(1 / 7, rel=1e-12)
    assert strategy.simulated_timeline() == simulate(strategy.plan, flop_cost(1.0, 1.0, backward_factor=2 + 1 / 7))


# b = 2 sequences of s = 64 tokens, h = 64, 4 heads (Llama: 2 kv heads), two blocks.
MEMORY_SHAPE = dict(vocab_size=256, sequence_length=64, layers=2, hidden=64, heads=4, seed=0)
ROWS = 2


def kept_per_block(architecture: str, mode: str, backend) -> float:
    """Bytes the blocks keep for the backward after their forward, per block, as the meter counts them."""
    extra = {"dropout": 0.1} if architecture == "gpt" else {"kv_heads": 2}
    model = build_model(architecture, **MEMORY_SHAPE, **extra)
    apply_activation_recompute(model, mode)
    meter = ComputeMemoryMeter()
    meter.resident(list(model.parameters()))
    with sdpa_kernel(backend), meter:
        x = model.embed(torch.randint(0, 256, (ROWS, MEMORY_SHAPE["sequence_length"])))
        before = meter.live_bytes
        for block in model.blocks.values():
            x = block(x)
        kept = meter.live_bytes - before - x.untyped_storage().nbytes()
        x.sum().backward()  # the rerun works under this kernel too
    return kept / MEMORY_SHAPE["layers"]


def planned_per_block(architecture: str, selective: bool, flash: bool) -> float:
    model = ["model=llama_tiny", "model.kv_heads=2"] if architecture == "llama" else []
    cfg = compose_config("strategy=single", *model, "model.hidden=64", "model.heads=4", "data.sequence_length=64",
                         f"data.global_batch_size={ROWS}", "model.ffn_hidden=256" if architecture == "llama" else "model.mlp_ratio=4")
    workload = replace(workload_of(as_planned(cfg), 1), recompute_attention=selective)
    tokens = ROWS * MEMORY_SHAPE["sequence_length"]
    return block_saved_bytes(workload, tokens, flash) + block_extra_bytes(workload, tokens)


@pytest.mark.parametrize("architecture", ["gpt", "llama"])
@pytest.mark.parametrize("kernel", ["flash", "math"])
def test_selective_saves_what_plan_mode_predicts(architecture, kernel):
    """What selective stops keeping, per block and micro-batch: with the fused kernel (flash, the CPU's
    default here) only its log-sum-exp (fp32, heads per token: the output is proj's saved input
    anyway); with the math kernel the softmax probabilities (heads·s per token) and, under GQA, K and
    V repeated to every head (2·(heads − kv)·d). Plan mode's count of the same tensors within 5%
    (exact but for the log-sum-exp plan mode counts under the math kernel too: +1.6% / +1.3%)."""
    backend = SDPBackend.FLASH_ATTENTION if kernel == "flash" else SDPBackend.MATH
    measured = kept_per_block(architecture, "none", backend) - kept_per_block(architecture, "selective", backend)
    predicted = (planned_per_block(architecture, False, kernel == "flash")
                 - planned_per_block(architecture, True, kernel == "flash"))
    print(f"{architecture} {kernel}: selective keeps {measured:.0f} bytes less per block (plan: {predicted:.0f}, "
          f"ratio {predicted / measured:.3f})")
    assert 1.0 <= predicted / measured <= 1.05


PLAN_VS_MEASURED = ("logger=none", "trainer.progress=none", "trainer.limit_val_batches=0", "model.layers=8",
                    "model.hidden=64", "model.heads=4", "data.sequence_length=64", "data.global_batch_size=8",
                    "strategy=single", "plan.flash_attention=false", "trainer.max_steps=2",
                    "trainer.measure_every_n_steps=1")


def test_a_runs_peak_falls_by_the_scores_plan_mode_predicts(tmp_path):
    """A whole run (single: 8 blocks, h = 64, s = 64, batch 8) on the math kernel, whose scores plan
    mode counts under plan.flash_attention=false: cost.memory's peak (`recompute_attention`, the field
    plan mode sets from strategy.activation_recompute=selective) within −3% / +5% of the meter's with
    and without selective, and the peak falls by the scores (the pipelines' figures:
    docs/strategies/modular_pipeline.md)."""
    peaks = {}
    for mode in ("none", "selective"):
        cfg = compose_config(*PLAN_VS_MEASURED, f"strategy.activation_recompute={mode}")
        workload = replace(workload_of(cfg, 1), recompute_attention=mode == "selective")
        predicted = sum(memory(workload, training_plan_of(cfg), 0, flash=False).values())
        with sdpa_kernel(SDPBackend.MATH):  # (forked ranks would inherit the choice too)
            measured = train(cfg, tmp_path / mode, validate(cfg))["peak_compute_bytes"]
        peaks[mode] = predicted, measured
        print(f"math kernel, {mode}: predicted {predicted / 2**20:.3f} MiB, measured {measured / 2**20:.3f} MiB "
              f"({predicted / measured:.4f})")
        assert 0.97 <= predicted / measured <= 1.05
    assert peaks["selective"][1] < 0.9 * peaks["none"][1]
