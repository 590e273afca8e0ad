"""ParallelLayout: the degrees of one run and every process group, built once, in one order.

A rank's coordinates are (data, pipeline, context, tensor) with the tensor index fastest:
    rank = tensor + tensor_size · (context + context_degree · (pipeline + pipeline_degree · data))
so a tensor-parallel group is a block of neighbouring ranks (one node), a sequence's context
shards next, pipeline neighbours after them, and data-parallel replicas are furthest apart. Every
rank creates every group in the same order (torch.distributed.new_group is collective over the
world) and keeps the ones it belongs to.

Groups across several axes: `data_context` (the ranks that hold the same parameters once the
tensor and pipeline splits are fixed: data replicas and context shards reduce gradients together,
as Megatron-core's data-parallel-with-context group), and, with experts split over e data ranks,
`expert` (e consecutive data indices) and `expert_data` (the data ranks holding the same experts).

Groups finer than the tensor axis (a tensor-parallel grid's rows, columns, ...) arrive as data:
`families` maps a family's name to its member lists of local tensor indices within one tensor
block. This floor knows nothing of grids; strategies/tensor_parallel/grids.py computes them.
"""

import itertools
from datetime import timedelta
from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch.distributed as dist

from parallel.comm import Communicator, Group
from parallel.dims import AXES, Layout

RANK_ORDER = ("tensor", "context", "pipeline", "data")  # fastest-varying first: summary.json `layout.order`
# (name, the coordinates its members differ in): groups spanning more than one axis, built after the axes
JOINT_GROUPS = (("data_context", ("data", "context")), ("expert", ("expert",)), ("expert_data", ("expert_data",)))


def coordinates(rank: int, degrees: Layout) -> Dict[str, int]:
    """This rank's index along each axis, and its data index split as (expert_data, expert)."""
    coords = {}
    for axis in RANK_ORDER[:-1]:
        size = getattr(degrees, axis)
        coords[axis], rank = rank % size, rank // size
    coords["data"] = rank
    coords["expert"], coords["expert_data"] = rank % degrees.expert, rank // degrees.expert
    return coords


def rank_of(coords: Dict[str, int], degrees: Layout) -> int:
    data = coords["data"] if "expert" not in coords else coords["expert"] + degrees.expert * coords["expert_data"]
    rank = data
    for axis in reversed(RANK_ORDER[:-1]):
        rank = rank * getattr(degrees, axis) + coords[axis]
    return rank


def _sizes(degrees: Layout) -> Dict[str, int]:
    """Every coordinate's range: the axes, and the data axis split as (expert_data, expert)."""
    sizes = {axis: getattr(degrees, axis) for axis in AXES}
    sizes.update(expert=degrees.expert, expert_data=degrees.data // degrees.expert)
    return sizes


def group_members(axes, degrees: Layout) -> Tuple[Tuple[int, ...], ...]:
    """All groups along `axes` (one axis name or several): ranks that differ only in those
    coordinates, in a fixed order; the data axis is addressed whole or as (expert, expert_data)."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    sizes = _sizes(degrees)
    split_data = "data" not in axes
    coordinate_names = (["expert_data", "expert"] if split_data else ["data"]) + [a for a in AXES if a != "data"]
    others = [a for a in coordinate_names if a not in axes]
    groups = []
    for fixed in itertools.product(*(range(sizes[a]) for a in others)):
        coords = dict(zip(others, fixed))
        members = [rank_of({**coords, **dict(zip(axes, moving))}, degrees)
                   for moving in itertools.product(*(range(sizes[a]) for a in axes))]
        groups.append(tuple(members))
    return tuple(groups)


class ParallelLayout:
    """Owns the degrees, this rank's coordinates, its groups and the communication counter.

    1. coordinates from the rank (tensor fastest, then pipeline, then data);
    2. for each axis, every group along it is created on every rank, in the same order;
    3. then each of `families`, in its given order, repeated in every tensor block;
    4. then, for each of `host_axes`, a gloo group along that axis named `host_<axis>`: host-side
       tensors (L2L's store) are reduced there, since NCCL reduces only device tensors (Megatron and
       DeepSpeed keep such a CPU group next to the device group for CPU offload);
    5. groups of size one never touch the process group (single-process runs need none);
    6. every group gets `timeout`, the backend's own bound on one operation: the world group's
       (the strategy passes it; layerwise/run/timeouts.py `TimeoutChain` sets it longer than the
       watchdog's longest allowance). Without it torch gives a new group its backend's default
       (NCCL 10 min, gloo 30 min: distributed_c10d.py `_get_default_timeout`), whatever the world's;
    7. every collective goes through `self.communicator`, which counts logical bytes.

    The layout's `tensor_grid` names the families (e.g. "3d"); `describe()` records it, so a
    checkpoint cut on one grid is not resumed on another.
    """

    def __init__(self, degrees: Layout, rank: int = 0,
                 families: Optional[Mapping[str, Sequence[Sequence[int]]]] = None, host_axes: Sequence[str] = (),
                 timeout: Optional[timedelta] = None):
        self.degrees = degrees
        self.timeout = timeout
        self.rank = rank
        self.tensor_grid = degrees.tensor_grid
        self.coordinates = coordinates(rank, degrees)
        self.communicator = Communicator()
        self.groups: Dict[str, Group] = {}
        for axis in AXES:
            self.groups[axis] = self._build_axis(axis)
        for name, axes in JOINT_GROUPS:  # after the axes; a joint group equal to one already built is reused
            self.groups[name] = self._build_joint(name, axes)
        for family, local_member_lists in (families or {}).items():  # after the axes, same order
            self.groups[family] = self._build_family(family, local_member_lists)
        for axis in host_axes:  # last, in the given order, on every rank
            self.groups[f"host_{axis}"] = self._create_groups(
                f"host_{axis}", group_members(axis, degrees), backend="gloo")

    def _build_axis(self, axis: str) -> Group:
        return self._create_groups(axis, group_members(axis, self.degrees))

    def _build_joint(self, name: str, axes) -> Group:
        """A group across `axes`; where its member lists are an axis's (context 1: data_context is
        data), it IS that axis's group, name included (counts, flight records and a hang's diagnosis say
        "data" as they did before context existed): the same decision on every rank, no new communicator."""
        members = group_members(axes, self.degrees)
        for axis in AXES:
            if set(members) == set(group_members(axis, self.degrees)) and self.groups[axis] is not None:
                built = self.groups[axis]
                return Group(built.name, built.ranks, built.process_group, built.channel or axis)
        return self._create_groups(name, members)

    def _create_groups(self, name: str, member_lists, backend: Optional[str] = None) -> Group:
        """Create every group of a family on every rank, in order; return this rank's.
        `backend` None: the default process group's (the world is reused when a group spans it)."""
        mine = None
        for members in member_lists:
            handle = None
            if len(members) > 1 and (backend is not None or len(members) < self.degrees.world_size):
                # collective: every rank calls it; the timeout as the world's (step 6)
                handle = dist.new_group(list(members), backend=backend, timeout=self.timeout)
            elif len(members) > 1:
                handle = dist.group.WORLD
            if self.rank in members:
                mine = Group(name, tuple(members), handle, "world" if handle is dist.group.WORLD else name)
        return mine

    def group(self, axis: str) -> Group:
        return self.groups[axis]

    def index(self, axis: str) -> int:
        return self.coordinates[axis]

    def describe(self) -> Dict[str, int]:
        described = self.degrees.as_dict()
        if self.tensor_grid is not None:  # per-rank checkpoints record the grid they were cut on
            described["tensor_grid"] = self.tensor_grid
        return described

    def _build_family(self, family: str, local_member_lists) -> Group:
        """One family: its member lists repeated in every tensor block, in a fixed order."""
        block = self.degrees.tensor
        member_lists = [tuple(base + local for local in members)
                        for base in range(0, self.degrees.world_size, block)  # one per (data, pipe)
                        for members in local_member_lists]
        return self._create_groups(family, member_lists)

