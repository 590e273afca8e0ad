"""Gradient reductions in flat buckets (`strategy.bucket_mb`): one collective per bucket, not per tensor.

Consecutive parameters are grouped into buckets of at most `bucket_mb` MiB of gradient (a larger
tensor is a bucket alone; `bucket_mb=0` keeps one bucket per tensor, the comparator). A bucket's
gradients are copied once into one flat buffer and each `.grad` becomes a view of it (DDP's
gradient_as_bucket_view), so one all-reduce sums them all in place and one division averages
them. The logical bytes are those of the tensors one by one: the same elements cross the same
ring. Each element is summed from the same addends as per tensor (bit-identical on two replicas).
"""

import torch

MEBIBYTE = 2 ** 20


def bucket_bytes(bucket_mb: float) -> int:
    """`strategy.bucket_mb` in bytes (0: one bucket per tensor)."""
    return int(bucket_mb * MEBIBYTE)


def parameter_buckets(parameters: list, capacity_bytes: int) -> list:
    """Consecutive parameters in lists of at most `capacity_bytes` of gradient, one dtype and device each."""
    buckets, size = [], 0
    for parameter in parameters:
        nbytes = parameter.numel() * parameter.element_size()
        last = buckets[-1][-1] if buckets else None
        joins = last is not None and (last.dtype, last.device) == (parameter.dtype, parameter.device)
        if not joins or size + nbytes > capacity_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(parameter)
        size += nbytes
    return buckets


def flat_gradient(parameters: list) -> torch.Tensor:
    """One buffer holding the bucket's gradients (zeros where a parameter has none: every replica
    joins every all-reduce); each `.grad` becomes a view of it. One parameter: its own gradient."""
    for parameter in parameters:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter, device=parameter.device)
    if len(parameters) == 1:
        return parameters[0].grad
    flat = torch.cat([parameter.grad.reshape(-1) for parameter in parameters])
    offset = 0
    for parameter in parameters:
        parameter.grad = flat[offset:offset + parameter.numel()].view_as(parameter)
        offset += parameter.numel()
    return flat


def post_bucket_reductions(parameters: list, capacity_bytes: int, communicator, group) -> list:
    """Post one asynchronous all-reduce (sum) per bucket; returns (work, flat gradient) pairs."""
    reductions = []
    for bucket in parameter_buckets(parameters, capacity_bytes):
        flat = flat_gradient(bucket)
        reductions.append((communicator.all_reduce(flat, group, async_op=True), flat))
    return reductions


def sum_over_groups(gradients_and_groups: list, communicator) -> None:
    """Sum each gradient over every group of its tuple, in place, with one flat buffer per distinct
    tuple (tensor-grid replicas, data replicas): one collective per (tuple, group), not per tensor.
    Tuples are taken in first-seen order, the same on every rank that shares the parameters."""
    by_groups = {}
    for gradient, groups in gradients_and_groups:
        if groups:
            by_groups.setdefault(tuple(groups), []).append(gradient)
    for groups, gradients in by_groups.items():
        flat = torch.cat([gradient.reshape(-1) for gradient in gradients])
        for group in groups:
            communicator.all_reduce(flat, group)
        offset = 0
        for gradient in gradients:
            gradient.copy_(flat[offset:offset + gradient.numel()].view_as(gradient))
            offset += gradient.numel()
