"""Mixture of experts (models/moe.py): grouped products, routers, the auxiliary loss and its
decomposition over micro-batches, capacity drops, the bias update, blocks as data, seeded experts."""

import math

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

import models
from tests.tolerances import GRADIENT_RTOL, GRADIENT_SCALE_ATOL
from models import build_model
from models.moe import (
    Experts, MoE, balance_loss, capacity, grouped_products_available, route, sort_slots,
    update_expert_biases,
)


def experts_and_rows(dtype=torch.float32, counts=(3, 0, 5, 1), hidden=16, width=32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    experts = Experts(hidden, width, len(counts))
    with torch.no_grad():
        for weight in (experts.gate, experts.up, experts.down):
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.3)
    experts = experts.to(dtype)
    rows = torch.randn(sum(counts), hidden, generator=generator).to(dtype)
    return experts, rows, torch.tensor(counts)


# ----------------------------------------------------------------------------- grouped == loop


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_products_equal_the_loop(dtype):
    """F.grouped_mm and one product per expert (an expert with no rows included), forward and
    gradients. Each output element is the same h- or f-term dot product in both; only the kernels'
    summation order may differ: |Δ| ≤ n·eps·Σ|terms| (n = 32 terms, eps 2⁻²⁴ fp32, 2⁻⁸ bf16 with
    fp32 accumulation rounded once: one bf16 ulp of the result)."""
    experts, rows, counts = experts_and_rows(dtype)
    assert grouped_products_available(rows, (experts.gate, experts.up, experts.down))
    results = []
    for method in (Experts._grouped, Experts._loop):
        x = rows.clone().requires_grad_(True)
        for weight in experts.parameters():
            weight.grad = None
        y = method(x, counts, experts.gate, experts.up, experts.down)
        y.sum().backward()  # an expanded incoming gradient: grouped_mm's backward needs it contiguous
        results.append([y.float(), x.grad.float()] + [w.grad.float() for w in experts.parameters()])
    tolerance = {torch.float32: dict(rtol=32 * 2**-24 * 8, atol=1e-6), torch.bfloat16: dict(rtol=2**-7, atol=2**-7)}[dtype]
    for grouped, looped in zip(*results):
        torch.testing.assert_close(grouped, looped, **tolerance)


def test_the_loop_serves_what_grouped_products_cannot():
    """float64 (and widths whose rows are not 16-byte multiples) run the loop: same numbers."""
    experts, rows, counts = experts_and_rows(torch.float64)
    assert not grouped_products_available(rows, (experts.gate,))
    odd = Experts(6, 10, 2)
    assert not grouped_products_available(torch.zeros(3, 6), (odd.gate, odd.up, odd.down))
    y = experts(rows, counts)
    start = 0
    for e, count in enumerate(counts.tolist()):
        piece = rows[start:start + count]
        expected = (F.silu(piece @ experts.gate[e]) * (piece @ experts.up[e])) @ experts.down[e]
        torch.testing.assert_close(y[start:start + count], expected, rtol=0, atol=0)
        start += count


# ----------------------------------------------------------------------------- routers


def test_softmax_topk_against_a_hand_computation():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]])
    weights, chosen, probabilities = route(logits, 2, "softmax_topk", normalize=False)
    e = math.exp
    z0 = e(2) + e(1) + e(0) + e(-1)
    assert chosen.tolist() == [[0, 1], [2, 3]]
    torch.testing.assert_close(weights[0], torch.tensor([e(2) / z0, e(1) / z0]))
    normalised, _, _ = route(logits, 2, "softmax_topk", normalize=True)
    torch.testing.assert_close(normalised[0], torch.tensor([e(2) / (e(2) + e(1)), e(1) / (e(2) + e(1))]))
    torch.testing.assert_close(normalised[1], torch.tensor([e(3) / (e(3) + e(1)), e(1) / (e(3) + e(1))]))
    torch.testing.assert_close(probabilities.sum(-1), torch.ones(2))


def test_sigmoid_bias_chooses_with_the_bias_and_weighs_without_it():
    """DeepSeek-V3 §2.1.2: top-k of s + b, weights from s alone (then normalised)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 2.0])  # lifts expert 3 above expert 1 for the choice
    weights, chosen, probabilities = route(logits, 2, "sigmoid_bias", normalize=True, bias=bias)
    s = torch.sigmoid(logits[0])
    assert chosen.tolist() == [[3, 0]]  # s + b = [0.88, 0.73, 0.5, 2.27]
    torch.testing.assert_close(weights[0], torch.stack([s[3], s[0]]) / (s[3] + s[0]))
    torch.testing.assert_close(probabilities[0], s / s.sum())  # s', the balance loss's


# ----------------------------------------------------------------------------- the auxiliary loss


def tiny_moe(router="softmax_topk", coefficient=0.1, capacity_factor=None, seed=0, hidden=16, width=32,
             experts=4, k=2, shared=None):
    torch.manual_seed(seed)
    moe = MoE(hidden, width, experts, k, router, True, coefficient, 0.01, capacity_factor, shared)
    with torch.no_grad():
        for parameter in moe.parameters():
            parameter.normal_(0, 0.5)
    return moe.train()


def explicit_aux(moe, x):
    """The formula written out, sequence by sequence and expert by expert (no vectorisation)."""
    total = 0.0
    for row in x:
        logits = row @ moe.router.weight.T
        probabilities = logits.softmax(-1) if moe.kind == "softmax_topk" else (
            logits.sigmoid() / logits.sigmoid().sum(-1, keepdim=True))
        chosen = route(logits.detach(), moe.k, moe.kind, True, moe.expert_bias)[1]
        length = row.shape[0]
        per_sequence = 0.0
        for i in range(moe.total):
            count = int((chosen == i).sum())
            per_sequence = per_sequence + count * probabilities[:, i].mean()
        total = total + moe.total / (moe.k * length) * per_sequence
    return total / x.shape[0]


@pytest.mark.parametrize("router", ["softmax_topk", "sigmoid_bias"])
def test_aux_loss_value_and_gradient_equal_the_explicit_formula(router):
    """The attached aux loss gives the gradient of main + α·aux (α = 0.1), aux written out by hand."""
    moe = tiny_moe(router)
    x = torch.randn(3, 5, 16)
    y = moe(x)
    torch.testing.assert_close(moe.aux, explicit_aux(moe, x).detach())
    main = (y * torch.linspace(-1, 1, 16)).square().mean()
    main.backward()
    attached = [p.grad.clone() for p in moe.parameters()]
    moe.zero_grad()
    moe.reset_step()
    moe.aux_loss_coefficient = 0.0  # the same forward without the attachment
    y = moe(x)
    ((y * torch.linspace(-1, 1, 16)).square().mean() + 0.1 * explicit_aux(moe, x)).backward()
    for got, expected in zip(attached, [p.grad for p in moe.parameters()]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


def test_aux_loss_decomposes_over_micro_batches():
    """Two half batches, each loss/2 with loss_scale 1/2, give the gradients of the whole batch."""
    moe = tiny_moe()
    x = torch.randn(4, 6, 16)
    target = torch.randn(4, 6, 16)

    def step(pieces):
        moe.zero_grad()
        moe.reset_step()
        for xs, ts in zip(x.chunk(pieces), target.chunk(pieces)):
            moe.loss_scale = 1.0 / pieces
            ((moe(xs) - ts).square().mean() / pieces).backward()
        return [p.grad.clone() for p in moe.parameters()], moe.aux.clone(), moe.load.clone()

    whole, halves = step(1), step(2)
    for got, expected in zip(halves[0], whole[0]):  # the two orders of summation: first-order round-off
        torch.testing.assert_close(got, expected, rtol=GRADIENT_RTOL,
                                   atol=GRADIENT_SCALE_ATOL * float(expected.abs().max()))
    torch.testing.assert_close(halves[1], whole[1])  # the step's aux: the mean over micro-batches
    assert torch.equal(halves[2], whole[2])  # loads summed over micro-batches


# ----------------------------------------------------------------------------- capacity and drops


def test_capacity_drops_the_late_slots_and_counts_them():
    moe = tiny_moe(capacity_factor=0.5, coefficient=0.0)
    x = torch.randn(2, 8, 16)
    y = moe(x)
    n, k, E = 16, 2, 4
    slots = capacity(0.5, n, k, E)
    assert slots == math.ceil(0.5 * n * k / E) == 4
    load = moe.load
    assert int(moe.dropped) == int((load - slots).clamp(min=0).sum()) > 0
    # by hand: each expert keeps its first `slots` slots in token order, the rest add nothing
    tokens = x.reshape(n, 16)
    with torch.no_grad():
        weights, chosen, _ = route(tokens @ moe.router.weight.T, k, "softmax_topk", True)
        expected, seen = torch.zeros(n, 16), [0] * E
        for t in range(n):
            for j in range(k):
                e = int(chosen[t, j])
                seen[e] += 1
                if seen[e] <= slots:
                    row = tokens[t:t + 1]
                    out = (F.silu(row @ moe.experts.gate[e]) * (row @ moe.experts.up[e])) @ moe.experts.down[e]
                    expected[t] += weights[t, j] * out[0]
    torch.testing.assert_close(y.reshape(n, 16), expected, rtol=1e-5, atol=1e-6)


def test_sorted_slots_keep_token_order_within_an_expert():
    chosen = torch.tensor([[1, 0], [1, 2], [0, 1]])
    order, counts, dropped = sort_slots(chosen, 3)
    assert order.tolist() == [1, 4, 0, 2, 5, 3] and counts.tolist() == [2, 3, 1] and int(dropped) == 0
    order, counts, dropped = sort_slots(chosen, 3, capacity_slots=2)
    assert order.tolist() == [1, 4, 0, 2, 3] and counts.tolist() == [2, 2, 1] and int(dropped) == 1


# ----------------------------------------------------------------------------- the bias update


def test_bias_moves_against_the_load():
    """bias_i += u·sign(mean − load_i) with loads summed by `sum_over_data` (here: two ranks' worth)."""
    moe = tiny_moe("sigmoid_bias")
    moe.load = torch.tensor([5, 1, 3, 3])  # mean 3
    update_expert_biases(moe, lambda tensor: 2 * tensor)
    torch.testing.assert_close(moe.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    assert moe.expert_bias.dtype == torch.float32 and "expert_bias" in moe.state_dict()
    cast = moe.to(torch.bfloat16)  # bf16-true casts the module: the bias stays float32, values kept
    assert cast.expert_bias.dtype == torch.float32 and cast.router.weight.dtype == torch.bfloat16
    torch.testing.assert_close(cast.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]), rtol=0, atol=0)
    softmax = tiny_moe("softmax_topk")
    softmax.load = torch.tensor([5, 1, 3, 3])
    update_expert_biases(softmax, lambda tensor: tensor)
    assert not softmax.expert_bias.any()


def test_records_accumulate_in_training_only():
    moe = tiny_moe()
    x = torch.randn(2, 4, 16)
    moe(x)
    moe(x)
    assert int(moe.load.sum()) == 2 * 2 * 4 * 2  # two forwards of 8 tokens, k = 2
    moe.eval()
    with torch.no_grad():
        moe(x)
    assert int(moe.load.sum()) == 32
    moe.reset_step()
    assert moe.load is None


# ----------------------------------------------------------------------------- the model


MOE_TINY = dict(vocab_size=64, sequence_length=32, layers=3, hidden=64, heads=4, kv_heads=2, ffn_hidden=128,
                experts=8, experts_per_token=2, moe_layers=[1, 2], shared_experts=1, moe_ffn_hidden=64)


def test_blocks_as_data_count_what_the_modules_hold():
    model = build_model("llama", **MOE_TINY)
    config = OmegaConf.create({"architecture": "llama", **{k: v for k, v in MOE_TINY.items()
                                                          if k not in ("vocab_size", "sequence_length")}})
    blocks = models.blocks_of(config)
    assert [block.experts for block in blocks] == [0, 8, 8]
    for index, block in enumerate(blocks):
        held = sum(p.numel() for p in model.blocks[str(index)].parameters() if p.dim() >= 2)
        assert block.matmul_weights() == held
    moe = blocks[1]
    attention = sum(linear.fan_in * linear.fan_out for linear in moe.linears if linear.name.startswith("attention"))
    # one token: router h·E, the shared expert 3·h·w, k = 2 routed experts 3·h·w each
    assert moe.active_matmul_weights() == attention + 64 * 8 + 3 * 64 * 64 + 2 * 3 * 64 * 64
    dense = models.dense_block_of(config)
    assert blocks[0] == dense and dense.active_matmul_weights() == dense.matmul_weights()
    flops = models.model_flops_per_token(3, 64, 32, 64, block=moe, blocks=blocks)
    assert flops == 6 * (dense.matmul_weights() + 2 * moe.active_matmul_weights() + 64 * 64) + 12 * 3 * 64 * 32


def test_a_rank_building_some_experts_gets_the_full_models_values():
    """Expert e of block b is drawn from its own generator (seed, b, e): expert parallelism's ranks
    build only theirs (strategies/expert_parallel.py relies on it)."""
    model = build_model("llama", **MOE_TINY, seed=3)
    full = model.blocks["2"].mlp.experts
    part = Experts(64, 64, 3, first=4, total=8)
    part.initialize_seeded(3, 2, models.transformer.residual_init_std(3))
    for name in ("gate", "up", "down"):
        assert torch.equal(getattr(part, name), getattr(full, name)[4:7])
    shapes = build_model("llama", **MOE_TINY, seed=3, device="meta")
    shapes.materialise("cpu", ["blocks.2"])
    assert torch.equal(shapes.blocks["2"].mlp.experts.gate, full.gate)


def test_the_model_trains_and_records_each_block():
    model = build_model("llama", **MOE_TINY).train()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    model.set_loss_scale(1.0)
    model.loss(model(tokens), tokens).backward()
    for name in ("1", "2"):
        moe = model.blocks[name].mlp
        assert int(moe.load.sum()) == 2 * 16 * 2 and moe.router.weight.grad.abs().sum() > 0
        assert moe.experts.gate.grad is not None


# ----------------------------------------------------------------------------- the config's rules


def config_problems(*overrides):
    from layerwise.config.errors import ConfigError
    from layerwise.preflight import validate
    from tests.ranks import compose_config
    try:
        strategy = () if any(item.startswith("strategy=") for item in overrides) else ("strategy=single",)
        validate(compose_config(*strategy, "logger=none", *overrides))
    except ConfigError as error:
        return error.problems
    return []


@pytest.mark.parametrize("overrides, words", [
    (("model=gpt_tiny", "model.experts=8"), ["model.experts=8", "model.architecture=gpt", "Fix: model.architecture=llama"]),
    (("model=bert_tiny", "model.experts=4"), ["model.experts=4", "model.architecture=bert"]),
    (("model=moe_tiny", "model.experts_per_token=9"), ["model.experts_per_token=9", "model.experts=8", "Fix: model.experts_per_token=2"]),
    (("model=moe_tiny", "model.moe_layers=[0,2]"), ["model.moe_layers holds [2]", "[0, 2)", "Fix: model.moe_layers=[0]"]),
    (("model=moe_tiny", "model.router=top1"), ["model.router='top1'", "softmax_topk"]),
    (("model=moe_tiny", "model.capacity_factor=0"), ["model.capacity_factor=0", "> 0"]),
    (("model=llama_tiny", "model.moe_layers=[1]"), ["model.moe_layers=[1]", "model.experts=0"]),
    (("model=moe_tiny", "hardware.precision=16-mixed"), ["hardware.precision=16-mixed", "Fix: hardware.precision=bf16-mixed"]),
    (("model=moe_tiny", "strategy=kfac"), ["strategy=kfac", "K-FAC"]),
    (("model=moe_tiny", "trainer.compile=true"), ["trainer.compile=true", "Fix: trainer.compile=false"]),
    (("model=moe_tiny", "strategy=ddp", "strategy.context_parallel=2"),
     ["strategy.context_parallel=2", "Fix: model.aux_loss_coefficient=0"]),
    (("model=moe_tiny", "strategy=tp_2d", "hardware.devices_per_node=4"), ["strategy=tp_2d", "Fix: strategy=tp_1d"]),
    (("model=moe_tiny", "strategy=tp_1d", "strategy.tensor_grid=2", "strategy.sequence_parallel=true"),
     ["sequence parallelism", "Fix: strategy.sequence_parallel=false"]),
])
def test_the_config_refuses_what_moe_cannot_run(overrides, words):
    problems = " ".join(config_problems(*overrides))
    for word in words:
        assert word in problems, problems


def test_moe_shapes_are_valid():
    assert config_problems("model=moe_tiny") == []
    assert config_problems("model=moe_small") == []


# ----------------------------------------------------------------------------- seen while training


def test_a_single_moe_run_writes_its_expert_evidence(tmp_path):
    """train.py with model=moe_tiny: the metrics gain the expert columns, expert_load.csv holds every
    block's loads per step (k·tokens each), the chart exists, the loss falls."""
    import csv
    import json
    import os
    import sys
    from pathlib import Path
    from tests.warm_python import python
    root = Path(__file__).resolve().parent.parent
    result = python([sys.executable, "train.py", "debug=fast", "strategy=single", "model=moe_tiny",
                     "trainer.max_steps=8", "trainer.val_check_interval=4", "data.max_bytes=2000000",
                     "model.capacity_factor=1.0", f"hydra.run.dir={tmp_path}"],
                    cwd=root, env={**os.environ, "WANDB_MODE": "disabled"}, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with (tmp_path / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 8
    tokens, k, experts = 4 * 32, 2, 8  # debug=fast: 4 sequences of 32 per step
    for row in rows:
        assert float(row["expert_tokens_mean"]) == tokens * k / experts
        assert float(row["expert_tokens_max"]) >= float(row["expert_tokens_mean"])
        assert float(row["aux_loss"]) > 0 and float(row["dropped_tokens"]) >= 0
    assert any(float(row["dropped_tokens"]) > 0 for row in rows)  # capacity 1.0 drops the busiest's excess
    with (tmp_path / "expert_load.csv").open() as handle:
        loads = list(csv.DictReader(handle))
    assert len(loads) == 8 * 2  # every step, both MoE blocks
    assert all(sum(float(v) for key, v in row.items() if key.startswith("e")) == tokens * k for row in loads)
    assert (tmp_path / "expert_load.png").stat().st_size > 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    assert summary["experts"]["expert_load_ratio_max"] >= 1 and summary["experts"]["dropped_tokens"] > 0


def test_expert_bias_updates_equal_under_ddp_and_a_pipeline(tmp_path):
    """sigmoid_bias with u = 0.05 (large enough that the bias decides the choices from step 2 on):
    ddp (2 data ranks, loads summed by RunHooks.sum_over_data) and modular_pipeline (2 stages, 1/m
    loss scale per micro-batch) route every step's tokens exactly as single does, so their biases
    moved alike; the step's aux loss is equal too (float64 sums of float32 values: 1e-6)."""
    import csv
    import os
    import sys
    from pathlib import Path
    from tests.warm_python import python
    root = Path(__file__).resolve().parent.parent
    runs = {}
    for strategy in ("single", "ddp", "modular_pipeline"):
        directory = tmp_path / strategy
        result = python([sys.executable, "train.py", "debug=fast", f"strategy={strategy}", "model=moe_tiny",
                         "model.router=sigmoid_bias", "model.bias_update_rate=0.05", "trainer.max_steps=5",
                         "trainer.limit_val_batches=0", "trainer.charts=false", "data.max_bytes=2000000",
                         f"hydra.run.dir={directory}"],
                        cwd=root, env={**os.environ, "WANDB_MODE": "disabled"}, timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        with (directory / "metrics.csv").open() as handle:
            aux = [float(row["aux_loss"]) for row in csv.DictReader(handle)]
        runs[strategy] = (directory / "expert_load.csv").read_text(), aux
    loads, aux = runs["single"]
    assert len(set(loads.splitlines()[3:])) > 2  # the later steps' loads differ from step to step
    for strategy in ("ddp", "modular_pipeline"):
        assert runs[strategy][0] == loads, strategy
        assert runs[strategy][1] == pytest.approx(aux, rel=1e-6, abs=1e-6), strategy


def test_progressive_stacking_copies_each_block_with_its_kind():
    """grow(L) appends block L + i as a copy of block i: an MoE block's copy is an MoE block."""
    model = build_model("llama", **{**MOE_TINY, "layers": 2, "moe_layers": [1]})
    model.grow(2)
    kinds = [type(model.blocks[str(index)].mlp).__name__ for index in range(4)]
    assert kinds == ["SwiGLU", "MoE", "SwiGLU", "MoE"]
    for name, value in model.blocks["1"].state_dict().items():
        assert torch.equal(model.blocks["3"].state_dict()[name], value), name
