"""The split backward's two halves (strategies/split_backward.py) against one fused backward.

One process, no pipeline: a stage's input gradient from I and its weights' gradients from W equal the
fused backward's (exactly: the same products, the same order), on a stage of GPT blocks, on stage 0
(input = the embedding's output, not a leaf), under bf16 autocast (weights reach their products
through casts) and with a weight used twice (one W group, its intermediate on the other's path). And
W does no activation-gradient work: the FLOPs of I + W are the fused backward's, not 1.5× them.
"""

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from models import build_model
from strategies.split_backward import input_gradient

MODEL = dict(vocab_size=64, sequence_length=16, layers=2, hidden=32, heads=4, mlp_ratio=4, dropout=0.0)


def gpt():
    return build_model("gpt", **MODEL, seed=0)


def stage_of_blocks(model, tokens):
    """Blocks only, from a leaf input (as stages > 0 receive it)."""
    hidden = model.embed(tokens).detach().requires_grad_()
    output = hidden
    for block in model.blocks.values():
        output = block(output)
    return hidden, output, list(model.blocks.parameters())


def first_stage(model, tokens):
    """Stage 0: the embedding's output is the input (a non-leaf), and its weights are the stage's too."""
    hidden = model.embed(tokens)
    output = hidden
    for block in model.blocks.values():
        output = block(output)
    return hidden, output, [*model.embed.parameters(), *model.blocks.parameters()]


def forward(build, stage, autocast: bool):
    """A fresh model's stage forward: (its input, output, weights, a seeded output gradient)."""
    model, tokens = build(), torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        stage_input, output, weights = stage(model, tokens)
    output_gradient = torch.randn(output.shape, generator=torch.Generator().manual_seed(2), dtype=output.dtype)
    return stage_input, output, weights, output_gradient


def fused(build, stage, autocast=False):
    """(input gradient, weight gradients, backward FLOPs) of one fused backward."""
    stage_input, output, weights, output_gradient = forward(build, stage, autocast)
    with FlopCounterMode(display=False) as counter:
        (gradient,) = torch.autograd.grad(output, [stage_input], output_gradient, retain_graph=True)
        output.backward(output_gradient)
    return gradient, [w.grad.clone() for w in weights], counter.get_total_flops()


def split(build, stage, autocast=False):
    """The same from I then W, with each half's FLOPs."""
    stage_input, output, weights, output_gradient = forward(build, stage, autocast)
    with FlopCounterMode(display=False) as input_counter:
        gradient, pending = input_gradient(output, output_gradient, stage_input, weights)
    assert all(w.grad is None for w in weights), "I accumulates no weight gradient"
    with FlopCounterMode(display=False) as weight_counter:
        pending.run()
    return gradient, [w.grad for w in weights], input_counter.get_total_flops(), weight_counter.get_total_flops()


@pytest.mark.parametrize("stage", [stage_of_blocks, first_stage], ids=["leaf_input", "stage_0"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
def test_i_then_w_equals_the_fused_backward_and_costs_the_same(stage, autocast):
    gradient, weight_gradients, fused_flops = fused(gpt, stage, autocast)
    split_gradient, split_weight_gradients, input_flops, weight_flops = split(gpt, stage, autocast)
    # The fused backward's FLOPs here include one extra input-gradient pass (the oracle's autograd.grad).
    single_backward = fused_flops - input_flops
    print(f"\nFLOPs: I {input_flops}, W {weight_flops}, fused backward {single_backward}")
    assert input_flops + weight_flops == single_backward, "W recomputed activation gradients"
    assert weight_flops > 0 and input_flops > 0
    torch.testing.assert_close(split_gradient, gradient, rtol=0, atol=0)
    for got, expected in zip(split_weight_gradients, weight_gradients):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


class TwiceUsed(nn.Module):
    """y = L(gelu(L(x))): one weight feeds two products, the second on the first's I path."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.other = nn.Linear(8, 8)

    def forward(self, x):
        return self.other(self.linear(torch.nn.functional.gelu(self.linear(x))))


def test_a_weight_used_twice_is_counted_once():
    torch.manual_seed(0)
    module = TwiceUsed()
    x = torch.randn(4, 8, requires_grad=True)
    output_gradient = torch.randn(4, 8)
    output = module(x)
    (expected_input,) = torch.autograd.grad(output, [x], output_gradient, retain_graph=True)
    output.backward(output_gradient)
    expected = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    gradient, pending = input_gradient(module(x), output_gradient, x, list(module.parameters()))
    pending.run()
    torch.testing.assert_close(gradient, expected_input, rtol=0, atol=0)
    for parameter, want in zip(module.parameters(), expected):
        torch.testing.assert_close(parameter.grad, want, rtol=1e-6, atol=1e-7)


def test_w_accumulates_over_micro_batches_into_existing_gradients():
    """Two micro-batches' I then their Ws (in the other order): the sum of two fused backwards, and an
    existing .grad (ZeRO's views of a flat buffer) is added to in place, never replaced."""
    model = gpt()
    tokens = torch.randint(0, 64, (2, 2, 16), generator=torch.Generator().manual_seed(3))
    for micro_batch in tokens:
        _, output, _ = stage_of_blocks(model, micro_batch)
        output.sum().backward()
    expected = [p.grad.clone() for p in model.blocks.parameters()]
    buffers = [torch.zeros_like(p) for p in model.blocks.parameters()]
    for parameter, buffer in zip(model.blocks.parameters(), buffers):
        parameter.grad = buffer
    pending = []
    for micro_batch in tokens:
        stage_input, output, weights = stage_of_blocks(model, micro_batch)
        pending.append(input_gradient(output.sum(), None, stage_input, weights)[1])
    for work in reversed(pending):
        work.run()
    for parameter, buffer, want in zip(model.blocks.parameters(), buffers, expected):
        assert parameter.grad is buffer
        torch.testing.assert_close(parameter.grad, want)
