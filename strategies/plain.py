"""The two strategies without a schedule: `single` (the reference) and `ddp` (data parallel).

`single` runs the whole model on the whole global batch in one process; every other strategy is
proven equal to it. `ddp` is Lightning's DDPStrategy with one change: its gradient all-reduce is
routed through the layout's communicator (a DDP communication hook), so metrics.csv shows DDP's
volume, 2(n-1)/n·P·bytes per step, counted where every other strategy's traffic is counted.
With `strategy.expert_parallel=e` (strategies/expert_parallel.py) each MoE block's experts are split
over e data ranks: DDP reduces every other parameter over `data` and ignores the experts, whose
gradients are summed over `expert_data` and divided by d after the backward (`optimizer_step`).
"""

from datetime import timedelta

import torch
from torch.nn.parallel import DistributedDataParallel
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from typing_extensions import override

from parallel.dims import Layout
from parallel.layout import ParallelLayout
from strategies.hooks import RunHooks
from strategies.checkpoint.portable import PortableCheckpoints, is_portable, portable_path
from strategies.expert_parallel import (ExpertParallelHooks, apply_expert_parallel, expert_errors, expert_parallel_of,
                                        expert_parameters, install_dispatchers, sum_expert_gradients)
from strategies.context_layout import ContextParallelHooks, context_errors, context_of, eager_unless_context
from strategies.recompute import apply_activation_recompute, recompute_errors
from strategies.compile import compiles
from strategies.registry import StrategyEntry


class WholeModelHooks(RunHooks):
    """The whole model on the device, its blocks recomputed in the backward under `full`."""

    activation_recompute = "none"

    @override
    def materialise_model(self, model) -> None:
        apply_expert_parallel(model, self.layout)  # on meta: only this rank's experts get built
        super().materialise_model(model)  # DDP wraps the model later: the blocks are patched first
        install_dispatchers(model, self.layout)
        apply_activation_recompute(model, self.activation_recompute)

    @override
    def training_step(self, *args, **kwargs):  # Lightning's, returned through the run's hook
        return self.loss_ready(super().training_step(*args, **kwargs))


class SingleStrategy(WholeModelHooks, PortableCheckpoints, SingleDeviceStrategy):
    """One process, one device: forward and backward over the whole global batch, then step."""

    strategy_name = "single"

    def __init__(self, device: str = "cpu", activation_recompute: str = "none"):
        super().__init__(device=torch.device(device))
        self.layout = ParallelLayout(Layout(), rank=0)
        self.activation_recompute = activation_recompute


def _counted_all_reduce_hook(layout: ParallelLayout, bucket):
    """DDP communication hook: average a gradient bucket over the data_context group (the data
    replicas × a sequence's context shards, which hold the same parameters; the data group itself
    without context parallelism), counted."""
    group = layout.group("data_context")
    tensor = bucket.buffer().div_(group.size)
    work = layout.communicator.all_reduce(tensor, group, async_op=True)
    if work is None:  # one replica: nothing to reduce, but DDP still waits on a future
        done = torch.futures.Future()
        done.set_result(tensor)
        return done
    return work.get_future().then(lambda future: future.value()[0])


class CountedDDPStrategy(ContextParallelHooks, WholeModelHooks, ExpertParallelHooks, PortableCheckpoints, DDPStrategy):
    """Data parallel: replicas on every rank, slices of the global batch, averaged gradients.

    1. every rank builds the same weights from the seed (DDP also broadcasts rank 0's);
    2. each rank takes its contiguous slice of the global batch (by its data index);
    3. backward all-reduces gradient buckets (through our counter) and divides by n;
    4. every rank applies the same optimizer step.
    With `expert_parallel` e > 1 a rank builds only its experts (strategies/expert_parallel.py), which
    DDP ignores; their gradients are summed over `expert_data` and divided by d after the backward.
    With `context_degree` c > 1 (strategy.context_parallel) the world is d = n/c replicas × c context
    shards: the c ranks of a replica read the same rows and each keeps its head and tail chunks
    (`context_batch`), their attention exchanges keys and values (strategies/context_parallel.py), and
    step 3 averages over the d·c ranks of the data_context group (strategies/context_layout.py).
    """

    strategy_name = "ddp"

    def __init__(self, timeout_seconds: float = 300.0, activation_recompute: str = "none",
                 context_degree: int = 1, context_comm: str = "ring", expert_parallel: int = 1, **kwargs):
        super().__init__(timeout=timedelta(seconds=timeout_seconds), **kwargs)
        self.activation_recompute = activation_recompute
        self.expert_parallel = expert_parallel
        self.context_degree, self.context_comm = context_degree, context_comm

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # creates the process group
        if self.layout is None:  # setup_environment runs again for validate/test: stay idempotent
            degrees = Layout(data=self.world_size // self.context_degree, context=self.context_degree,
                             expert=self.expert_parallel)
            self.layout = ParallelLayout(degrees, rank=self.global_rank)

    @override
    def materialise_model(self, model) -> None:
        super().materialise_model(model)
        self.install_context_parallel(model)

    @override
    def configure_ddp(self) -> None:
        if self.expert_parallel > 1:  # split experts are no replicas: DDP leaves them to optimizer_step
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                self.model, [f"model.{name}" for name in expert_parameters(self.lightning_module.model)])
        super().configure_ddp()
        # Lightning registers comm hooks only on CUDA; on every device we want the counted hook.
        self.model.register_comm_hook(self.layout, _counted_all_reduce_hook)

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        if self.expert_parallel == 1:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        experts = [parameter for parameter, _ in expert_parameters(self.lightning_module.model).values()]

        def closure_then_experts():
            result = closure()  # forward and backward: DDP has reduced everything else
            sum_expert_gradients(experts, self.layout, self.layout.degrees.data)
            return result
        return super().optimizer_step(optimizer, closure_then_experts, model, **kwargs)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # a portable checkpoint loads into the experts this rank materialised: after setup
        return True if self.expert_parallel > 1 else super().restore_checkpoint_after_setup

    @override
    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        beside = portable_path(checkpoint_path)
        if self.expert_parallel > 1 and not is_portable(checkpoint_path) and is_portable(beside):
            checkpoint_path = beside  # rank 0's file holds its own experts' optimizer state only
        return super().load_checkpoint(checkpoint_path, weights_only)


# ----- the registry interface (see strategies/__init__.py)

def degrees(cfg, world_size: int) -> Layout:
    return Layout(data=world_size)


def check(cfg, world_size: int) -> list:
    """Only strategy.activation_recompute can be wrong (bucket_mb is DDP's bucket_cap_mb)."""
    return recompute_errors(cfg.strategy)


def degrees_ddp(cfg, world_size: int) -> Layout:
    """d = world / c replicas × c context shards of each sequence (strategy.context_parallel)."""
    context = context_of(cfg.strategy)[0]
    data = max(1, world_size // max(1, context))
    expert = expert_parallel_of(cfg.strategy)
    return Layout(data=data, context=max(1, context), expert=expert if data % expert == 0 else 1)


def check_ddp(cfg, world_size: int) -> list:
    """strategy.activation_recompute's, and strategy.context_parallel's (context_layout.context_errors)."""
    errors = check(cfg, world_size) + context_errors(cfg, world_size, other_ranks=1)
    refused = {}
    if cfg.strategy.layer_drop > 0:
        refused["with strategy.layer_drop > 0: a dropped block's experts get no gradient on some steps, which "
                "DDP's find_unused_parameters handles for its own parameters only (not built for the experts it "
                "ignores)"] = "strategy.layer_drop=0"
    if cfg.trainer.gradient_clip_val:
        refused[f"with trainer.gradient_clip_val={cfg.trainer.gradient_clip_val}: Lightning clips by the norm of "
                f"this rank's gradients, which hold only its E/e experts, so each rank would scale by another "
                f"factor and the replicas drift apart (a norm summed over the expert group is not built)"] = \
            "trainer.gradient_clip_val=0, or strategy.expert_parallel=1"
    context = max(1, context_of(cfg.strategy)[0])
    return errors + expert_errors(cfg, max(1, world_size // context), refused)


def one_process_device(accelerator: str) -> str:
    """The device of a one-process strategy: Lightning's CUDA accelerator calls
    torch.cuda.set_device(root_device), which refuses "cuda" without an index; the process sees
    its GPUs from 0 (CUDA_VISIBLE_DEVICES renumbers them)."""
    return "cuda:0" if accelerator == "gpu" else "cpu"


def build_single(cfg, world_size: int) -> SingleStrategy:
    return SingleStrategy(one_process_device(cfg.hardware.accelerator),
                          activation_recompute=cfg.strategy.activation_recompute)


def build_ddp(cfg, world_size: int) -> "CountedDDPStrategy":
    context, exchange = context_of(cfg.strategy)
    return CountedDDPStrategy(process_group_backend=cfg.hardware.process_group_backend,
                              activation_recompute=cfg.strategy.activation_recompute,
                              context_degree=context, context_comm=exchange,
                              expert_parallel=expert_parallel_of(cfg.strategy),
                              bucket_cap_mb=cfg.strategy.bucket_mb,
                              # a LayerDrop step leaves the dropped blocks without gradients
                              find_unused_parameters=cfg.strategy.layer_drop > 0)


SINGLE = StrategyEntry(check=check, degrees=degrees, build=build_single, one_process=True,
                       clips_gradients=True, planned_as="whole_model", eager_blocks=compiles)
DDP = StrategyEntry(check=check_ddp, degrees=degrees_ddp, build=build_ddp, clips_gradients=True,
                    planned_as="whole_model", eager_blocks=eager_unless_context(compiles))
