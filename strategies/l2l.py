"""L2L: layer-to-layer execution with an eager parameter server (Pudipeddi et al. 2020; docs/strategies/l2l.md).

The model itself (`task.model`, fp32) is the host store, and the Lightning optimizer over it is the
host optimizer. A step is the plan `offload.relay_plan(L + 2, m)` (stages: embed, L blocks, head
with the loss) run by the one executor:
    forward:  for each stage: weights -> device (the next stage's copy already in flight), every
              micro-batch through it without a graph, inputs stashed, weights freed;
    backward: for each stage in reverse: weights -> device, recompute each micro-batch with autograd,
              accumulate dW, dW -> host, where a worker thread reduces (data parallel) and updates
              the stage *eagerly* while the device runs the earlier stages.
The update of stage s touches only stage s's weights, which no later action of the step reads: it
is one synchronous optimizer step. `constant_memory` keeps the stash on the host.
"""

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn as nn
from torch.func import functional_call
from torch.utils.weak import WeakIdKeyDictionary
from typing_extensions import override

from parallel.dims import Layout
from parallel.memory import host_side
from models.transformer import IGNORE_INDEX
from strategies.base import OwnedStepStrategy
from strategies.buckets import bucket_bytes, post_bucket_reductions
from strategies.precision import compute_dtype
from strategies.checks import divisors
from strategies.compile import compiles
from strategies.registry import StrategyEntry
from strategies.schedule import BACKWARD, FINISH, FORWARD, REDUCE_GRADIENT, execute, validate_plan
from strategies.schedule.offload import (GRADIENT_TO_HOST, RELEASE_BACKWARD, RELEASE_FORWARD, UPDATE_ON_HOST,
                                         WEIGHTS_BACKWARD, WEIGHTS_FORWARD, relay_plan)



# ----------------------------------------------------------------------------- device side


class DeviceCopier:
    """Host -> device copies in the compute dtype (cross mixed precision: fp32 stays on the host).

    On CUDA the copy runs on a side stream from pinned memory (non_blocking), so the next layer's
    weights arrive while this one computes; each copy records its own event, and `wait_for(t)`
    makes the compute stream wait for the copies of `t` only (not for the prefetch still in flight).
    A copy is found by its *storage*, the buffer the side stream writes: a view or a `.detach()` of
    a copy is a new tensor object over the same bytes (the backward reads `x.detach()`), so a lookup
    by tensor object would find no event and let the compute stream read the bytes before they land.
    On CPU the "device" is the same DRAM: a copy is a fresh tensor that the memory meter counts.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # untyped storage -> the event its copy recorded; weak: a freed copy takes its entry along.
        # A storage's Python object lives as long as the storage (torch preserves it), so every
        # tensor over these bytes finds the same key.
        self.in_flight = WeakIdKeyDictionary()

    @torch.no_grad()
    def to_device(self, host: torch.Tensor, cast: bool = True) -> torch.Tensor:
        dtype = self.dtype if cast and host.is_floating_point() else host.dtype
        device, event = self.issue(host, dtype)
        if event is not None:
            self.in_flight[device.untyped_storage()] = event
        return device

    def issue(self, host: torch.Tensor, dtype: torch.dtype) -> tuple:
        """Start one copy: (the device tensor, the event the side stream records after it; None
        where the copy is complete on return, as on the CPU)."""
        if self.stream is None:
            return host.to(dtype=dtype, copy=True), None
        with host_side():  # cast on the host so that only compute-dtype bytes cross the bus
            staged = host.to(dtype=dtype).pin_memory()
        with torch.cuda.stream(self.stream):
            device = staged.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        device.record_stream(torch.cuda.current_stream(self.device))
        return device, event

    def wait_for(self, *tensors) -> None:
        """The compute stream waits for the copies that wrote these tensors' storages (a tensor
        computed here, or a copy already awaited: no wait)."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                event = self.in_flight.pop(tensor.untyped_storage(), None)
                if event is not None:
                    self.compute_waits(event)

    def compute_waits(self, event) -> None:
        """The compute stream waits, on the device, until `event` (one copy's) has happened."""
        torch.cuda.current_stream(self.device).wait_event(event)

    def ready(self) -> None:
        """The compute stream waits for every copy issued so far."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.in_flight = WeakIdKeyDictionary()

    @torch.no_grad()
    def to_host(self, device: torch.Tensor, dtype=None) -> torch.Tensor:
        with host_side():
            host = device.to("cpu", dtype=dtype or device.dtype, copy=True)
            return host.pin_memory() if self.stream is not None else host

    @torch.no_grad()
    def to_host_async(self, tensors: list, dtype) -> tuple:
        """(host copies, their Transfer): on CUDA every copy is issued on the side stream into pinned
        memory, after the compute that produced them, and one event marks them all; the reader
        calls `Transfer.wait()` first. A blocking copy per tensor would stop the host each time."""
        if self.stream is None:
            with host_side():
                return [tensor.to("cpu", dtype=dtype, copy=True) for tensor in tensors], Transfer()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with host_side():
            hosts = [torch.empty(tensor.shape, dtype=dtype, pin_memory=True) for tensor in tensors]  # host
        with torch.cuda.stream(self.stream):
            for host, tensor in zip(hosts, tensors):
                host.copy_(tensor, non_blocking=True)
                tensor.record_stream(self.stream)  # freed by the compute stream, still read here
            event = torch.cuda.Event()
            event.record(self.stream)
        return hosts, Transfer(event)


class Transfer:
    """Copies in flight to the host; `wait()` blocks the calling thread (the host store's worker,
    not the thread driving the device) until they have landed. On CPU they already have."""

    def __init__(self, event=None):
        self.event = event

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class Stash:
    """Stage inputs x[s, u] and input gradients dx[s, u] between stages, on the device or the host.

    Device (standard L2L): L·m·b·s·h stays on the compute side at the forward/backward turn.
    Host (`constant_memory`): each micro-batch's tensor travels to the device when used, so the
    compute side holds one micro-batch's in/out buffers whatever L and m are.
    """

    def __init__(self, on_host: bool, copier: DeviceCopier, sent):
        self.on_host, self.copier, self.sent = on_host, copier, sent
        self.entries = {}

    def put(self, key, tensor: torch.Tensor) -> None:
        if self.on_host:
            tensor = self.copier.to_host(tensor)
            self.sent("stash", tensor)
        self.entries[key] = tensor

    def get(self, key, keep: bool) -> torch.Tensor:
        tensor = self.entries[key] if keep else self.entries.pop(key)
        if self.on_host:
            tensor = self.copier.to_device(tensor, cast=False)
            self.sent("stash", tensor)
        return tensor


class DropoutReplay:
    """`single`'s dropout masks, drawn in its order and replayed exactly in the recomputation.

    1. first forward of stage s: save the CPU RNG state, draw one mask per active nn.Dropout of the
       stage, over the whole per-rank batch, exactly as `single` does (empty_like.bernoulli_.div_);
    2. micro-batch u multiplies by its rows (the module is in eval for that call, so draws nothing);
    3. first backward of stage s: draw again from the saved state (global RNG untouched).
    """

    def __init__(self, stage_modules, batch_shape):
        self.modules = [[m for m in module.modules() if isinstance(m, nn.Dropout) and m.p > 0]
                        for module in stage_modules]
        self.batch_shape, self.states, self.masks = batch_shape, {}, {}

    def draw(self, stage: int, replay: bool) -> None:
        if not self.modules[stage] or not self.modules[stage][0].training:
            self.masks[stage] = []
            return
        with host_side():
            if not replay:
                self.states[stage] = torch.get_rng_state()
                self.masks[stage] = self._masks(stage)
                return
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(self.states.pop(stage))
                self.masks[stage] = self._masks(stage)

    def _masks(self, stage):
        # Drawn from the CPU generator, in single's order, so the masks equal single's.
        return [torch.empty(self.batch_shape).bernoulli_(1 - m.p).div_(1 - m.p)  # host: the CPU generator's draw
                for m in self.modules[stage]]

    def applied(self, stage: int, rows: slice, copier: DeviceCopier):
        """Context: the stage's dropouts multiply by rows `rows` of the drawn masks."""
        return _MaskedDropout(self.modules[stage], self.masks.get(stage, []), rows, copier)


class _MaskedDropout:
    def __init__(self, modules, masks, rows, copier):
        self.modules, self.masks, self.rows, self.copier, self.hooks = modules, masks, rows, copier, []

    def __enter__(self):
        for module, mask in zip(self.modules, self.masks):
            with host_side():
                rows = mask[self.rows]
            device_mask = self.copier.to_device(rows)
            self.copier.wait_for(device_mask)
            module.train(False)  # nn.Dropout in eval returns its input and draws nothing
            self.hooks.append(module.register_forward_hook(
                lambda _module, inputs, _output, mask=device_mask: inputs[0] * mask))

    def __exit__(self, *exc):
        for module, hook in zip(self.modules, self.hooks):
            hook.remove()
            module.train(True)
        self.hooks = []


# ----------------------------------------------------------------------------- host side


def step_only(optimizer: torch.optim.Optimizer, parameters) -> None:
    """`optimizer.step()` over `parameters` alone; each keeps its param group (lr, weight decay)."""
    chosen = {id(parameter) for parameter in parameters}
    saved = [group["params"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in chosen]
        optimizer.step()
    finally:
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = params


class HostStore:
    """The eager parameter server: fp32 master weights, gradients, optimizer state, a worker thread.

    Work is queued in the order the plan issues it (reduce s, update s, reduce s−1, ...) and runs on
    one background thread while the main thread drives the device; `wait()` ends the step. With a
    CPU "device" (`background=False`) the work runs in place, in the same order: host and device
    share the cores, so a second thread overlaps nothing and its torch operators contend with the
    compute's intra-op threads (measured on gpt_tiny, 8 layers, 2 cores: 0.46-0.67 s per step with
    the thread, 0.35-0.41 s in place; docs/plan.md, issue 31).
    """

    def __init__(self, optimizer, communicator, data_group, bucket_bytes: int = 0, background: bool = True):
        self.optimizer, self.communicator, self.data_group = optimizer, communicator, data_group
        self.bucket_bytes = bucket_bytes  # one all-reduce per flat bucket of gradients (0: per tensor)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="l2l-host-store") if background else None
        self.pending = []

    def submit(self, work, *arguments) -> None:
        if self.worker is None:
            with host_side():  # host work: the memory meter counts the device's (a worker is never metered)
                work(*arguments)
        else:
            self.pending.append(self.worker.submit(work, *arguments))

    @torch.no_grad()
    def accumulate(self, parameters, gradients, transfer) -> None:
        """dW copies -> each parameter's host gradient, once they have landed (a tied weight
        receives the head's part, then the embed's: the worker runs in the plan's order)."""
        transfer.wait()
        for parameter, gradient in zip(parameters, gradients):
            parameter.grad = gradient if parameter.grad is None else parameter.grad.add_(gradient)

    @torch.no_grad()
    def reduce(self, parameters) -> None:
        """Average the gradients over the data-parallel replicas: sum each flat bucket, then divide."""
        for work, flat in post_bucket_reductions(parameters, self.bucket_bytes, self.communicator, self.data_group):
            if work is not None:  # a group of one reduces nothing
                work.wait()
                flat.div_(self.data_group.size)

    def update(self, parameters) -> None:
        step_only(self.optimizer, parameters)

    def wait(self) -> None:
        pending, self.pending = self.pending, []
        for future in pending:
            future.result()  # re-raises the worker's exception here

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown(wait=True)


# ----------------------------------------------------------------------------- the relay


def stage_modules(model) -> list:
    """The relay's stages: embed, every block the model runs this step, the head (with its loss)."""
    return [model.embed, *model.running_blocks(), model.head]


def owners(modules) -> dict:
    """id(parameter) -> the stage that reduces and updates it: the *first* stage using it, because
    the backward reaches it last (a tied embedding/head weight is final only after the embed's)."""
    owner = {}
    for stage in reversed(range(len(modules))):
        for parameter in modules[stage].parameters():
            owner[id(parameter)] = stage
    return owner


class Relay:
    """One L2L step as handlers of the schedule executor (see the module docstring)."""

    def __init__(self, model, optimizer, communicator, data_group, micro_batches: int,
                 constant_memory: bool = False, prefetch: bool = True,
                 device=torch.device("cpu"), dtype=torch.float32, bucket_bytes: int = 0):
        self.model, self.micro_batches, self.communicator = model, micro_batches, communicator
        self.prefetch, self.reduces, self.plans, self.modules = prefetch, data_group.size > 1, {}, []
        self.use_stages(stage_modules(model))
        self.store = HostStore(optimizer, communicator, data_group, bucket_bytes,
                               background=torch.device(device).type != "cpu")
        self.copier = DeviceCopier(torch.device(device), dtype)
        self.stash = Stash(constant_memory, self.copier, self.sent)
        self.weights, self.transferred = {}, {}

    def use_stages(self, modules) -> None:
        """Relay `modules` from now on: the host's eager parameter server lets every step run a
        different list of layers (Pudipeddi et al. 2020; LayerDrop, a grown model; docs/strategies/l2l.md) with no
        device memory to repartition: only the plan and the per-stage parameter lists change."""
        if [id(module) for module in modules] == [id(module) for module in self.modules]:
            return
        self.modules = modules
        self.parameters = [dict(module.named_parameters()) for module in modules]
        owner = owners(modules)
        self.owned = [[p for p in params.values() if owner[id(p)] == stage]
                      for stage, params in enumerate(self.parameters)]
        if len(modules) not in self.plans:  # a plan per depth, built once
            self.plans[len(modules)] = validate_plan(relay_plan(len(modules), self.micro_batches, self.prefetch,
                                                                reduce=self.reduces))
        self.plan = self.plans[len(modules)]

    # ----- the step
    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Run the relay plan on this rank's batch; returns its loss (mean over its scored tokens).
        A block the model drops this step (LayerDrop) is no stage: neither fetched nor returned."""
        self.use_stages(stage_modules(self.model))
        self.begin(tokens, targets)
        execute(self.plan.ranks[0], self.handlers())
        return self.loss

    def begin(self, tokens, targets) -> None:
        batch, length = tokens.shape
        self.tokens, self.targets, self.rows = tokens, targets, batch // self.micro_batches
        hidden = self.model.embed.token.embedding_dim
        self.dropout = DropoutReplay(self.modules, (batch, length, hidden))
        with host_side():  # micro-batch u weighs n_u / N: the loss stays the mean over all scored tokens
            scored = (targets != IGNORE_INDEX).reshape(self.micro_batches, -1).sum(1).tolist()
        self.weights_of_loss = [count / max(1, sum(scored)) for count in scored]
        self.loss = torch.zeros((), device=self.copier.device)

    def handlers(self) -> dict:
        return {WEIGHTS_FORWARD: self.load, WEIGHTS_BACKWARD: self.load, FORWARD: self.forward,
                BACKWARD: self.backward, RELEASE_FORWARD: self.release, RELEASE_BACKWARD: self.release,
                GRADIENT_TO_HOST: self.gradient_to_host, REDUCE_GRADIENT: self.reduce,
                UPDATE_ON_HOST: self.update, FINISH: self.finish}

    # ----- weights
    def load(self, action) -> None:
        """Copy the stage's weights to the device; the backward's copies are autograd leaves."""
        phase = FORWARD if action.kind == WEIGHTS_FORWARD else BACKWARD
        weights = {name: self.copier.to_device(host) for name, host in self.parameters[action.stage].items()}
        for weight in weights.values():
            self.sent("weights", weight)
            weight.requires_grad_(phase == BACKWARD)
        self.weights[action.stage, phase] = weights

    def release(self, action) -> None:
        phase = FORWARD if action.kind == RELEASE_FORWARD else BACKWARD
        del self.weights[action.stage, phase]

    # ----- compute
    def forward(self, action) -> None:
        """y = f_s(x[s, u]) without a graph; the output is the next stage's stashed input."""
        stage, micro_batch = action.stage, action.micro_batch
        if micro_batch == 0:
            self.dropout.draw(stage, replay=False)
        with torch.no_grad():
            output = self.run(stage, micro_batch, FORWARD, self.input(stage, micro_batch, keep=True))
            if stage == len(self.modules) - 1:
                self.loss = self.loss + self.scored_loss(output, micro_batch)
            else:
                self.stash.put(("x", stage + 1, micro_batch), output)

    def backward(self, action) -> None:
        """Recompute f_s(x[s, u]) with autograd, backpropagate dy, stash dx, accumulate dW."""
        stage, micro_batch = action.stage, action.micro_batch
        if micro_batch == 0:
            self.dropout.draw(stage, replay=True)
            self.zero_gradients(stage)
        inputs = self.input(stage, micro_batch, keep=False)
        if stage > 0:
            inputs = inputs.detach().requires_grad_(True)
        self.model.set_loss_scale(self.weights_of_loss[micro_batch])  # its share of the loss (MoE aux loss)
        with torch.enable_grad():
            output = self.run(stage, micro_batch, BACKWARD, inputs)
            if stage == len(self.modules) - 1:
                self.scored_loss(output, micro_batch).backward()
            else:
                gradient = self.stash.get(("dx", stage + 1, micro_batch), keep=False)
                self.copier.wait_for(gradient)
                output.backward(gradient)
        if stage > 0:
            self.stash.put(("dx", stage, micro_batch), inputs.grad)

    def zero_gradients(self, stage) -> None:
        # A zeroed buffer that autograd accumulates each micro-batch's dW into, in place: the device
        # holds the same bytes for m = 1 as for any m (0 + g == g exactly). Allocated at the stage's
        # first backward, not at its prefetch, so only one stage's gradient exists at a time.
        for weight in self.weights[stage, BACKWARD].values():
            weight.grad = torch.zeros_like(weight)

    def run(self, stage, micro_batch, phase, inputs):
        self.copier.wait_for(*self.weights[stage, phase].values(), inputs)  # not the prefetch in flight
        rows = slice(micro_batch * self.rows, (micro_batch + 1) * self.rows)
        with self.dropout.applied(stage, rows, self.copier):
            return functional_call(self.modules[stage], self.weights[stage, phase], (inputs,))

    def input(self, stage, micro_batch, keep: bool):
        if stage > 0:
            return self.stash.get(("x", stage, micro_batch), keep)
        return self.micro_batch_of(self.tokens, micro_batch)

    def micro_batch_of(self, tensor, micro_batch):
        with host_side():
            rows = tensor[micro_batch * self.rows:(micro_batch + 1) * self.rows]
        return self.copier.to_device(rows)

    def scored_loss(self, logits, micro_batch):
        weight = self.weights_of_loss[micro_batch]
        if weight == 0:  # no scored token in this micro-batch (BERT): contributes nothing
            return logits.sum() * 0.0
        targets = self.micro_batch_of(self.targets, micro_batch)
        self.copier.wait_for(targets)
        return self.model.loss(logits, targets) * weight

    # ----- host store
    def gradient_to_host(self, action) -> None:
        """dW -> host fp32, one transfer for the stage; the host store accumulates it when it lands."""
        device_weights = self.weights[action.stage, BACKWARD]
        names = [name for name in self.parameters[action.stage] if device_weights[name].grad is not None]
        gradients = [device_weights[name].grad for name in names]
        for gradient in gradients:
            self.sent("gradients", gradient)
        copies, transfer = self.copier.to_host_async(gradients, torch.float32)
        self.store.submit(self.store.accumulate, [self.parameters[action.stage][name] for name in names],
                          copies, transfer)

    def reduce(self, action) -> None:
        self.store.submit(self.store.reduce, self.owned[action.stage])

    def update(self, action) -> None:
        self.store.submit(self.store.update, self.owned[action.stage])

    def finish(self) -> None:
        self.store.wait()
        assert not self.stash.entries and not self.weights, "the relay left tensors behind"
        for group, volume in self.transferred.items():  # counted here: the worker counts reductions
            self.communicator.count("host_device", group, volume, 1, 1)
        self.transferred = {}

    def sent(self, group: str, tensor: torch.Tensor) -> None:
        """Count one host<->device copy (weights, gradients, stash) in the tensor's dtype."""
        self.transferred[group] = self.transferred.get(group, 0) + tensor.numel() * tensor.element_size()

    def close(self) -> None:
        self.store.close()


# ----------------------------------------------------------------------------- the strategy


class L2LOffloadStrategy(OwnedStepStrategy):
    """Lightning adapter: the model stays on the host (it is the store), a step runs the relay.

    1. `setup`: the task's optimizer over the fp32 master weights is the host optimizer;
    2. `training_step` -> `run_step`: the relay plan, eager updates included;
    3. `optimizer_step`: the closure only — every stage was already updated, once, by the store.
    """

    strategy_name = "l2l"

    def __init__(self, degrees: Layout, micro_batches: int, constant_memory: bool = False,
                 prefetch: bool = True, compute_dtype: torch.dtype = torch.float32, bucket_mb: float = 25.0,
                 **kwargs):
        super().__init__(degrees, **kwargs)
        self.micro_batches, self.constant_memory, self.prefetch = micro_batches, constant_memory, prefetch
        self.compute_dtype = compute_dtype
        self.bucket_mb = bucket_mb  # the host store's all-reduce buckets (strategies/buckets.py)
        self.relay = None

    @override
    def layout_arguments(self) -> dict:
        return {"host_axes": ("data",)}  # the store's reductions run on the host, over gloo

    @override
    def materialise_model(self, model) -> None:
        model.materialise(torch.device("cpu"))  # the model is the host store: its fp32 masters live there

    @override
    def model_to_device(self) -> None:
        pass  # the model is the host store; layers travel to the device one at a time

    @override
    def batch_to_device(self, batch, device=None, dataloader_idx: int = 0):
        return batch  # micro-batches travel with the relay

    @override
    def setup(self, trainer) -> None:
        super().setup(trainer)
        model = self.lightning_module.model
        self.synchronise_replicas(model, "host_data")  # the host store: broadcast over gloo
        if self.root_device.type == "cuda":
            for parameter in model.parameters():
                parameter.data = parameter.data.pin_memory()
        if self.relay is None and self.optimizers:
            self.relay = Relay(model, self.optimizers[0], self.layout.communicator, self.layout.group("host_data"),
                               self.micro_batches, self.constant_memory, self.prefetch, self.root_device,
                               self.compute_dtype, bucket_bytes(self.bucket_mb))

    def run_step(self, batch) -> torch.Tensor:
        return self.relay.step(batch["tokens"], batch["targets"])

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        return closure()  # the host store already stepped every stage (eagerly, in the relay)

    @override
    def load_optimizer_state_dict(self, checkpoint) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)  # optimizer state stays in host memory

    @override
    def compute_resident_tensors(self) -> list:
        return []  # between steps nothing lives on the compute side

    @override
    def teardown(self) -> None:
        if self.relay is not None:
            self.relay.close()
            self.relay = None
        super().teardown()


# ----------------------------------------------------------------------------- registry interface


def relay_peak_bytes(model, optimizer, tokens, targets, micro_batches: int, constant_memory: bool,
                     warm_up: bool = True) -> int:
    """Compute-side peak of one relay step, by default measured after a first step has created the
    optimizer state (the host store is never counted): what the memory tests and benchmark report."""
    from parallel.comm import Communicator, Group
    from parallel.memory import ComputeMemoryMeter

    relay = Relay(model, optimizer, Communicator(), Group("data", (0,)), micro_batches,
                  constant_memory=constant_memory)
    if warm_up:
        relay.step(tokens, targets)
    meter = ComputeMemoryMeter()
    with meter:
        relay.step(tokens, targets)
    relay.close()
    return meter.peak_bytes


def degrees(cfg, world_size: int) -> Layout:
    return Layout(data=world_size)


def check(cfg, world_size: int) -> list:
    errors, strategy = [], cfg.strategy
    if cfg.data.global_batch_size % world_size:
        errors.append(f"data.global_batch_size={cfg.data.global_batch_size} does not split over "
                      f"{world_size} data-parallel ranks. Fix: a multiple of {world_size}.")
    elif (cfg.data.global_batch_size // world_size) % strategy.micro_batches:
        per_rank = cfg.data.global_batch_size // world_size
        errors.append(f"strategy.micro_batches={strategy.micro_batches} must divide the per-rank batch "
                      f"{per_rank} (data.global_batch_size / {world_size} ranks). Fix: strategy.micro_batches="
                      f"one of {divisors(per_rank)}.")
    if strategy.tensor_parallel != "none":
        errors.append(f"strategy.tensor_parallel={strategy.tensor_parallel}: L2L relays whole layers through one "
                      f"device per data replica (its point is one device holding one layer at a time), so it "
                      f"does not split layers over a tensor grid. Fix: strategy.tensor_parallel=none, or "
                      f"strategy=modular_pipeline strategy.tensor_parallel={strategy.tensor_parallel}.")
    return errors


def build(cfg, world_size: int) -> L2LOffloadStrategy:
    return L2LOffloadStrategy(degrees(cfg, world_size), cfg.strategy.micro_batches,
                              constant_memory=cfg.strategy.constant_memory, prefetch=cfg.strategy.prefetch,
                              compute_dtype=compute_dtype(cfg.hardware.precision), bucket_mb=cfg.strategy.bucket_mb,
                              process_group_backend=cfg.hardware.process_group_backend)


L2L = StrategyEntry(check=check, degrees=degrees, build=build, scales_fp16_loss=False, planned_as="relay",
                    eager_blocks=compiles)
