"""ParallelLayout: the degrees of one run and every process group, built once, in one order.

A rank's coordinates are (data, pipeline, tensor) with the tensor index fastest:
    rank = tensor + tensor_size · (pipeline + pipeline_degree · data)
so a tensor-parallel group is a block of neighbouring ranks (one node), pipeline neighbours are
next, and data-parallel replicas are furthest apart. Every rank creates every group in the same
order (torch.distributed.new_group is collective over the world) and keeps the ones it belongs to.
"""

import itertools
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch.distributed as dist

from parallel.comm import Communicator, Group

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

    def __init__(self, degrees: Degrees, rank: int = 0, tensor_grid: Optional[str] = None):
        self.degrees = degrees
        self.rank = rank
        self.tensor_grid = tensor_grid  # None | "1d" | "2d" | "3d": see TENSOR_GRID_FAMILIES
        self.coordinates = coordinates(rank, degrees)
        self.communicator = Communicator()
        self.groups: Dict[str, Group] = {}
        for axis in AXES:
            self.groups[axis] = self._build_axis(axis)
        for family in TENSOR_GRID_FAMILIES.get(tensor_grid, ()):  # after the axes, same order
            self.groups[family] = self._build_family(family)

    def _build_axis(self, axis: str) -> Group:
        return self._create_groups(axis, group_members(axis, self.degrees))

    def _create_groups(self, name: str, member_lists) -> Group:
        """Create every group of a family on every rank, in order; return this rank's."""
        mine = None
        for members in member_lists:
            handle = None
            if 1 < len(members) < self.degrees.world_size:
                handle = dist.new_group(list(members))  # collective: every rank calls it
            elif len(members) > 1:
                handle = dist.group.WORLD
            if self.rank in members:
                mine = Group(name, tuple(members), handle)
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

    def _build_family(self, family: str) -> Group:
        """One tensor-grid family: every member list in every tensor block, in a fixed order."""
        block = self.degrees.tensor
        member_lists = [tuple(base + t for t in local)
                        for base in range(0, self.degrees.world_size, block)  # one per (data, pipe)
                        for local in tensor_family_members(family, self.tensor_grid, block)]
        return self._create_groups(family, member_lists)


# ----- tensor-parallel grids inside one tensor block (TECHNIQUES.md §4)
#
# 3d: q³ ranks, local index t = i + q·(j + q·k). Families of size q: input (vary j), weight
#     (vary i), output (vary k); unions of size q²: input_weight (vary i, j), output_weight
#     (vary i, k). 2d: q² ranks, t = column + q·row; `row` holds one row (vary column),
#     `column` one column (vary row). 1d: the tensor group itself, nothing more.
TENSOR_GRID_FAMILIES = {
    "1d": (),
    "2d": ("row", "column"),
    "3d": ("input", "weight", "output", "input_weight", "output_weight"),
}
_VARYING = {  # family -> the grid coordinates that vary inside one of its groups
    "row": ("column",), "column": ("row",),
    "input": ("j",), "weight": ("i",), "output": ("k",),
    "input_weight": ("i", "j"), "output_weight": ("i", "k"),
}


def grid_edge(tensor_grid: str, tensor_degree: int) -> int:
    """q such that q^dimension == tensor_degree (ValueError otherwise)."""
    dimension = {"1d": 1, "2d": 2, "3d": 3}[tensor_grid]
    edge = round(tensor_degree ** (1 / dimension))
    if edge ** dimension != tensor_degree:
        raise ValueError(f"a {tensor_grid} tensor grid needs a perfect power, got {tensor_degree}")
    return edge


def grid_coordinates(tensor_grid: str, local: int, edge: int) -> Dict[str, int]:
    """Coordinates of local tensor index `local` on the grid (see the table above)."""
    if tensor_grid == "3d":
        return {"i": local % edge, "j": local // edge % edge, "k": local // edge ** 2}
    if tensor_grid == "2d":
        return {"column": local % edge, "row": local // edge}
    return {"t": local}


def tensor_family_members(family: str, tensor_grid: str, block: int):
    """Local index lists of every group of `family`, sorted so coordinate order = rank order."""
    edge = grid_edge(tensor_grid, block)
    key = lambda t: tuple(v for c, v in sorted(grid_coordinates(tensor_grid, t, edge).items())
                          if c not in _VARYING[family])
    groups: Dict[tuple, list] = {}
    for t in range(block):
        groups.setdefault(key(t), []).append(t)
    return tuple(tuple(members) for _, members in sorted(groups.items()))
