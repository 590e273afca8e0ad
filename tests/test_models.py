"""Unit tests of models/: shapes, the layer-sequence contract, seeded init, loss, gradients."""

import math
from pathlib import Path

import pytest
import torch

from models import (
    BERT, GPT, Block, build_block, build_model, model_flops_per_token, parameter_count,
)

TINY = dict(sequence_length=32, layers=2, hidden=64, heads=4)
TINY_VOCAB = {"gpt": 256, "bert": 257}  # BERT's vocabulary has one extra [MASK] id
ARCHITECTURES = ["gpt", "bert"]


def tiny(architecture, **overrides):
    return build_model(architecture, **{"vocab_size": TINY_VOCAB[architecture], **TINY,
                                        **overrides})


def random_tokens(vocab_size, batch=2, length=32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=generator)


def manual_forward(model, tokens):
    x = model.embed(tokens)
    for index in range(len(model.blocks)):
        x = model.blocks[str(index)](x)
    return model.head(x)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_tiny_forward_shape_and_layer_sequence(architecture):
    model = tiny(architecture).eval()
    tokens = random_tokens(TINY_VOCAB[architecture])
    logits = model(tokens)
    assert logits.shape == (2, 32, TINY_VOCAB[architecture])
    assert list(model.blocks.keys()) == ["0", "1"]
    assert all(isinstance(block, Block) for block in model.blocks.values())
    torch.testing.assert_close(logits, manual_forward(model, tokens), rtol=0, atol=0)


@pytest.mark.parametrize("architecture, shape, length", [
    ("gpt", dict(layers=6, hidden=384, heads=6, sequence_length=256), 256),  # gpt_small
    ("bert", dict(layers=12, hidden=768, heads=12, sequence_length=128), 128),  # bert_base
])
def test_named_shapes_run(architecture, shape, length):
    model = build_model(architecture, vocab_size=257, **shape).eval()
    with torch.no_grad():
        logits = model(random_tokens(257, batch=1, length=length))
    assert logits.shape == (1, length, 257)
    assert torch.isfinite(logits).all()


def test_block_names_that_strategies_rely_on():
    names = {name for name, _ in tiny("gpt").blocks["0"].named_modules()}
    for name in ["attention.qkv", "attention.proj", "mlp.fc_in", "mlp.fc_out",
                 "norm_attention", "norm_mlp"]:
        assert name in names
    block = tiny("gpt").blocks["0"]
    assert isinstance(block.attention.qkv, torch.nn.Linear)
    assert block.attention.qkv.weight.shape == (3 * 64, 64)


def test_gpt_is_causal_and_bert_is_not():
    tokens = random_tokens(256, batch=1)
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 256  # only the last token differs
    for architecture, causal in [("gpt", True), ("bert", False)]:
        model = tiny(architecture).eval()
        before, after = model(tokens), model(changed)
        assert torch.equal(before[0, :-1], after[0, :-1]) == causal


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_same_seed_same_weights_different_seed_different(architecture):
    torch.manual_seed(1)
    first = tiny(architecture, seed=7).state_dict()
    torch.manual_seed(2)  # the global RNG must not matter
    second = tiny(architecture, seed=7).state_dict()
    other = tiny(architecture, seed=8).state_dict()
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    assert not torch.equal(first["blocks.0.attention.qkv.weight"],
                           other["blocks.0.attention.qkv.weight"])
    assert not torch.equal(first["embed.token.weight"], other["embed.token.weight"])


def test_construction_leaves_the_global_rng_alone():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    tiny("gpt")
    assert torch.equal(torch.rand(4), expected)


def test_init_does_not_depend_on_default_dtype():
    reference = tiny("gpt", seed=5).state_dict()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        double = tiny("gpt", seed=5).state_dict()
    finally:
        torch.set_default_dtype(previous)
    for name in reference:
        assert double[name].dtype == torch.float64
        assert torch.equal(double[name].float(), reference[name]), name


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_block_built_alone_equals_the_full_models_block(architecture):
    layers = 4
    model = tiny(architecture, layers=layers, seed=11)
    alone = build_block(hidden=64, heads=4, mlp_ratio=4, dropout=0.0,
                        causal=architecture == "gpt", seed=11, index=2, layers=layers)
    expected = model.blocks["2"].state_dict()
    for name, value in alone.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_blocks_differ_from_each_other_and_residual_projections_are_scaled():
    model = tiny("gpt", layers=8)
    assert not torch.equal(model.blocks["0"].mlp.fc_in.weight, model.blocks["1"].mlp.fc_in.weight)
    qkv_std = model.blocks["0"].attention.qkv.weight.std().item()
    proj_std = model.blocks["0"].attention.proj.weight.std().item()
    assert qkv_std == pytest.approx(0.02, rel=0.1)
    assert proj_std == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.1)
    assert torch.all(model.blocks["0"].attention.qkv.bias == 0)
    assert torch.all(model.blocks["0"].norm_mlp.weight == 1)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_tied_embeddings_share_one_parameter(architecture):
    model = tiny(architecture, tie_embeddings=True)
    assert model.head.output.weight is model.embed.token.weight
    untied = tiny(architecture)
    assert parameter_count(untied) - parameter_count(model) == TINY_VOCAB[architecture] * 64


def test_initial_gpt_loss_is_uniform_over_bytes():
    model = tiny("gpt")
    tokens = random_tokens(256, batch=4, length=33)
    with torch.no_grad():
        loss = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
    assert abs(loss.item() - math.log(256)) < 0.15


def test_loss_ignores_minus_100_targets():
    model = tiny("bert")
    tokens = random_tokens(257)
    targets = torch.full_like(tokens, -100)
    targets[:, 3] = tokens[:, 3]
    logits = model(tokens)
    expected = torch.nn.functional.cross_entropy(logits[:, 3], tokens[:, 3])
    torch.testing.assert_close(model.loss(logits, targets), expected)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_gradient_reaches_every_parameter(architecture, tie_embeddings):
    model = tiny(architecture, dropout=0.1, tie_embeddings=tie_embeddings)
    tokens = random_tokens(TINY_VOCAB[architecture])
    model.loss(model(tokens), tokens).backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, name
        assert parameter.grad.abs().sum() > 0, name


def test_dropout_is_modules_only():
    model = tiny("gpt", dropout=0.1)
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert len(dropouts) == 1 + 2 * 2  # embedding, and attention + MLP output in each block
    assert all(m.p == 0.1 for m in dropouts)


def test_sequence_longer_than_positions_names_the_fields():
    with pytest.raises(ValueError, match="data.sequence_length"):
        tiny("gpt")(random_tokens(256, length=33))


def test_build_model_rejects_unknown_architecture_and_bad_heads():
    with pytest.raises(ValueError, match="model.architecture"):
        build_model("t5", **TINY, vocab_size=256)
    with pytest.raises(ValueError, match="model.heads"):
        build_model("gpt", vocab_size=256, sequence_length=8, layers=1, hidden=64, heads=5)
    assert isinstance(build_model("gpt", **TINY, vocab_size=256), GPT)
    assert isinstance(build_model("bert", **TINY, vocab_size=256), BERT)


def test_model_flops_per_token():
    # GPT-3 175B (Brown et al. 2020): 96 layers, 12288 wide, 2048 tokens -> about 6·175e9 per token
    flops = model_flops_per_token(96, 12288, 2048, 50257)
    assert flops == pytest.approx(6 * 175e9, rel=0.05)
    small = model_flops_per_token(2, 64, 32, 256)
    assert small == 6 * (2 * 12 * 64**2 + 64 * 256) + 12 * 2 * 64 * 32


def test_models_never_mention_the_distributed_package():
    forbidden = "torch." + "distributed"  # split so this test file does not match itself
    models_directory = Path(__file__).resolve().parents[1] / "models"
    files = sorted(models_directory.rglob("*.py"))
    assert files
    offenders = [str(f) for f in files if forbidden in f.read_text()]
    assert offenders == []


def imported_packages(path: Path) -> set:
    """Top-level package of every import in a file, read from its syntax tree (not grep)."""
    import ast
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package, forbidden", [("strategies", {"layerwise"}),
                                                ("parallel", {"layerwise", "strategies"}),
                                                ("models", {"layerwise", "strategies", "parallel"})])
def test_floors_import_only_downwards(package, forbidden):
    """models/ < parallel/ < strategies/ < layerwise/: a floor never imports one above it."""
    files = sorted((Path(__file__).resolve().parents[1] / package).rglob("*.py"))
    assert files
    offenders = {str(f): sorted(imported_packages(f) & forbidden) for f in files
                 if imported_packages(f) & forbidden}
    assert offenders == {}
