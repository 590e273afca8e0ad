"""L2L offload (docs/strategies/l2l.md): the relay plan, numerics equal to `single`, memory flat in depth, bytes, resume.

Test ids: m = micro-batches, const = constant-memory variant (stash on the host), std = stash on the device.
"""

import csv

import pytest
import torch
from omegaconf import OmegaConf

from parallel.comm import Communicator, Group
from layerwise.run.optim import build_optimizer
from layerwise.run.fit import train
from layerwise.config.errors import ConfigError
from layerwise.preflight import validate
from models import build_model
from strategies.l2l import HostStore, Relay, relay_peak_bytes
from strategies.schedule import (BACKWARD, FORWARD, layered, looped_breadth_first, simulate, unit_cost,
                                 validate_plan)
from strategies.schedule.ir import parse_action
from strategies.schedule.offload import (GRADIENT_TO_HOST, RELEASE_BACKWARD, RELEASE_FORWARD, UPDATE_ON_HOST,
                                         WEIGHTS_BACKWARD, WEIGHTS_FORWARD, add_host_transfers, relay_plan)
from tests.ranks import QUICK, compose_config
from tests.references import compare_under_sgd, consolidated_parameters, tracing_optimizer
from tests.same_checkpoints import assert_same_checkpoints
from tests.tolerances import (BF16_VERSUS_FP32_LOSS_RTOL, DEVICE_LOSS_RTOL, OptimizerTrace, assert_same_losses,
                              assert_same_parameters)

STEPS = 5
OPTIMIZER = OmegaConf.create(dict(name="adamw", lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
                                  momentum=0.9))
VARIANTS = [(1, False), (4, False), (1, True), (4, True)]


def variant_id(case):
    return f"m{case[0]}_{'const' if case[1] else 'std'}"


# ----------------------------------------------------------------------------- the plan


def weights_in_flight(row) -> int:
    """Most stages whose weights are on the device at once, read from the plan."""
    live, most = 0, 0
    for action in row:
        live += action.kind in (WEIGHTS_FORWARD, WEIGHTS_BACKWARD)
        live -= action.kind in (RELEASE_FORWARD, RELEASE_BACKWARD)
        most = max(most, live)
    return most


@pytest.mark.parametrize("stages, micro_batches, prefetch, reduce",
                         [(3, 1, True, False), (6, 4, True, True), (6, 4, False, False), (26, 16, True, False)])
def test_relay_plan_validates_and_simulates(stages, micro_batches, prefetch, reduce):
    plan = validate_plan(relay_plan(stages, micro_batches, prefetch, reduce))
    kinds = [action.kind for action in plan.ranks[0]]
    for kind in (WEIGHTS_FORWARD, WEIGHTS_BACKWARD, GRADIENT_TO_HOST, UPDATE_ON_HOST):
        assert kinds.count(kind) == stages  # 2 weight copies + 1 gradient copy per layer, whatever m
    assert kinds.count(FORWARD) == kinds.count(BACKWARD) == stages * micro_batches
    assert weights_in_flight(plan.ranks[0]) == (2 if prefetch else 1)
    assert simulate(plan, unit_cost).makespan == 2 * stages * micro_batches  # copies cost 0 in unit time
    updates = [action.stage for action in plan.ranks[0] if action.kind == UPDATE_ON_HOST]
    assert updates == list(reversed(range(stages)))  # eager: last layer first, during the backward


@pytest.mark.parametrize("background", [True, False])
def test_host_store_runs_its_work_in_the_plan_order_on_its_thread_or_in_place(background):
    """A CUDA device's host store works on its own thread; a CPU device's in place (its cores are the
    device's): the same work in the same order either way, and an update steps what it is given."""
    import threading
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
    store = HostStore(optimizer, None, Group("data", (0,)), background=background)
    seen, before = [], layer.weight.detach().clone()
    try:
        for stage in (2, 1, 0):
            store.submit(lambda s: seen.append((s, threading.current_thread().name)), stage)
        layer.weight.grad = torch.ones_like(layer.weight)
        store.submit(store.update, [layer.weight])
        store.wait()
    finally:
        store.close()
    assert [stage for stage, _ in seen] == [2, 1, 0]
    assert {name.startswith("l2l-host-store") for _, name in seen} == {background}
    assert torch.equal(layer.weight.detach(), before - 1.0) and layer.bias.grad is None


def test_offload_kinds_round_trip_and_depend_on_weights():
    plan = relay_plan(3, 2)
    for text in ("1Wf", "1Wb", "1Ef", "1Eb", "1Gh", "1Uh"):
        assert str(parse_action(text)) == text
    from strategies.schedule import dependencies
    assert parse_action("1Wf") in dependencies(parse_action("1F0"), plan)
    assert parse_action("1Wb") in dependencies(parse_action("1B1"), plan)
    assert parse_action("1Wf") not in dependencies(parse_action("1F0"), layered(3, 2))  # compute-only plan


def test_offload_pass_rejects_plans_it_cannot_relay():
    with pytest.raises(ValueError, match="breadth_first_micro_batches"):
        add_host_transfers(layered(3, 4, breadth_first_micro_batches=2))
    with pytest.raises(ValueError, match="one-rank"):
        add_host_transfers(looped_breadth_first(2, 2, 2))


# ----------------------------------------------------------------------------- the relay alone


def tiny_model(tied=False, layers=3, dropout=0.1):
    return build_model("gpt", vocab_size=64, sequence_length=16, layers=layers, hidden=32, heads=2, mlp_ratio=4,
                       dropout=dropout, tie_embeddings=tied, seed=1)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("constant_memory", [False, True], ids=["std", "const"])
def test_relay_step_is_bit_identical_to_a_plain_step(tied, constant_memory):
    """m = 1, dropout on: the relay with eager per-layer updates is one plain AdamW step, bit for bit."""
    reference, offloaded = tiny_model(tied), tiny_model(tied)
    plain = build_optimizer(OPTIMIZER, reference.named_parameters())
    relay = Relay(offloaded, build_optimizer(OPTIMIZER, offloaded.named_parameters()), Communicator(),
                  Group("data", (0,)), 1, constant_memory=constant_memory)
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        tokens, targets = (torch.randint(0, 64, (4, 16), generator=generator) for _ in range(2))
        torch.manual_seed(step)
        plain.zero_grad(set_to_none=True)
        expected = reference.loss(reference(tokens), targets)
        expected.backward()
        plain.step()
        torch.manual_seed(step)
        relay.store.optimizer.zero_grad(set_to_none=True)
        assert torch.equal(relay.step(tokens, targets), expected.detach())
    relay.close()
    for (name, actual), expected in zip(offloaded.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(actual, expected), name


def test_cross_mixed_precision_keeps_fp32_masters_and_halves_the_bytes():
    reference, offloaded = tiny_model(dropout=0.0), tiny_model(dropout=0.0)
    communicator = Communicator()
    relay = Relay(offloaded, build_optimizer(OPTIMIZER, offloaded.named_parameters()), communicator,
                  Group("data", (0,)), 2, dtype=torch.bfloat16)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    loss = relay.step(tokens, tokens)
    relay.close()
    torch.testing.assert_close(loss, reference.loss(reference(tokens), tokens), rtol=BF16_VERSUS_FP32_LOSS_RTOL,
                               atol=0)
    assert all(p.dtype == torch.float32 for p in offloaded.parameters())
    parameters = sum(p.numel() for p in offloaded.parameters())
    assert communicator.snapshot()["host_device"] == 3 * 2 * parameters  # bf16 weights and gradients


# ----------------------------------------------------------------------------- compute-side memory


def relay_peak(layers, micro_batches, constant_memory, micro_batch_size=1, sequence=32, hidden=128, p=0.0):
    """Compute-side peak of the second step (optimizer state exists) of a gpt_tiny-width relay
    (`p`: both steps drop LayerDrop's step-0 mask)."""
    from models import layer_drop_mask
    model = build_model("gpt", vocab_size=256, sequence_length=sequence, layers=layers, hidden=hidden, heads=4,
                        mlp_ratio=4, dropout=0.1, seed=0)
    model.drop_blocks(layer_drop_mask(0, 0, layers, p))
    tokens = torch.randint(0, 256, (micro_batches * micro_batch_size, sequence))
    return relay_peak_bytes(model, build_optimizer(OPTIMIZER, model.named_parameters()), tokens, tokens,
                            micro_batches, constant_memory)


def test_constant_variant_is_flat_in_depth_and_micro_batches():
    depth = {layers: relay_peak(layers, 1, True) for layers in (4, 24)}
    micro = {m: relay_peak(4, m, True) for m in (1, 4, 16)}
    assert max(depth.values()) <= 1.05 * min(depth.values()), depth
    assert max(micro.values()) <= 1.05 * min(micro.values()), micro


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_standard_variant_grows_only_by_the_stash(micro_batches):
    """Depth 4 -> 24 adds exactly 20 stashed activations per micro-batch (b·s·h fp32 each), no weights."""
    shallow, deep = relay_peak(4, micro_batches, False), relay_peak(24, micro_batches, False)
    stash = 20 * micro_batches * 1 * 32 * 128 * 4
    assert abs((deep - shallow) - stash) <= 0.05 * stash, (shallow, deep, stash)


# ----------------------------------------------------------------------------- through Lightning


def run(tmp_path, name, *overrides, steps=STEPS):
    cfg = compose_config(*QUICK, f"trainer.max_steps={steps}", "trainer.val_check_interval=5", *overrides)
    summary = train(cfg, tmp_path / name, validate(cfg))
    assert summary["status"] == "completed"
    return summary, tmp_path / name


def metrics(directory):
    with (directory / "metrics.csv").open() as handle:
        return list(csv.DictReader(handle))


@pytest.fixture(scope="module")
def single_with_dropout(tmp_path_factory):
    directory = tmp_path_factory.mktemp("single")
    with tracing_optimizer(directory / "single"):
        return run(directory, "single", "strategy=single", "model.dropout=0.1")


@pytest.mark.parametrize("case", VARIANTS, ids=variant_id)
def test_l2l_reproduces_single_with_dropout(single_with_dropout, tmp_path, case):
    micro_batches, constant_memory = case
    summary, directory = run(tmp_path, "l2l", "strategy=l2l", "hardware.devices_per_node=1", "model.dropout=0.1",
                             f"strategy.micro_batches={micro_batches}", f"strategy.constant_memory={constant_memory}",
                             "trainer.measure_every_n_steps=1")  # peak_compute_bytes is read on every row
    assert_same_losses(summary["losses"], single_with_dropout[0]["losses"])
    parameters = consolidated_parameters(directory, "l2l")
    assert_same_parameters(parameters, consolidated_parameters(single_with_dropout[1], "single"),
                           OptimizerTrace.load(single_with_dropout[1]))
    # Transfers: 2 weight copies + 1 gradient copy per layer = 3·4·P bytes (fp32), whatever m; the
    # constant variant also moves the stash: forward x out + in, backward x in, dy in, dx out, for
    # each of the L + 1 stage boundaries: 5·(L+1)·B·s·h·4 more.
    expected = 3 * 4 * sum(p.numel() for p in parameters.values())
    if constant_memory:
        expected += 5 * (2 + 1) * 8 * 32 * 32 * 4  # L = 2 blocks, B = 8, s = 32, h = 32
    assert [float(row["comm_bytes_host_device"]) for row in metrics(directory)] == [expected] * STEPS
    assert all(float(row["peak_compute_bytes"]) > 0 for row in metrics(directory))


def test_l2l_data_parallel_with_tied_weights_reproduces_single(tmp_path):
    """2 ranks relay the same layers; the host reduces gradients; the tied embedding/head is updated once."""
    tied = ["model.tie_embeddings=true"]
    with tracing_optimizer(tmp_path / "single"):
        single, single_directory = run(tmp_path, "single", "strategy=single", *tied)
    summary, directory = run(tmp_path, "l2l", "strategy=l2l", "strategy.micro_batches=2", *tied)
    assert summary["world_size"] == 2
    assert_same_losses(summary["losses"], single["losses"])
    parameters = consolidated_parameters(directory, "l2l")
    assert_same_parameters(parameters, consolidated_parameters(single_directory, "single"),
                           OptimizerTrace.load(single_directory))
    unique = sum(p.numel() for name, p in parameters.items() if name != "model.head.output.weight")
    tied_weight = parameters["model.embed.token.weight"].numel()  # travels with the embed and with the head
    rows = metrics(directory)
    assert {float(row["comm_bytes_host_device"]) for row in rows} == {3 * 4 * (unique + tied_weight)}
    assert {float(row["comm_bytes_all_reduce"]) for row in rows} == {2 * (2 - 1) / 2 * unique * 4}


@pytest.mark.parametrize("case", ["l2l_m4", "l2l_dp2_m2_const", "llama_l2l_dp2_m2_const", "l2l_m4_layer_drop",
                                  "l2l_dp2_m2_const_layer_drop", "ddp_dp2_layer_drop"])
def test_l2l_equals_single_under_sgd(case, tmp_path, tmp_path_factory):
    """Plain SGD sees the gradient's scale, which AdamW normalises away (references.SgdComparison):
    losses, the first step's gradients and the parameters after references.SGD_STEPS steps."""
    compare_under_sgd(case, tmp_path, tmp_path_factory).check()


def test_l2l_resume_is_bit_identical(tmp_path):
    overrides = ["strategy=l2l", "hardware.devices_per_node=1", "model.dropout=0.1", "strategy.micro_batches=4",
                 "strategy.constant_memory=true", "trainer.checkpoint_every_n_steps=1"]
    whole, whole_directory = run(tmp_path, "whole", *overrides)
    first, directory = run(tmp_path, "resumed", *overrides, steps=3)
    assert first["steps"] == 3
    resumed, _ = run(tmp_path, "resumed", *overrides)
    assert resumed["losses"] == whole["losses"]
    expected = consolidated_parameters(whole_directory, "l2l")
    for name, value in consolidated_parameters(directory, "l2l").items():
        assert torch.equal(value, expected[name]), name
    assert_same_checkpoints(directory, whole_directory)  # the host store's Adam state too


# ----------------------------------------------------------------------------- config checks


def test_check_names_the_field_and_the_fix():
    cfg = compose_config(*QUICK, "strategy=l2l", "hardware.devices_per_node=1", "strategy.micro_batches=3",
                         "trainer.gradient_clip_val=1.0")
    with pytest.raises(ConfigError) as error:
        validate(cfg)
    message = str(error.value)
    assert "strategy.micro_batches=3 must divide the per-rank batch 8" in message
    assert "trainer.gradient_clip_val=0" in message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("constant_memory", [False, True], ids=["std", "const"])
def test_cuda_relay_matches_cpu(constant_memory):  # pragma: no cover - no GPU on the development machine
    """Three relay steps (m = 2, eager AdamW updates on the host, dropout 0) on CUDA equal three on
    the CPU: every step's loss, then every parameter of the host copy the relay updated. The const
    variant's backward reads detached host-stashed inputs copied on the side stream (issue 54)."""
    cpu_model, gpu_model = tiny_model(dropout=0.0), tiny_model(dropout=0.0)
    for parameter in gpu_model.parameters():
        parameter.data = parameter.data.pin_memory()
    losses, trace = {}, OptimizerTrace()
    for model, device in ((cpu_model, "cpu"), (gpu_model, "cuda")):
        relay = Relay(model, build_optimizer(OPTIMIZER, model.named_parameters()), Communicator(),
                      Group("data", (0,)), 2, constant_memory=constant_memory, device=torch.device(device))
        generator = torch.Generator().manual_seed(0)
        losses[device] = []
        for _ in range(3):
            tokens, targets = (torch.randint(0, 64, (4, 16), generator=generator) for _ in range(2))
            relay.store.optimizer.zero_grad(set_to_none=True)
            if device == "cpu":  # the reference: its AdamW updates are traced for the tolerance
                trace.before_step(model.named_parameters(remove_duplicate=False), relay.store.optimizer)
            losses[device].append(relay.step(tokens, targets).cpu())
            if device == "cpu":
                trace.after_step(model.named_parameters(remove_duplicate=False), relay.store.optimizer)
        relay.close()
    torch.testing.assert_close(torch.stack(losses["cuda"]), torch.stack(losses["cpu"]), rtol=DEVICE_LOSS_RTOL, atol=0)
    assert_same_parameters({name: value.cpu() for name, value in gpu_model.state_dict().items()},
                           cpu_model.state_dict(), trace)


def test_a_view_or_detach_of_a_copy_finds_its_event(monkeypatch):
    """A copy is found by the storage it wrote: the backward reads `x.detach()`, a new tensor object
    over x's bytes, and must wait for x's copy (issue 54, defect 1). Under tests/fake_gpu.py's side
    stream, reading before the wait is flagged, and a wait through a view or a detach lands it."""
    from strategies.l2l import DeviceCopier
    from tests.fake_gpu import InFlightCopies

    copies = InFlightCopies(fail=False)
    mode = copies.patch(monkeypatch.setattr)
    copier = DeviceCopier(torch.device("cpu"), torch.float32)
    for alias in (lambda x: x.detach(), lambda x: x[1:], lambda x: x.detach().requires_grad_(True)):
        copy = copier.to_device(torch.ones(4, 2))
        with mode:
            alias(copy).sum()
        assert len(copies.reads) == 1, copies.reads  # read in flight
        copier.wait_for(alias(copy))
        with mode:
            copy.sum()
        assert len(copies.reads) == 1 and not copier.in_flight, copies.reads  # landed, nothing left to find
        copies.reads.clear()
    assert copies.issued == copies.awaited == 3


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("constant_memory", [False, True], ids=["std", "const"])
def test_relay_reads_no_copy_before_its_own_wait(constant_memory, dropout, monkeypatch):
    """Two relay steps (m = 2, 3 blocks) under tests/fake_gpu.py's side stream: no operator reads a
    copy the compute stream has not waited on by that copy's own event. Before issue 54's fix the
    backward of every stage s > 0 read the `.detach()` of a host-stashed input, whose event a lookup
    by tensor object missed: 44 reads of 16 never-awaited copies with constant_memory, dropout 0 or
    0.1 (on CUDA the mask's wait happened to cover the latter). Every copy is awaited, once."""
    from tests.fake_gpu import InFlightCopies

    copies = InFlightCopies(fail=False)
    mode = copies.patch(monkeypatch.setattr)
    model = tiny_model(dropout=dropout)
    relay = Relay(model, build_optimizer(OPTIMIZER, model.named_parameters()), Communicator(), Group("data", (0,)),
                  2, constant_memory=constant_memory)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        tokens, targets = (torch.randint(0, 64, (4, 16), generator=generator) for _ in range(2))
        relay.store.optimizer.zero_grad(set_to_none=True)
        with mode:
            relay.step(tokens, targets)
    relay.close()
    assert copies.issued > 0 and copies.reads == [], f"{len(copies.reads)} reads of unawaited copies: {copies.reads[:3]}"
    assert copies.awaited == copies.issued


@pytest.mark.parametrize("constant_memory, dropout", [(False, 0.1), (True, 0.1), (True, 0.0)],
                         ids=["std_dropout", "const_dropout", "const_no_dropout"])
def test_every_copy_to_the_device_is_awaited_before_it_is_read(constant_memory, dropout, monkeypatch, tmp_path):
    """On CUDA the relay copies on a side stream: dropout masks, targets and (constant_memory) the
    stashed dx were copied after the compute stream's last wait and read unawaited (issue 37,
    item 7), and with dropout 0 the backward's detached stashed input (issue 54). tests/fake_gpu.py
    keeps each copy in flight until the code waits on that copy's event; train.py's whole run."""
    from layerwise.config.validate import world_size
    from layerwise.run.fit import train
    from tests.fake_gpu import InFlightCopies

    copies = InFlightCopies(fail=False)
    copies.install(monkeypatch.setattr)
    cfg = compose_config("strategy=l2l", "logger=none", "trainer.progress=none", "trainer.max_steps=2",
                         "trainer.limit_val_batches=1", "trainer.val_check_interval=100",
                         "data.global_batch_size=8", "data.sequence_length=32", "model.layers=2",
                         "model.hidden=32", "model.heads=2", "data.max_bytes=2000000", f"model.dropout={dropout}",
                         f"strategy.constant_memory={str(constant_memory).lower()}", "hardware.devices_per_node=1")
    summary = train(cfg, tmp_path, world_size(cfg))
    assert summary["status"] == "completed" and len(summary["losses"]) == 2
    assert copies.issued > 0 and copies.reads == [], f"{len(copies.reads)} reads of unawaited copies: {copies.reads[:3]}"


# ----------------------------------------------------------------------------- dynamic architectures


# Blocks 1, 2 droppable. p = 0.25 under AdamW: a block kept only once leaves its key bias (gradient
# analytically 0, round-off in practice) with one Adam step, whose round-off can be exactly 0 in the
# reference: tolerances.adam_tolerance then reads it as an unreachable element (v = 0) and allows 0.
LAYER_DROP = ["model.layers=4", "strategy.layer_drop=0.25", "model.dropout=0.1"]


def test_layer_drop_mask_depends_on_seed_and_step_only():
    from models import layer_drop_mask
    masks = [layer_drop_mask(1234, step, 6, 0.5) for step in range(6)]
    assert masks == [layer_drop_mask(1234, step, 6, 0.5) for step in range(6)]  # a rerun draws the same
    assert len(set(masks)) > 1 and all(mask <= {"1", "2", "3", "4"} for mask in masks)  # first, last kept
    assert layer_drop_mask(1234, 0, 6, 0.0) == frozenset()
    assert masks != [layer_drop_mask(4321, step, 6, 0.5) for step in range(6)]


def test_dropped_blocks_are_identities_and_eval_runs_every_block():
    model = tiny_model(layers=4, dropout=0.0)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    full = model(tokens)
    model.drop_blocks({"1", "2"})
    shallow = model(tokens)
    x = model.embed(tokens)
    for name in ("0", "3"):
        x = model.blocks[name](x)
    assert torch.equal(shallow, model.head(x)) and not torch.equal(shallow, full)
    assert torch.equal(model.eval()(tokens), full)


@pytest.fixture(scope="module")
def single_with_layer_drop(tmp_path_factory):
    directory = tmp_path_factory.mktemp("single_layer_drop")
    with tracing_optimizer(directory / "single"):
        return run(directory, "single", "strategy=single", *LAYER_DROP)


def block_parameters(parameters, name):
    return sum(value.numel() for key, value in parameters.items() if key.startswith(f"model.blocks.{name}."))


@pytest.mark.parametrize("case", [(4, False), (1, True)], ids=variant_id)
def test_l2l_layer_drop_reproduces_single_and_moves_only_the_kept_blocks(single_with_layer_drop, tmp_path, case):
    """AdamW, the same (seed, step) mask: losses and parameters equal single's; a dropped block is never
    fetched nor returned, so each step moves 3·4·(P − dropped blocks' parameters) bytes (+ the stash)."""
    from models import layer_drop_mask
    micro_batches, constant_memory = case
    summary, directory = run(tmp_path, "l2l", "strategy=l2l", "hardware.devices_per_node=1", *LAYER_DROP,
                             f"strategy.micro_batches={micro_batches}", f"strategy.constant_memory={constant_memory}")
    assert_same_losses(summary["losses"], single_with_layer_drop[0]["losses"])
    parameters = consolidated_parameters(directory, "l2l")
    assert_same_parameters(parameters, consolidated_parameters(single_with_layer_drop[1], "single"),
                           OptimizerTrace.load(single_with_layer_drop[1]))
    total, expected = sum(p.numel() for p in parameters.values()), []
    for step in range(STEPS):
        dropped = layer_drop_mask(1234, step, 4, 0.25)
        moved = 3 * 4 * (total - sum(block_parameters(parameters, name) for name in dropped))
        if constant_memory:  # the stash crosses the L_kept + 1 stage boundaries
            moved += 5 * (4 - len(dropped) + 1) * 8 * 32 * 32 * 4
        expected.append(moved)
    assert len(set(expected)) > 1  # the mask varies over these steps
    assert [float(row["comm_bytes_host_device"]) for row in metrics(directory)] == expected


def test_layer_drop_keeps_the_device_peak_flat():
    """Constant variant, 8 blocks: the peak is one layer's, whatever p; the standard variant's stash
    only shrinks with the dropped blocks (docs/results/l2l.md, "Dynamic architectures")."""
    from models import layer_drop_mask
    assert [len(layer_drop_mask(0, 0, 8, p)) for p in (0.0, 0.25, 0.5)] == [0, 2, 3]  # the masks measured
    constant = {p: relay_peak(8, 2, True, hidden=64, p=p) for p in (0.0, 0.25, 0.5)}
    standard = {p: relay_peak(8, 2, False, hidden=64, p=p) for p in (0.0, 0.5)}
    assert max(constant.values()) <= 1.05 * min(constant.values()), constant
    assert standard[0.5] <= standard[0.0], standard


GROWTH = ["model.layers=2", "strategy.grow_at=[2]", "strategy.grow_by=2", "model.dropout=0.1"]  # 2 -> 4 at step 2


@pytest.fixture(scope="module")
def single_growing(tmp_path_factory):
    directory = tmp_path_factory.mktemp("single_growing")
    with tracing_optimizer(directory / "single"):
        return run(directory, "single", "strategy=single", *GROWTH)


@pytest.mark.parametrize("case", [(2, False), (1, True)], ids=variant_id)
def test_l2l_reproduces_single_across_a_growth(single_growing, tmp_path, case):
    """Progressive stacking at step 2 (blocks 2, 3 copies of 0, 1, fresh AdamW state): losses and the
    4-block parameters equal single's; the bytes per step follow the depth (3·4·P of the model then)."""
    micro_batches, constant_memory = case
    summary, directory = run(tmp_path, "l2l", "strategy=l2l", "hardware.devices_per_node=1", *GROWTH,
                             f"strategy.micro_batches={micro_batches}", f"strategy.constant_memory={constant_memory}")
    assert_same_losses(summary["losses"], single_growing[0]["losses"])
    parameters = consolidated_parameters(directory, "l2l")
    assert sum(name.endswith("blocks.3.mlp.fc_out.weight") for name in parameters) == 1  # grown to 4 blocks
    assert_same_parameters(parameters, consolidated_parameters(single_growing[1], "single"),
                           OptimizerTrace.load(single_growing[1]))
    total = sum(p.numel() for p in parameters.values())
    shallow = total - sum(block_parameters(parameters, name) for name in ("2", "3"))
    expected = [3 * 4 * (shallow if step < 2 else total) for step in range(STEPS)]
    if constant_memory:
        expected = [moved + 5 * ((2 if step < 2 else 4) + 1) * 8 * 32 * 32 * 4 for step, moved in enumerate(expected)]
    assert [float(row["comm_bytes_host_device"]) for row in metrics(directory)] == expected


def test_grown_model_resumes_before_and_after_the_growth(tmp_path):
    """Checkpoints after step 1 (2 blocks) and step 3 (4 blocks) resume to the uninterrupted run, bit for bit."""
    overrides = ["strategy=l2l", "hardware.devices_per_node=1", "strategy.micro_batches=2", *GROWTH,
                 "trainer.checkpoint_every_n_steps=1"]
    whole, whole_directory = run(tmp_path, "whole", *overrides)
    for stop in (1, 3):
        first, directory = run(tmp_path, f"resumed{stop}", *overrides, steps=stop)
        assert first["steps"] == stop
        resumed, _ = run(tmp_path, f"resumed{stop}", *overrides)
        assert resumed["losses"] == whole["losses"], stop
        expected = consolidated_parameters(whole_directory, "l2l")
        actual = consolidated_parameters(directory, "l2l")
        assert actual.keys() == expected.keys()
        for name, value in actual.items():
            assert torch.equal(value, expected[name]), (stop, name)


def test_growth_keeps_the_device_peak_flat():
    """Constant variant: a model grown from 8 to 32 blocks (stacked twice) peaks as the 8-block one."""
    model = build_model("gpt", vocab_size=256, sequence_length=32, layers=8, hidden=32, heads=4, mlp_ratio=4,
                        dropout=0.1, seed=0)
    optimizer = build_optimizer(OPTIMIZER, model.named_parameters())
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    peaks = {8: relay_peak_bytes(model, optimizer, tokens, tokens, 2, True)}
    from layerwise.run.optim import add_parameters
    for _ in range(2):
        add_parameters(optimizer, model.grow(len(model.blocks)))
    assert len(model.blocks) == 32
    peaks[32] = relay_peak_bytes(model, optimizer, tokens, tokens, 2, True)
    assert max(peaks.values()) <= 1.05 * min(peaks.values()), peaks


def test_growth_copies_the_bottom_blocks_and_starts_their_state_fresh():
    model = tiny_model(layers=3, dropout=0.0)
    optimizer = build_optimizer(OPTIMIZER, model.named_parameters())
    model.loss(model(torch.zeros(1, 16, dtype=torch.long)), torch.zeros(1, 16, dtype=torch.long)).backward()
    optimizer.step()
    from layerwise.run.optim import add_parameters
    added = model.grow(4)
    add_parameters(optimizer, added)
    assert list(model.blocks) == [str(index) for index in range(7)] and model.layers == 7
    for new, source in ((3, 0), (4, 1), (5, 2), (6, 0)):  # block L + i copies block i mod L
        for (name, value), copied in zip(model.blocks[str(new)].state_dict().items(),
                                         model.blocks[str(source)].state_dict().values()):
            assert torch.equal(value, copied) and value.data_ptr() != copied.data_ptr(), name
    assert all(parameter not in optimizer.state for parameter in added)
    assert sum(len(group["params"]) for group in optimizer.param_groups) == len(list(model.parameters()))
