"""3-D tensor parallelism (docs/strategies/three_d.md) and its 1-D / 2-D baselines.

Operator level on 8 gloo ranks (q=2): each rank's shards equal the chunks of the unsharded
computation, and the traffic of a linear equals (q−1)/q³·(N_X+N_W+N_Y) each way, tallied by an
independent counter wrapped around torch.distributed. Model level: every grid reproduces `single`.
Test ids: q2 = 3-D grid of edge 2 (8 ranks); p8 = 1-D over 8 ranks; q2_dp2 = 2-D q=2 × 2 data.
"""

from collections import defaultdict

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel import compat
from parallel.dims import Layout
from parallel.layout import ParallelLayout
from layerwise.run.fit import train
from layerwise.config.errors import ConfigError
from layerwise.preflight import validate
from strategies.tensor_parallel.grids import Style, grid_of, layout_arguments
from strategies.tensor_parallel.parallelize import cut
from strategies.tensor_parallel.layers import (GridLinear, ParallelEmbedding, ParallelNorm,
                                               VocabularyParallelLoss)
from tests.ranks import QUICK, compose_config, run_on_ranks
from tests.references import compare_under_sgd, consolidated_parameters, tracing_optimizer
from tests.same_checkpoints import SAVED_AT_ANOTHER_HOOK, assert_same_checkpoints
from tests.tolerances import (EXACT_RTOL, LOSS_RTOL, OPERATOR_RTOL, OPERATOR_SCALE_ATOL, OptimizerTrace, assert_same_losses,
                              assert_same_parameters)

Q = 2
STEPS = 6


# ----------------------------------------------------------------------------- operator level

def close(actual, expected):
    """fp32, relative to the tensor's scale, so entries near zero do not fail spuriously (tests/tolerances.py table)."""
    torch.testing.assert_close(actual, expected, rtol=OPERATOR_RTOL,
                               atol=OPERATOR_SCALE_ATOL * expected.abs().max().item())


class IndependentCounter:
    """Tallies logical bytes by wrapping torch.distributed itself (not the Communicator)."""

    def __init__(self, monkeypatch_like):
        self.bytes = defaultdict(float)
        # under this torch's names (parallel/compat.py: torch 2.11 and 2.12 have only the older ones)
        for name, key in ((compat.ALL_GATHER_SINGLE, 0), (compat.REDUCE_SCATTER_SINGLE, 1)):
            monkeypatch_like(name, self._wrap(name, getattr(dist, name), key))

    def _wrap(self, name, original, full_argument):
        def counted(*args, **kwargs):
            size = dist.get_world_size(kwargs.get("group"))
            full = args[full_argument]
            self.bytes[name] += (size - 1) / size * full.numel() * full.element_size()
            return original(*args, **kwargs)
        return counted

    def total(self):
        return sum(self.bytes.values())


def chunk(tensor, dim, parts, index):
    return tensor.chunk(parts, dim)[index]


def rows_features(full, rows, features):
    """Rows chunk rows=(index, parts) and feature chunk features=(index, parts) of [B, s, f]."""
    return chunk(chunk(full, 0, rows[1], rows[0]), -1, features[1], features[0])


def sum_replicas(layout, grid, style, name, gradient):
    for family in grid.replicated_over(style, name):
        dist.all_reduce(gradient, group=layout.group(family).process_group)
    return gradient


def check_linear(layout, grid, position, counter):
    torch.manual_seed(0)
    x, weight, bias = torch.randn(8, 3, 8), torch.randn(12, 8), torch.randn(12)
    upstream = torch.randn(8, 3, 12)
    full = [t.clone().requires_grad_() for t in (x, weight, bias)]
    (F.linear(*full) * upstream).sum().backward()
    style, q, c = Style("linear", position), grid.q, grid.c
    a, b = (c[axis] for axis in grid.roles(position))
    layer = GridLinear(cut(grid, style, "weight", weight), cut(grid, style, "bias", bias), layout,
                       grid.linear_specs(position))
    x_local = rows_features(x, (c["i"] * q + a, q * q), (b, q)).clone().requires_grad_()
    before = counter.total()
    y_local = layer(x_local)
    forward_bytes = counter.total() - before
    (y_local * rows_features(upstream, (c["i"] * q + b, q * q), (a, q))).sum().backward()
    backward_bytes = counter.total() - before - forward_bytes
    close(y_local, rows_features(F.linear(x, weight, bias), (c["i"] * q + b, q * q), (a, q)))
    close(x_local.grad, rows_features(full[0].grad, (c["i"] * q + a, q * q), (b, q)))
    close(layer.weight.grad, cut(grid, style, "weight", full[1].grad))
    close(sum_replicas(layout, grid, style, "bias", layer.bias.grad), cut(grid, style, "bias", full[2].grad))
    return forward_bytes, backward_bytes, (x.numel() + weight.numel() + upstream.numel()) * 4


def check_layer_norm(layout, grid):
    torch.manual_seed(1)
    x, weight, bias, upstream = torch.randn(8, 3, 8), torch.randn(8), torch.randn(8), torch.randn(8, 3, 8)
    full = [t.clone().requires_grad_() for t in (x, weight, bias)]
    (F.layer_norm(full[0], (8,), full[1], full[2]) * upstream).sum().backward()
    style, q, c = Style("norm"), grid.q, grid.c
    layer = ParallelNorm(cut(grid, style, "weight", weight), cut(grid, style, "bias", bias),
                              1e-5, layout, grid.norm_family)
    where = ((c["i"] * q + c["j"], q * q), (c["k"], q))
    x_local = rows_features(x, *where).clone().requires_grad_()
    y_local = layer(x_local)
    (y_local * rows_features(upstream, *where)).sum().backward()
    close(y_local, rows_features(F.layer_norm(x, (8,), weight, bias), *where))
    close(x_local.grad, rows_features(full[0].grad, *where))
    for name, parameter, reference in (("weight", layer.weight, full[1]), ("bias", layer.bias, full[2])):
        close(sum_replicas(layout, grid, style, name, parameter.grad), cut(grid, style, name, reference.grad))


def check_embedding(layout, grid):
    torch.manual_seed(2)
    token, position = torch.randn(16, 8), torch.randn(5, 8)
    tokens, upstream = torch.randint(0, 16, (8, 3)), torch.randn(8, 3, 8)
    full = [t.clone().requires_grad_() for t in (token, position)]
    ((F.embedding(tokens, full[0]) + full[1][:3]) * upstream).sum().backward()
    style, q, c = Style("embedding"), grid.q, grid.c
    layer = ParallelEmbedding(cut(grid, style, "weight", token), cut(grid, style, "weight", position),
                              0.0, grid.input_rows())
    where = ((c["i"] * q + c["j"], q * q), (c["k"], q))
    y_local = layer(tokens)
    (y_local * rows_features(upstream, *where)).sum().backward()
    close(y_local, rows_features(F.embedding(tokens, token) + position[:3], *where))
    for parameter, reference in ((layer.token.weight, full[0]), (layer.position.weight, full[1])):
        close(sum_replicas(layout, grid, style, "weight", parameter.grad),
              cut(grid, style, "weight", reference.grad))


def check_loss(layout, grid):
    torch.manual_seed(3)
    logits, targets = torch.randn(8, 3, 16), torch.randint(0, 16, (8, 3))
    targets[0, 0] = -100  # an ignored position, as BERT has
    reference = logits.clone().requires_grad_()
    expected = F.cross_entropy(reference.reshape(-1, 16), targets.reshape(-1), ignore_index=-100)
    expected.backward()
    q, c = grid.q, grid.c
    where = ((c["i"] * q + c["k"], q * q), (c["j"], q))
    local = rows_features(logits, *where).clone().requires_grad_()
    loss = VocabularyParallelLoss(layout, grid, layout.group("data"))(local, targets)
    loss.backward()
    close(loss.detach(), expected.detach())  # every rank holds the global loss
    close(local.grad, rows_features(reference.grad, *where))  # and its share's gradient


def operators_on_rank(rank):
    dist.init_process_group("gloo")
    layout = ParallelLayout(Layout(tensor_grid="3d", edge=Q), rank=rank, **layout_arguments("3d", Q ** 3))
    grid = grid_of("3d", Q ** 3, layout.index("tensor"))
    counter = IndependentCounter(lambda name, value: setattr(dist, name, value))
    traffic = [check_linear(layout, grid, position, counter) for position in ("first", "second")]
    check_layer_norm(layout, grid)
    check_embedding(layout, grid)
    check_loss(layout, grid)
    return traffic


@pytest.mark.smoke  # also under torch 2.11: the counter wraps that torch's names (parallel/compat.py)
def test_q2_operators_equal_the_unsharded_chunks_and_traffic_equals_the_formula():
    for traffic in run_on_ranks(operators_on_rank, Q ** 3):
        for forward_bytes, backward_bytes, total_bytes in traffic:
            expected = (Q - 1) / Q ** 3 * total_bytes  # (q−1)/q³·(N_X + N_W + N_Y), fp32
            assert forward_bytes == pytest.approx(expected, rel=EXACT_RTOL)
            assert backward_bytes == pytest.approx(expected, rel=EXACT_RTOL)


# ----------------------------------------------------------------------------- model level

MODEL = ["model.heads=8"]  # 1-D over 8 ranks splits heads 8 ways


def run(directory, *overrides):
    cfg = compose_config(*QUICK, *MODEL, f"trainer.max_steps={STEPS}",
                         f"trainer.val_check_interval={STEPS}", *overrides)
    return train(cfg, directory, validate(cfg)), directory


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    directory = tmp_path_factory.mktemp("single") / "single"
    with tracing_optimizer(directory):
        return run(directory, "strategy=single")


@pytest.fixture(scope="module")
def three_d_run(tmp_path_factory):
    return run(tmp_path_factory.mktemp("three_d") / "q2", "strategy=three_d",
               "hardware.devices_per_node=8")


def assert_reproduces(result, reference, strategy):
    (summary, directory), (expected, expected_directory) = result, reference
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert_same_losses(summary["losses"], expected["losses"])
    assert_same_parameters(consolidated_parameters(directory, strategy),
                           consolidated_parameters(expected_directory, "single"),
                           OptimizerTrace.load(expected_directory))


def test_q2_reproduces_single(three_d_run, reference):
    assert_reproduces(three_d_run, reference, "three_d")
    assert three_d_run[0]["layout"] == {"data": 1, "pipeline": 1, "tensor": 8,
                                    "order": ["tensor", "pipeline", "data"]}
    assert three_d_run[0]["comm_bytes_per_step"]["reduce_scatter"] > 0


@pytest.mark.parametrize("strategy, devices", [("tp_1d", 8), ("tp_2d", 4), ("tp_2d", 8)],
                         ids=["p8", "q2", "q2_dp2"])
def test_baselines_reproduce_single(strategy, devices, reference, tmp_path):
    result = run(tmp_path / strategy, f"strategy={strategy}", f"hardware.devices_per_node={devices}")
    assert_reproduces(result, reference, strategy)


@pytest.mark.parametrize("case", ["three_d_q2", "tp_1d_p2", "tp_2d_q2", "llama_three_d_q2", "llama_tp_1d_p2",
                                  "llama_tp_2d_q2"])
def test_tensor_parallel_equals_single_under_sgd(case, tmp_path, tmp_path_factory):
    """Plain SGD sees the gradient's scale, which AdamW normalises away (references.SgdComparison):
    losses, the first step's gradients and the parameters after references.SGD_STEPS steps. One q=2
    run (8 ranks); 1-D over 2 ranks."""
    compare_under_sgd(case, tmp_path, tmp_path_factory).check()


def test_q2_resume_is_bit_identical(three_d_run, tmp_path):
    """Stop after 3 steps, rerun to 6: steps 4-6 equal the uninterrupted run's, bit for bit."""
    overrides = ["strategy=three_d", "hardware.devices_per_node=8", "trainer.checkpoint_every_n_steps=3"]
    first, directory = run(tmp_path / "resumed", *overrides, "trainer.max_steps=3")
    assert first["steps"] == 3
    resumed, _ = run(directory, *overrides)
    assert resumed["losses"][3:] == three_d_run[0]["losses"][3:]
    final, uninterrupted = consolidated_parameters(directory, "three_d"), \
        consolidated_parameters(three_d_run[1], "three_d")
    assert all(torch.equal(final[name], uninterrupted[name]) for name in uninterrupted)
    # all 8 ranks' shards and Adam state (the fixture saved at the end of training, this run after step 6)
    assert_same_checkpoints(directory, three_d_run[1], skip=SAVED_AT_ANOTHER_HOOK)


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("overrides, message", [
    (["hardware.devices_per_node=6"], "needs data × 8 ranks, but the world has 6"),
    (["data.global_batch_size=6"], "data.global_batch_size=6: each of the 1 data-parallel ranks "
                                   "must get a multiple of 4 sequences"),
    (["model.hidden=34", "model.heads=2"], "model.hidden=34 is not divisible by 4"),
    (["model.hidden=48", "model.heads=3"], "model.heads=3 is not divisible by strategy.tensor_grid=2"),
], ids=["world", "batch", "hidden", "heads"])
def test_q2_bad_input_is_named_before_launch(overrides, message):
    cfg = compose_config(*QUICK, "strategy=three_d", "hardware.devices_per_node=8", *overrides)
    with pytest.raises(ConfigError) as error:
        validate(cfg)
    assert message in str(error.value)
    assert "Fix:" in str(error.value)


def test_the_vocabulary_parallel_loss_counts_more_targets_than_fp16_holds():
    """Under 16-mixed the logits are fp16: a count of valid targets held in their dtype is inf above
    65,504 (64 sequences × 1024 tokens), and the loss and every gradient become 0, finite, so the
    non-finite guard never fires (issue 37, item 8). One rank, a 2-word vocabulary, 70,000 targets."""
    torch.manual_seed(0)
    layout = ParallelLayout(Layout(tensor_grid="1d"), rank=0, **layout_arguments("1d", 1))
    logits = torch.randn(70, 1000, 2).half().requires_grad_()
    targets = torch.randint(0, 2, (70, 1000))
    loss = VocabularyParallelLoss(layout, grid_of("1d", 1, 0), layout.group("data"))(logits, targets)
    loss.backward()
    expected = F.cross_entropy(logits.detach().float().reshape(-1, 2), targets.reshape(-1))
    # Both sides read the same fp16 logits in fp32: only the order of the sums differs (6.6e-8 measured)
    assert torch.isfinite(loss) and abs(loss.item() - expected.item()) < LOSS_RTOL * expected.item(), (loss, expected)
    assert logits.grad.abs().sum() > 0
