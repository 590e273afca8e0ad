"""What `hardware.precision` (Lightning's names) means for the tensors a strategy creates itself.

Lightning's precision plugin runs autocast around the step and keeps fp32 master weights under
"-mixed"; these two tables say what the strategies' own buffers hold under each name.
"""

import torch

from parallel.flight import synchronizing

# Matrix products (and L2L's device copies of the weights) run in this dtype.
COMPUTE_DTYPES = {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16,
                  "16-mixed": torch.float16, "16-true": torch.float16,
                  "fp8-mixed": torch.bfloat16}  # bf16-mixed plus FP8 linears (strategies/float8.py)


def compute_dtype(precision: str) -> torch.dtype:
    return COMPUTE_DTYPES.get(precision, torch.float32)


def activation_dtype(precision: str) -> torch.dtype:
    """The residual stream between blocks, what pipeline stages exchange: under "-mixed" autocast
    runs norms and additions in fp32, so it stays fp32; under "-true" the whole model is narrow."""
    return compute_dtype(precision) if precision.endswith("-true") else torch.float32


def message_dtype(precision: str, message: str) -> torch.dtype:
    """What crosses a pipeline stage boundary (`strategy.message_dtype`): "compute" sends the compute
    dtype (bf16/fp16 under "-mixed", as Megatron-LM sends its pipeline tensors in the params dtype),
    "fp32" the residual stream as it is. Under 32-true and "-true" both are the stream's own dtype.
    Under 16-mixed the gradient message is the loss-scaled gradient: one that overflows fp16 arrives
    as inf, reaches the receiving stage's gradients, and AgreedGradScaler skips the step everywhere
    (the receiving stage's fp16 products would overflow on it in any case)."""
    return _chosen(precision, "message_dtype", message, "compute", activation_dtype(precision))


MESSAGE_DTYPES = ("compute", "fp32")


def reduction_dtype(precision: str, reduction: str) -> torch.dtype:
    """What the data-parallel gradient reduction moves (strategy.reduction_dtype): `compute` = the
    compute dtype (bf16/fp16 under mixed precision: the fp32 gradients cast, reduced, cast back before
    the division, as Megatron-LM's fp16 runs reduce their gradients), `fp32` = the master gradients
    as they are (Megatron-LM under --bf16, whose accumulate_allreduce_grads_in_fp32 it forces on)."""
    return _chosen(precision, "reduction_dtype", reduction, "fp32", torch.float32)


def _chosen(precision: str, field: str, choice: str, default: str, wide: torch.dtype) -> torch.dtype:
    """`strategy.<field>`: "compute" = the precision's compute dtype, "fp32" = `wide`."""
    if choice not in MESSAGE_DTYPES:
        raise ValueError(f"strategy.{field}={choice}: need one of {', '.join(MESSAGE_DTYPES)}. "
                         f"Fix: strategy.{field}={default}.")
    return compute_dtype(precision) if choice == "compute" else wide


class AgreedGradScaler(torch.amp.GradScaler):
    """fp16 loss scaling (Micikevicius et al. 2018, §3.2) whose skip decision every rank shares.

    GradScaler skips a step whose gradients hold an inf and halves its scale; each rank sees only
    its own gradients (a ZeRO shard, a pipeline stage, a tensor shard), so left alone one rank
    skips while the others step, and their scales part. Here, after unscaling:
    1. a rank whose loss was never scaled (a pipeline's earlier stages: only the last stage holds
       the loss, the backward brings them scaled gradients) starts its scale as the others did;
    2. found_inf is all-reduced (MAX) over `group` (the world): one inf anywhere skips everywhere,
       so every rank's scale follows the same sequence.
    """

    def __init__(self, communicator, group, device: str):
        super().__init__(device=device)
        self.communicator, self.group = communicator, group

    def unscale_(self, optimizer) -> None:
        if self._enabled and self._scale is None:  # never called scale(): a stage without the loss
            self._lazy_init_scale_growth_tracker(first_parameter_device(optimizer))
        super().unscale_(optimizer)
        if not self._enabled:
            return
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        if not found:  # no gradient on this rank: it still takes part, and must record a check
            found[self._scale.device] = torch.zeros(1, device=self._scale.device)
        agreed = torch.stack([value.reshape(()).to(self._scale.device) for value in found.values()]).amax()
        self.communicator.all_reduce(agreed, self.group, op=torch.distributed.ReduceOp.MAX)
        for value in found.values():
            value.copy_(agreed.to(value.device))

    def step(self, optimizer, *arguments, **keywords):
        """GradScaler's step reads found_inf with `.item()`: on NCCL the host blocks there for the
        all-reduce above, so it is the rank's current wait for the watchdog (parallel/flight.py)."""
        with synchronizing(self.communicator.recorder):
            return super().step(optimizer, *arguments, **keywords)


def first_parameter_device(optimizer) -> torch.device:
    return next(p.device for group in optimizer.param_groups for p in group["params"])
