"""The two strategies without a schedule: `single` (the reference) and `ddp` (data parallel).

`single` runs the whole model on the whole global batch in one process; every other strategy is
proven equal to it. `ddp` is Lightning's DDPStrategy with one change: its gradient all-reduce is
routed through the layout's communicator (a DDP communication hook), so metrics.csv shows DDP's
volume, 2(n-1)/n·P·bytes per step, counted where every other strategy's traffic is counted.
"""

from datetime import timedelta

import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from typing_extensions import override

from parallel.dims import Layout
from parallel.layout import ParallelLayout
from strategies.hooks import RunHooks
from strategies.checkpoint.portable import PortableCheckpoints
from strategies.context_layout import ContextParallelHooks, context_errors, context_of, eager_unless_context
from strategies.recompute import apply_activation_recompute, recompute_errors
from strategies.compile import compiles
from strategies.registry import StrategyEntry


class WholeModelHooks(RunHooks):
    """The whole model on the device, its blocks recomputed in the backward under `full`."""

    activation_recompute = "none"

    @override
    def materialise_model(self, model) -> None:
        super().materialise_model(model)  # DDP wraps the model later: the blocks are patched first
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


class CountedDDPStrategy(ContextParallelHooks, WholeModelHooks, PortableCheckpoints, DDPStrategy):
    """Data parallel: replicas on every rank, slices of the global batch, averaged gradients.

    1. every rank builds the same weights from the seed (DDP also broadcasts rank 0's);
    2. each rank takes its contiguous slice of the global batch (by its data index);
    3. backward all-reduces gradient buckets (through our counter) and divides by n;
    4. every rank applies the same optimizer step.
    With `context_degree` c > 1 (strategy.context_parallel) the world is d = n/c replicas × c context
    shards: the c ranks of a replica read the same rows and each keeps its head and tail chunks
    (`context_batch`), their attention exchanges keys and values (strategies/context_parallel.py), and
    step 3 averages over the d·c ranks of the data_context group (strategies/context_layout.py).
    """

    strategy_name = "ddp"

    def __init__(self, timeout_seconds: float = 300.0, activation_recompute: str = "none",
                 context_degree: int = 1, context_comm: str = "ring", **kwargs):
        super().__init__(timeout=timedelta(seconds=timeout_seconds), **kwargs)
        self.activation_recompute = activation_recompute
        self.context_degree, self.context_comm = context_degree, context_comm

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # creates the process group
        if self.layout is None:  # setup_environment runs again for validate/test: stay idempotent
            degrees = Layout(data=self.world_size // self.context_degree, context=self.context_degree)
            self.layout = ParallelLayout(degrees, rank=self.global_rank)

    @override
    def materialise_model(self, model) -> None:
        super().materialise_model(model)
        self.install_context_parallel(model)

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()
        # Lightning registers comm hooks only on CUDA; on every device we want the counted hook.
        self.model.register_comm_hook(self.layout, _counted_all_reduce_hook)


# ----- the registry interface (see strategies/__init__.py)

def degrees(cfg, world_size: int) -> Layout:
    return Layout(data=world_size)


def check(cfg, world_size: int) -> list:
    """Only strategy.activation_recompute can be wrong (bucket_mb is DDP's bucket_cap_mb)."""
    return recompute_errors(cfg.strategy)


def degrees_ddp(cfg, world_size: int) -> Layout:
    """d = world / c replicas × c context shards of each sequence (strategy.context_parallel)."""
    context = context_of(cfg.strategy)[0]
    return Layout(data=max(1, world_size // max(1, context)), context=max(1, context))


def check_ddp(cfg, world_size: int) -> list:
    """strategy.activation_recompute's, and strategy.context_parallel's (context_layout.context_errors)."""
    return check(cfg, world_size) + context_errors(cfg, world_size, other_ranks=1)


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
                              bucket_cap_mb=cfg.strategy.bucket_mb,
                              # a LayerDrop step leaves the dropped blocks without gradients
                              find_unused_parameters=cfg.strategy.layer_drop > 0)


SINGLE = StrategyEntry(check=check, degrees=degrees, build=build_single, one_process=True,
                       clips_gradients=True, planned_as="whole_model", eager_blocks=compiles)
DDP = StrategyEntry(check=check_ddp, degrees=degrees_ddp, build=build_ddp, clips_gradients=True,
                    planned_as="whole_model", eager_blocks=eager_unless_context(compiles))
