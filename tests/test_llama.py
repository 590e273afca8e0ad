"""models/llama.py against a hand-written reference (loops over heads, explicit rotation matrices,
repeated K/V, an explicit causal mask), and the checks that refuse a bad Llama config."""

import math

import pytest
import torch

from models import build_model
from models.llama import rotary_frequencies
from tests.ranks import compose_config

SHAPE = dict(vocab_size=256, sequence_length=64, layers=2, hidden=64, heads=4, ffn_hidden=96, seed=3)


def rms_norm(x, weight, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def rotation(length, head_dim, frequencies):
    """R[t] such that rope(x)[t] = R[t] @ x[t], pairing feature i with i + d/2."""
    half, matrices = head_dim // 2, torch.zeros(length, head_dim, head_dim, dtype=torch.float64)
    for t in range(length):
        for i in range(half):
            angle = t * float(frequencies[i])
            matrices[t, i, i], matrices[t, i, i + half] = math.cos(angle), -math.sin(angle)
            matrices[t, i + half, i], matrices[t, i + half, i + half] = math.sin(angle), math.cos(angle)
    return matrices


def reference_logits(model, tokens):
    """The Llama forward written out in float64, one head at a time."""
    p = {name: value.double() for name, value in model.state_dict().items()}
    heads, kv_heads, eps = model.heads, model.kv_heads, model.norm_eps
    d, length = model.hidden // heads, tokens.shape[1]
    rotate = rotation(length, d, rotary_frequencies(d, model.rope_theta, model.rope_scaling))
    mask = torch.full((length, length), float("-inf"), dtype=torch.float64).triu(1)
    x = p["embed.token.weight"][tokens]
    for block in range(model.layers):
        w = lambda name: p[f"blocks.{block}.{name}"]
        b = lambda name: p.get(f"blocks.{block}.{name}", 0)
        normed = rms_norm(x, w("norm_attention.weight"), eps)
        q = normed @ w("attention.q.weight").T + b("attention.q.bias")
        k = normed @ w("attention.k.weight").T + b("attention.k.bias")
        v = normed @ w("attention.v.weight").T + b("attention.v.bias")
        outputs = []
        for head in range(heads):
            group = head // (heads // kv_heads)  # the kv head this query head shares
            qh = torch.einsum("tij,btj->bti", rotate, q[..., head * d:(head + 1) * d])
            kh = torch.einsum("tij,btj->bti", rotate, k[..., group * d:(group + 1) * d])
            scores = qh @ kh.transpose(1, 2) / math.sqrt(d) + mask
            outputs.append(torch.softmax(scores, -1) @ v[..., group * d:(group + 1) * d])
        x = x + torch.cat(outputs, -1) @ w("attention.proj.weight").T
        normed = rms_norm(x, w("norm_mlp.weight"), eps)
        gate, up = normed @ w("mlp.gate.weight").T, normed @ w("mlp.up.weight").T
        x = x + (gate * torch.sigmoid(gate) * up) @ w("mlp.fc_out.weight").T
    return rms_norm(x, p["head.norm.weight"], eps) @ p["head.output.weight"].T


@pytest.mark.parametrize("extra", [
    dict(kv_heads=2),  # grouped-query attention
    dict(kv_heads=4, qkv_bias=True, rope_theta=500000.0),  # multi-head, Qwen2's biases
    dict(kv_heads=1, rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                       original_max_position_embeddings=16)),  # Llama 3.1 scaling
], ids=["gqa", "mha_bias", "mqa_scaled"])
def test_llama_logits_equal_a_hand_written_reference(extra):
    model = build_model("llama", **SHAPE, **extra).double()
    with torch.no_grad():
        for name, value in model.named_parameters():
            if "bias" in name or "norm" in name:  # not their init (0, 1): the reference must use them
                value.normal_(1.0 if "norm" in name else 0.0, 0.1)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference_logits(model, tokens), rtol=1e-10, atol=1e-10)


def test_llama3_frequency_scaling_equals_the_reference_loop():
    """Meta's llama3 reference `apply_scaling`, a loop over frequencies, at Llama 3.1's settings."""
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    plain, scaled = rotary_frequencies(128, 500000.0), rotary_frequencies(128, 500000.0, scaling)
    expected = []
    for frequency in plain.tolist():
        wavelength = 2 * math.pi / frequency
        if wavelength < 8192 / 4.0:
            expected.append(frequency)
        elif wavelength > 8192 / 1.0:
            expected.append(frequency / 8.0)
        else:
            smooth = (8192 / wavelength - 1.0) / (4.0 - 1.0)
            expected.append((1 - smooth) * frequency / 8.0 + smooth * frequency)
    torch.testing.assert_close(scaled, torch.tensor(expected, dtype=torch.float64), rtol=1e-15, atol=0)
    assert (scaled < plain).any() and (scaled == plain).any()


def test_llama_parts_build_alone_and_on_meta_with_the_full_models_values():
    full = build_model("llama", **SHAPE, kv_heads=2)
    shapes = build_model("llama", **SHAPE, kv_heads=2, device="meta")
    assert shapes.part_names() == ["embed", "blocks.0", "blocks.1", "head"]
    shapes.materialise("cpu", ["blocks.1"])
    for name, value in shapes.blocks["1"].state_dict().items():
        assert torch.equal(value, full.blocks["1"].state_dict()[name]), name
    assert shapes.blocks["0"].attention.q.weight.device.type == "meta"


def test_tied_llama_shares_one_parameter_and_any_length_runs():
    model = build_model("llama", **SHAPE, kv_heads=2, tie_embeddings=True)
    assert model.head.output.weight is model.embed.token.weight
    assert model(torch.zeros(1, 7, dtype=torch.long)).shape == (1, 7, 256)


@pytest.mark.parametrize("overrides, message", [
    (["model.kv_heads=3"], "model.kv_heads=3 does not divide model.heads=4"),
    (["strategy=tp_1d", "strategy.tensor_grid=4", "hardware.devices_per_node=4"],
     "model.kv_heads=2 is not divisible by strategy.tensor_grid=4"),
])
def test_bad_llama_configs_name_the_field_and_the_fix(overrides, message):
    from layerwise.config.errors import ConfigError
    from layerwise.preflight import validate
    cfg = compose_config("model=llama_tiny", "mode=check", *overrides)
    with pytest.raises(ConfigError) as error:
        validate(cfg)
    assert message in str(error.value) and "Fix: model.kv_heads=" in str(error.value), str(error.value)


# ----- AdamW against single for the strategies tests/test_composed_layouts.py does not reach with Llama
# (pipelines, ZeRO and the tensor grids are there: AdamW and counted bytes; every family under SGD:
# tests/references.py SGD_CASES "llama_*")

ADAM_STEPS = 4


def adam_run(directory, *overrides):
    from layerwise.run.fit import train
    from layerwise.preflight import validate
    from tests.ranks import QUICK
    from tests.references import LLAMA
    cfg = compose_config(*QUICK, *LLAMA, "model.layers=4", "data.global_batch_size=16", "trainer.limit_val_batches=0",
                         f"trainer.max_steps={ADAM_STEPS}", f"trainer.val_check_interval={ADAM_STEPS}", *overrides)
    summary = train(cfg, directory, validate(cfg))
    assert summary["status"] == "completed", summary.get("error")
    return summary


@pytest.fixture(scope="module")
def adam_reference(tmp_path_factory):
    from tests.references import consolidated_parameters, tracing_optimizer
    from tests.tolerances import OptimizerTrace
    directory = tmp_path_factory.mktemp("llama_single")
    with tracing_optimizer(directory):
        summary = adam_run(directory, "strategy=single")
    return summary, consolidated_parameters(directory, "single"), OptimizerTrace.load(directory)


@pytest.mark.parametrize("overrides", [
    ["strategy=ddp"],
    ["strategy=fsdp2"],
    ["strategy=l2l", "strategy.micro_batches=2", "strategy.constant_memory=true"],
], ids=["ddp_dp2", "fsdp2_dp2_m4", "l2l_dp2_m2_const"])
def test_llama_equals_single_under_adamw(overrides, adam_reference, tmp_path):
    from tests.references import consolidated_parameters
    from tests.tolerances import assert_same_losses, assert_same_parameters
    expected, parameters, trace = adam_reference
    summary = adam_run(tmp_path, *overrides)
    assert summary["world_size"] == 2
    assert_same_losses(summary["losses"], expected["losses"])
    assert_same_parameters(consolidated_parameters(tmp_path, summary["strategy"]), parameters, trace)


@pytest.mark.parametrize("architecture, extra", [("gpt", {}), ("llama", dict(kv_heads=2, ffn_hidden=96)),
                                                 ("llama", dict(kv_heads=1, ffn_hidden=80, qkv_bias=True))])
def test_the_block_description_counts_what_the_model_holds(architecture, extra):
    """models.describe_block's linears and norms, and cost/traffic.py's whole-model count from them,
    against the parameters the built model holds (GQA's narrower k/v, SwiGLU's three matrices, no
    biases, RMSNorm's one vector, no position table)."""
    from cost.inputs import GptShape
    from cost.traffic import model_parameters
    from models import describe_block
    model = build_model(architecture, vocab_size=256, sequence_length=64, layers=3, hidden=64, heads=4, **extra)
    block = describe_block(architecture, hidden=64, heads=4, **extra)
    assert block.parameters() == sum(p.numel() for p in model.blocks["0"].parameters())
    names = {name for name, _ in model.blocks["0"].named_modules()}
    assert {linear.name for linear in block.linears} | set(block.norms) <= names
    shape = GptShape(64, 4, 256, 32, 64, block, architecture != "llama")
    assert model_parameters(shape, 3) == sum(p.numel() for p in model.parameters())
