"""The thin Lightning adapter every technique's strategy stands on (docs/architecture.md, "The contract between the run and a strategy").

`LayerwiseStrategy` is a DDPStrategy without the DDP wrapper: the technique places and
synchronises the model itself. It builds the ParallelLayout once, reports the data-parallel rank
to the data module, and checkpoints per rank. `OwnedStepStrategy` adds the DeepSpeed/NeMo pattern
for techniques whose schedule runs forward *and* backward: `training_step` runs the schedule,
`backward` does nothing, `optimizer_step` calls the closure and then steps.
"""

from datetime import timedelta
from typing import Optional

import torch
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from parallel.comm import Group
from parallel.dims import Layout
from parallel.layout import ParallelLayout
from strategies.checkpoint.per_rank import PerRankCheckpoints
from strategies.expert_parallel import expert_parameter_ids
from strategies.hooks import RunHooks
from strategies.precision import AgreedGradScaler
from strategies.checkpoint.portable import PortableCheckpoints


class LayerwiseStrategy(RunHooks, PortableCheckpoints, PerRankCheckpoints, DDPStrategy):
    """Process group from Lightning, everything else ours.

    1. `setup_environment`: process group, then the layout (groups built once, in one order);
    2. `configure_ddp`: no wrapper; the subclass synchronises gradients itself;
    3. the data module asks `distributed_sampler_kwargs` for the data-parallel rank and degree;
    4. checkpoints: one file per rank (strategies/checkpoint/per_rank.py), and the portable one beside it
       (strategies/checkpoint/portable.py).
    """

    def __init__(self, degrees: Layout, process_group_backend: str = "gloo",
                 timeout_seconds: Optional[float] = None, **kwargs):
        # The run sets the timeout of every process group with `set_collective_timeout`
        # (layerwise/run/fit.py, from layerwise/run/timeouts.py `TimeoutChain`); None: Lightning's default
        # (30 min) until then. The layout's subgroups get the world's (setup_environment).
        if timeout_seconds is not None:
            kwargs["timeout"] = timedelta(seconds=timeout_seconds)
        super().__init__(process_group_backend=process_group_backend, **kwargs)
        self.degrees = degrees
        self.layout = None

    @override
    def _configure_launcher(self) -> None:
        # One rank: no launcher, so nothing writes LOCAL_RANK into the caller's environment.
        if self.degrees.world_size > 1:
            return super()._configure_launcher()
        self._launcher = None

    @override
    def setup_distributed(self) -> None:
        if self.degrees.world_size > 1:
            return super().setup_distributed()
        self.set_world_ranks()  # one rank needs no process group (and leaks none into the caller)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.layout is None:  # runs again for validate/test in one process: build once
            if self.world_size != self.degrees.world_size:
                raise ValueError(f"the strategy's degrees {self.degrees.as_dict()} need "
                                 f"{self.degrees.world_size} ranks, the job has {self.world_size}")
            self.layout = ParallelLayout(self.degrees, rank=self.global_rank, timeout=self._timeout,
                                         **self.layout_arguments())
            self.agree_on_fp16_skips()

    @override
    def teardown(self) -> None:
        # Lightning's teardown moves the module to the CPU. A setup that raised before the model left
        # the meta device (models/__init__.py builds it there) would then raise "Cannot copy out of
        # meta tensor" inside the handler of the setup's own error, and that became the rank's last line.
        module = self.lightning_module
        if module is not None and any(parameter.is_meta for parameter in module.parameters()):
            self._lightning_module = None  # nothing of it is on a device: nothing to move
        super().teardown()

    def agree_on_fp16_skips(self) -> None:
        """Under 16-mixed, Lightning's GradScaler becomes one whose skips every rank shares
        (strategies/precision.py, AgreedGradScaler): before a checkpoint restores its state."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None and not isinstance(scaler, AgreedGradScaler):
            world = Group("world", tuple(range(self.world_size)),
                          torch.distributed.group.WORLD if self.world_size > 1 else None)
            self.precision_plugin.scaler = AgreedGradScaler(self.layout.communicator, world, scaler._device)

    def layout_arguments(self) -> dict:
        """Extra ParallelLayout arguments of a subclass (e.g. a tensor grid); default none."""
        return {}

    @override
    def configure_ddp(self) -> None:
        pass  # no DistributedDataParallel: gradients are reduced by the technique's own code

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.degrees.data, "rank": self.layout.index("data")}

    def synchronise_replicas(self, module: torch.nn.Module, group_name: str = "data") -> None:
        """Make data-parallel replicas bit-identical (DDP would broadcast; we build from the seed,
        and this broadcast guards against any rank-dependent initialisation). The module must be
        where `group_name`'s backend can reach it: on the device for "data" (NCCL). Split experts
        (strategy.expert_parallel) are copies only over `expert_data`: broadcast there."""
        group = self.layout.group(group_name)
        experts = expert_parameter_ids(module) if self.layout.degrees.expert > 1 else set()
        for tensor in list(module.parameters()) + list(module.buffers()):
            over = self.layout.group("expert_data") if id(tensor) in experts else group
            self.layout.communicator.broadcast(tensor.data, over.ranks[0], over)
        self.layout.communicator.reset()  # set-up traffic is not a training step's


class OwnedStepStrategy(LayerwiseStrategy):
    """For techniques whose schedule runs the whole step, backward included.

    1. `training_step` zeroes gradients, runs `run_step(batch)` under the precision plugin's
       autocast context (hardware.precision) and returns its detached loss;
    2. `backward` is a no-op (the schedule already ran every backward, through `scale_loss`);
    3. `optimizer_step` hands the precision plugin a closure that runs `training_step`, then
       `before_optimizer_step` (reductions, preconditioning); the plugin unscales (fp16) and steps.
    """

    owns_step = True  # LanguageModelTask.optimizer_zero_grad defers to us (see there)

    def run_step(self, batch) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement run_step(batch)")

    def before_optimizer_step(self, optimizer) -> None:
        """Hook between the schedule and the optimizer; default: nothing."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """What the schedule calls backward on: the loss, times the fp16 loss scale under 16-mixed."""
        return self.precision_plugin.pre_backward(loss, self.lightning_module)

    @override
    def training_step(self, *args, **kwargs):
        batch = args[0]
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        with self.precision_plugin.train_step_context():  # autocast under bf16-mixed / 16-mixed
            loss = self.run_step(batch).detach()
        return self.loss_ready(loss)

    @override
    def backward(self, closure_loss, optimizer, *args, **kwargs):
        return closure_loss  # the schedule ran every backward inside training_step

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        def closure_then_reductions():
            result = closure()
            self.before_optimizer_step(optimizer)
            return result
        # Lightning's precision plugin runs the closure, unscales fp16 gradients (after our
        # reductions: they are linear, so the order does not matter) and steps, or skips on inf.
        return self.precision_plugin.optimizer_step(optimizer, model=model or self.lightning_module,
                                                    closure=closure_then_reductions, **kwargs)
