"""ParallelLayout: the degrees of one run and every process group, built once, in one order.

A rank's coordinates are (data, pipeline, tensor) with the tensor index fastest:
    rank = tensor + tensor_size · (pipeline + pipeline_degree · data)
so a tensor-parallel group is a block of neighbouring ranks (one node), pipeline neighbours are
next, and data-parallel replicas are furthest apart. Every rank creates every group in the same
order (torch.distributed.new_group is collective over the world) and keeps the ones it belongs to.
"""

import itertools
from dataclasses import dataclass
from typing import Dict, Tuple

import torch.distributed as dist

from layerwise.comm import Communicator, Group

AXES = ("data", "pipeline", "tensor")


@dataclass(frozen=True)
class Degrees:
    """How the world is split; data × pipeline × tensor == world size."""

    data: int = 1
    pipeline: int = 1
    tensor: int = 1

    @property
    def world_size(self) -> int:
        return self.data * self.pipeline * self.tensor

    def as_dict(self) -> Dict[str, int]:
        return {axis: getattr(self, axis) for axis in AXES}


def coordinates(rank: int, degrees: Degrees) -> Dict[str, int]:
    """This rank's index along each axis."""
    tensor, rest = rank % degrees.tensor, rank // degrees.tensor
    pipeline, data = rest % degrees.pipeline, rest // degrees.pipeline
    return {"data": data, "pipeline": pipeline, "tensor": tensor}


def rank_of(coords: Dict[str, int], degrees: Degrees) -> int:
    return coords["tensor"] + degrees.tensor * (coords["pipeline"] + degrees.pipeline * coords["data"])


def group_members(axis: str, degrees: Degrees) -> Tuple[Tuple[int, ...], ...]:
    """All groups along `axis`: ranks that differ only in that coordinate, in a fixed order."""
    others = [a for a in AXES if a != axis]
    groups = []
    for fixed in itertools.product(*(range(getattr(degrees, a)) for a in others)):
        coords = dict(zip(others, fixed))
        groups.append(tuple(rank_of({**coords, axis: i}, degrees) for i in range(getattr(degrees, axis))))
    return tuple(groups)


class ParallelLayout:
    """Owns the degrees, this rank's coordinates, its groups and the communication counter.

    1. coordinates from the rank (tensor fastest, then pipeline, then data);
    2. for each axis, every group along it is created on every rank, in the same order;
    3. groups of size one never touch the process group (single-process runs need none);
    4. every collective goes through `self.communicator`, which counts logical bytes.
    """

    def __init__(self, degrees: Degrees, rank: int = 0):
        self.degrees = degrees
        self.rank = rank
        self.coordinates = coordinates(rank, degrees)
        self.communicator = Communicator()
        self.groups: Dict[str, Group] = {}
        for axis in AXES:
            self.groups[axis] = self._build_axis(axis)

    def _build_axis(self, axis: str) -> Group:
        mine = None
        for members in group_members(axis, self.degrees):
            handle = None
            if len(members) > 1 and len(members) < self.degrees.world_size:
                handle = dist.new_group(list(members))  # collective: every rank calls it
            elif len(members) > 1:
                handle = dist.group.WORLD
            if self.rank in members:
                mine = Group(axis, members, handle)
        return mine

    def group(self, axis: str) -> Group:
        return self.groups[axis]

    def index(self, axis: str) -> int:
        return self.coordinates[axis]

    def describe(self) -> Dict[str, int]:
        return self.degrees.as_dict()
