"""Gradient reductions in flat buckets (`strategy.bucket_mb`): one collective per bucket, not per tensor.

Consecutive parameters are grouped into buckets of at most `bucket_mb` MiB of gradient (a larger
tensor is a bucket alone; `bucket_mb=0` keeps one bucket per tensor, the comparator). The logical
bytes are those of the tensors one by one: the same elements cross the same ring. Each element is
summed from the same addends as per tensor (bit-identical on two replicas).

Two users. The pipeline stages (`GradientBuckets`) accumulate into the buckets from the start: each
`.grad` is a view of its bucket's flat buffer before the stage's first backward (DDP's
gradient_as_bucket_view, Li et al. 2020 §3.2.3), so nothing is copied, and a bucket is posted as soon
as the stage's last backward has finished all of its gradients (`strategy.overlap_reduction`).
L2L's host store (`post_bucket_reductions`) receives whole gradients from the device and copies each
bucket into one flat buffer at its reduction (`flat_gradient`).
"""

import contextlib
import functools
from collections import Counter

import torch

MEBIBYTE = 2 ** 20


def bucket_bytes(bucket_mb: float) -> int:
    """`strategy.bucket_mb` in bytes (0: one bucket per tensor)."""
    return int(bucket_mb * MEBIBYTE)


def parameter_buckets(parameters: list, capacity_bytes: int, apart=None) -> list:
    """Consecutive parameters in lists of at most `capacity_bytes` of gradient, one dtype and device
    each; `apart(parameter)`, if given, is a set that a bucket never mixes (late vs early ones)."""
    buckets, size = [], 0
    for parameter in parameters:
        nbytes = parameter.numel() * parameter.element_size()
        last = buckets[-1][-1] if buckets else None
        joins = last is not None and (last.dtype, last.device) == (parameter.dtype, parameter.device)
        joins = joins and (apart is None or apart(last) == apart(parameter))
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
    """Post one asynchronous all-reduce (sum) per bucket of whole gradients; returns (work, flat
    gradient) pairs (L2L's host store; the pipeline stages use GradientBuckets)."""
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


def on_wire(flat: torch.Tensor, wire: torch.dtype, group) -> torch.Tensor:
    """What a bucket's reduction moves: `flat` itself, or a copy cast to the narrower `wire` dtype
    (strategy.reduction_dtype=compute) where the group has members to reduce with."""
    narrower = flat.is_floating_point() and torch.finfo(wire).bits < torch.finfo(flat.dtype).bits
    if not narrower or group is None or group.size == 1:  # never widened (bf16-true's gradients stay bf16)
        return flat
    return flat.to(wire)


class Bucket:
    """One bucket of one stage: its parameters, this step's flat buffer, which are final, if posted."""

    __slots__ = ("stage", "parameters", "late", "flat", "final", "posted", "group")

    def __init__(self, stage: int, parameters: list, late: bool, group=None):
        self.stage, self.parameters, self.late = stage, parameters, late
        self.group = group  # the group its all-reduce sums over
        self.flat, self.final, self.posted = None, set(), False


class GradientBuckets:
    """One rank's data-parallel gradient reduction of its pipeline stages, in flat buckets, no copy.

    1. `lay_out(stage, parameters, late)`, once per stage: the parameters, in reverse order (the
       order a backward finishes them, DDP's), cut into buckets of at most `capacity_bytes`; `late`
       ones (a tensor grid's replicated pieces, summed over their tensor groups first) never share a
       bucket with the others. Each trainable parameter gets two hooks: a gradient hook, which
       autograd runs before accumulating (also where a W captures the gradient), and a
       post-accumulate-grad hook.
    2. The step's first gradient into any parameter of a bucket (the gradient hook) gives the bucket
       a zeroed flat buffer and makes each of its parameters' `.grad` a view of it, so autograd
       accumulates every micro-batch in place. Buffers are made one bucket at a time as the backward
       reaches them, as autograd would create the gradients (a bucket ahead at most: cost/memory.py);
       the step's `zero_grad(set_to_none=True)` (strategies/base.py) drops the views and `start` the
       buffers. No whole-stage copy is ever made.
    3. `accumulating(stage, micro_batches)` is entered around every accumulation into the stage's
       gradients (a fused backward B, or a split backward's W); in its last of the step (the m-th),
       each parameter whose gradient autograd has accumulated is final (the post-accumulate hook; a
       W reports its weights itself, strategies/split_backward.py `PendingWeightGradient.run`); with
       `overlap`, a bucket whose parameters are all final posts its asynchronous all-reduce at once
       if every earlier bucket of the layout is posted (else when they are: `_post_final`), under the
       rest of that backward and the earlier stages'.
    4. `post_rest(stage)` (the plan's REDUCE_GRADIENT(c), after the stage's last backward) posts every
       bucket not yet posted, in layout order: all of them without `overlap`; with it, the late ones
       and any bucket holding a parameter that got no gradient (zeros: every replica joins every
       all-reduce).
    5. `wait(size)` before the optimizer: wait for each all-reduce and divide by the replicas.
    Expert parallelism (strategies/expert_parallel.py): the `experts` of `lay_out` (the MoE blocks'
    split experts) never share a bucket with the others and are summed over `expert_group` (the ranks
    holding the same experts) instead of `group`; `wait` divides them by the same data degree.
    With a `wire` dtype narrower than the buffers (strategy.reduction_dtype=compute: bf16/fp16) each
    bucket is cast to it when posted, reduced, and cast back into its fp32 buffer before the division:
    half the bytes, one rounding of each addend and of each partial sum of the ring (a transient
    2-byte copy of every bucket in flight).
    NCCL order: a data group's ranks (one per replica, at the same pipeline and tensor position) run
    the same plan row on the same stage shapes; every bucket is posted in layout order (3) and
    REDUCE_GRADIENT posts the rest in layout order at the same plan position, so every replica issues
    the same sequence whatever order its gradients are finished in. A model whose graph depended on
    the data (a parameter used on one replica, not another) would break this; none of ours does
    (layer_drop's masks are per step, not per replica, and not offered to pipelines).
    """

    def __init__(self, capacity_bytes: int, communicator, group, overlap: bool, wire: torch.dtype = torch.float32,
                 expert_group=None):
        self.capacity_bytes, self.communicator, self.group, self.overlap = capacity_bytes, communicator, group, overlap
        self.expert_group = expert_group  # where split experts' gradients are summed (None: `group`)
        self.wire = wire  # the dtype the all-reduce moves (strategy.reduction_dtype)
        self.layouts = {}  # stage -> [Bucket] in layout order
        self.bucket_of = {}  # id(parameter) -> its Bucket
        self.accumulations = Counter()  # stage -> accumulations into it this step
        self.finishing = set()  # stages whose last accumulation of the step is running
        self.pending = []  # (work, flat) in posting order

    def laid_out(self, stage: int) -> bool:
        return stage in self.layouts

    def lay_out(self, stage: int, parameters: list, late: set, experts: set = frozenset()) -> None:
        """Cut `parameters` (reverse order) into buckets; `late`: ids of parameters posted only by
        `post_rest`, after their tensor-group sum; `experts`: ids of split experts (summed over
        `expert_group`)."""
        buckets = parameter_buckets(parameters, self.capacity_bytes,
                                    apart=lambda parameter: (id(parameter) in late, id(parameter) in experts))
        self.layouts[stage] = [Bucket(stage, bucket, id(bucket[0]) in late,
                                      self.expert_group if id(bucket[0]) in experts and self.expert_group else self.group)
                               for bucket in buckets]
        for bucket in self.layouts[stage]:
            for parameter in bucket.parameters:
                self.bucket_of[id(parameter)] = bucket
                if parameter.requires_grad:
                    parameter.register_hook(functools.partial(self._arriving, bucket))
                    parameter.register_post_accumulate_grad_hook(self.accumulated)

    def start(self) -> None:
        """A new step: no buffers (the last step's go with its `.grad` views), nothing final or posted."""
        for buckets in self.layouts.values():
            for bucket in buckets:
                bucket.flat, bucket.final, bucket.posted = None, set(), False
        self.accumulations.clear()
        self.finishing.clear()
        self.pending = []

    @contextlib.contextmanager
    def accumulating(self, stage: int, micro_batches: int):
        """Around one accumulation into `stage`'s gradients; the m-th of the step is its last."""
        self.accumulations[stage] += 1
        last = self.accumulations[stage] == micro_batches
        if last:
            self.finishing.add(stage)
        try:
            yield
        finally:
            self.finishing.discard(stage)

    def _arriving(self, bucket: Bucket, gradient: torch.Tensor) -> None:
        """A gradient hook: autograd is about to accumulate into one of `bucket`'s parameters."""
        self.attach(bucket)

    @staticmethod
    def attach(bucket: Bucket) -> None:
        """A bucket without a buffer this step gets a zeroed one, and its parameters' `.grad`
        become views of it (a gradient already there, e.g. never zeroed, is copied in)."""
        if bucket.flat is not None:
            return
        first = bucket.parameters[0]
        bucket.flat = torch.zeros(sum(p.numel() for p in bucket.parameters), dtype=first.dtype, device=first.device)
        offset = 0
        for parameter in bucket.parameters:
            view = bucket.flat[offset:offset + parameter.numel()].view_as(parameter)
            if parameter.grad is not None:
                view.copy_(parameter.grad)
            parameter.grad = view
            offset += parameter.numel()

    def accumulated(self, parameter: torch.Tensor) -> None:
        """`parameter`'s gradient was accumulated (its hook, or a W): during its stage's last
        accumulation it is final; buckets are posted in layout order as soon as they and every
        bucket before them are final (`_post_final`)."""
        bucket = self.bucket_of.get(id(parameter))
        if bucket is None or bucket.stage not in self.finishing or bucket.late or not self.overlap:
            return
        bucket.final.add(id(parameter))
        if len(bucket.final) == len(bucket.parameters):
            self._post_final(bucket.stage)

    def _post_final(self, stage: int) -> None:
        """Post the stage's buckets in layout order, up to the first one not final yet (late ones
        wait for `post_rest` and are skipped here). Every replica then issues the same sequence of
        all-reduces whatever order its gradients finish in — a split backward's W accumulates its
        weights group by group in an order taken from sets of autograd nodes, which differs between
        processes (measured: gloo's "Received data size doesn't match expected size. 1040 vs 32" on a
        ZB-H1 run of 2 replicas); DDP's reducer launches its buckets in order for the same reason."""
        for bucket in self.layouts[stage]:
            if bucket.late or bucket.posted:
                continue
            if len(bucket.final) < len(bucket.parameters):
                return
            self._post(bucket)

    def post_rest(self, stage: int) -> None:
        """REDUCE_GRADIENT(stage): post every bucket of the stage not posted yet, in layout order."""
        for bucket in self.layouts[stage]:
            self.attach(bucket)  # none of its parameters got a gradient: zeros
            self._post(bucket)

    def _post(self, bucket: Bucket) -> None:
        if not bucket.posted:
            bucket.posted = True
            group = bucket.group or self.group
            moved = on_wire(bucket.flat, self.wire, group)
            self.pending.append((self.communicator.all_reduce(moved, group, async_op=True), bucket.flat, moved))

    def wait(self, replicas: int) -> None:
        """The all-reduces summed: divide for the mean. A bucket whose group is this rank alone reduced
        nothing, but a split expert's (expert_data of one rank) already sums every replica's tokens:
        it is divided by the replicas too."""
        for work, flat, moved in self.pending:
            if work is not None:
                work.wait()
                if moved is not flat:
                    flat.copy_(moved)  # back into the fp32 buffer, then the mean in fp32
            if replicas != 1:
                flat.div_(replicas)
        self.pending = []
