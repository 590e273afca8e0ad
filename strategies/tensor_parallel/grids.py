"""How each tensor-parallel grid cuts a plain parameter, and which groups hold copies of it.

A grid is pure arithmetic on (edge q, this rank's local tensor index): the same object shards
weights at start-up, names the groups of each collective, and (fed index tensors instead of
weights) inverts the sharding for `consolidate`. Weights arrive in nn.Linear's [out, in] layout;
the 2-D and 3-D grids store W as [in, out] like the paper. A layer's `position` in its pair of
linears ("first" | "second") is the explicit argument that decides its axis roles.

Layouts of an activation [rows, features] (rows = this data rank's sequences):
  3d  first-layer input L(j,k): rows chunk i·q+j of q², features chunk k of q; a linear with roles
      (a, b) maps L(a,b) -> L(b,a), so "first" has (a,b) = (j,k) and "second" (k,j) (§4: no
      redistribution between consecutive linears).
  2d  rows chunk `row` of q, features chunk `column` of q, before and after every linear.
  1d  rows and features whole; column-parallel output features chunk t of P. With sequence
      parallelism the residual stream between the parallel regions holds positions chunk t of P
      instead (strategies/tensor_parallel/sequence.py).

This file is the one home of grid geometry: coordinates, the edge q, and the group families inside
one tensor block that `layout_arguments` hands to ParallelLayout (which knows nothing of grids).
"""

from dataclasses import dataclass
from typing import Dict

import torch

from parallel.dims import DIMENSION


def take(tensor: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    """Chunk `index` of `parts` equal chunks along `dim`."""
    if tensor.shape[dim] % parts:
        raise ValueError(f"dimension {dim} of size {tensor.shape[dim]} does not split into {parts}")
    return tensor.chunk(parts, dim)[index]


def interleave_fused(tensor: torch.Tensor, fused: int, parts: int) -> torch.Tensor:
    """Reorder a fused [Q|K|V] output dim (dim 0) so chunk c of `parts` holds [Q_c|K_c|V_c]."""
    if fused == 1:
        return tensor
    rest = tuple(tensor.shape[1:])
    return tensor.reshape(fused, parts, -1, *rest).transpose(0, 1).reshape(tensor.shape)


@dataclass(frozen=True)
class Style:
    """How a module is parallelised: kind (linear | norm | embedding | head_norm: a norm over each
    head's features, Qwen3's q/k norms, whole on every rank), its place in a pair of linears, and how
    many outputs a linear fuses (3 for qkv)."""

    kind: str
    position: str = "first"
    fused: int = 1


class Grid3D:
    """q³ ranks, t = i + q·(j + q·k) (docs/strategies/three_d.md)."""

    name = "3d"  # q^DIMENSION["3d"] ranks (parallel/dims.py)
    # family -> the coordinates that vary inside one of its groups: groups of q along one axis,
    # and the unions of q² that hold copies of a replicated parameter
    VARYING = {"input": ("j",), "weight": ("i",), "output": ("k",),
               "input_weight": ("i", "j"), "output_weight": ("i", "k")}
    FAMILY_OF = {"j": "input", "k": "output"}
    UNION_WITH_WEIGHT = {"j": "input_weight", "k": "output_weight"}

    def __init__(self, edge: int, local: int):
        self.q, self.c = edge, self.coordinates(local, edge)

    @staticmethod
    def coordinates(local: int, edge: int) -> Dict[str, int]:
        return {"i": local % edge, "j": local // edge % edge, "k": local // edge ** 2}

    def roles(self, position: str):
        """(a, b): a splits the input rows with i and is gathered; b splits input features."""
        return ("j", "k") if position == "first" else ("k", "j")

    @property
    def output_parts(self) -> int:
        return self.q

    head_parts = output_parts

    @property
    def feature_parts(self) -> int:
        return self.q * self.q  # a weight's input features are split by (b, i)

    def cut(self, style: Style, name: str, full: torch.Tensor) -> torch.Tensor:
        q, i = self.q, self.c["i"]
        a, b = (self.c[axis] for axis in self.roles(style.position))
        if style.kind == "linear" and name == "weight":
            return take(take(full.t(), 0, q * q, b * q + i), 1, q, a)
        if style.kind == "linear":
            return take(full, 0, q, a)
        if style.kind == "norm":
            return take(full, 0, q, b)
        return take(full, 1, q, b)  # embedding [V, h]: features of the first layer's input

    def full_shape(self, style: Style, name: str, shape) -> tuple:
        q = self.q
        if style.kind == "linear" and name == "weight":
            return (shape[1] * q, shape[0] * q * q)
        return (shape[0] * q,) if len(shape) == 1 else (shape[0], shape[1] * q)

    def replicated_over(self, style: Style, name: str) -> tuple:
        """Families whose members hold copies (their gradients are summed over the union)."""
        a, b = self.roles(style.position)
        if style.kind == "linear":
            return () if name == "weight" else (self.UNION_WITH_WEIGHT[b],)
        return (self.UNION_WITH_WEIGHT[a],)

    def linear_specs(self, position: str):
        """(X gather, W gather, Y reduce-scatter) as (family, dim) for GatherMatmulScatter."""
        a, b = self.roles(position)
        return (self.FAMILY_OF[a], 0), ("weight", 0), (self.FAMILY_OF[b], 0)

    norm_family = "output"  # features of the first layout are split by k
    activation_feature_parts = output_parts  # the residual stream L(j,k): features chunk k of q
    sequence_parts = 1  # positions whole
    replicated_piece = False  # each position's piece is its own: nothing to scatter at a boundary
    vocabulary_family = "input"  # the head is a "first" linear: logits split by j
    batch_families = ("output_weight",)  # logits rows are split by (i, k)

    def input_rows(self):
        return self.c["i"] * self.q + self.c["j"], self.q * self.q

    def logit_rows(self):
        return self.c["i"] * self.q + self.c["k"], self.q * self.q

    def vocabulary_chunk(self):
        return self.c["j"], self.q


class Grid2D:
    """q² ranks, t = column + q·row; SUMMA's layout (rows by `row`, features by `column`)."""

    name = "2d"  # q^DIMENSION["2d"] ranks (parallel/dims.py)
    VARYING = {"row": ("column",), "column": ("row",)}  # `row` holds one row of the grid

    def __init__(self, edge: int, local: int):
        self.q, self.c = edge, self.coordinates(local, edge)

    @staticmethod
    def coordinates(local: int, edge: int) -> Dict[str, int]:
        return {"column": local % edge, "row": local // edge}

    @property
    def output_parts(self) -> int:
        return self.q

    head_parts = feature_parts = output_parts

    def cut(self, style: Style, name: str, full: torch.Tensor) -> torch.Tensor:
        q, row, column = self.q, self.c["row"], self.c["column"]
        if style.kind == "linear" and name == "weight":
            return take(take(full.t(), 0, q, row), 1, q, column)
        if style.kind in ("linear", "norm"):
            return take(full, 0, q, column)
        return take(full, 1, q, column)

    def full_shape(self, style: Style, name: str, shape) -> tuple:
        q = self.q
        if style.kind == "linear" and name == "weight":
            return (shape[1] * q, shape[0] * q)
        return (shape[0] * q,) if len(shape) == 1 else (shape[0], shape[1] * q)

    def replicated_over(self, style: Style, name: str) -> tuple:
        return () if (style.kind, name) == ("linear", "weight") else ("column",)

    def linear_specs(self, position: str):
        """Gather X's features along the row, W's input rows along the column; no scatter."""
        return ("row", -1), ("column", 0), None

    norm_family = "row"
    activation_feature_parts = output_parts  # features chunk `column` of q
    sequence_parts = 1
    replicated_piece = False
    vocabulary_family = "row"
    batch_families = ("column",)

    def input_rows(self):
        return self.c["row"], self.q

    logit_rows = input_rows

    def vocabulary_chunk(self):
        return self.c["column"], self.q


class Grid1D:
    """P ranks in one group (Megatron): "first" linears split outputs, "second" split inputs.

    `sequence_parallel` (Korthikanti et al. 2022 §4.2.2): between the parallel regions rank t holds
    positions chunk t of P of the residual stream; the norms, the row-parallel biases and the
    embedding tables, still whole on every rank, then see only their rank's positions, so their
    gradients are partial and summed over the tensor group (`replicated_over`)."""

    name = "1d"  # q^DIMENSION["1d"] ranks (parallel/dims.py)
    VARYING = {}  # the tensor group itself is the only group

    def __init__(self, edge: int, local: int, sequence_parallel: bool = False):
        self.q, self.t = edge, local
        self.sequence_parallel = sequence_parallel

    @staticmethod
    def coordinates(local: int, edge: int) -> Dict[str, int]:
        return {"t": local}

    @property
    def output_parts(self) -> int:
        return self.q

    head_parts = feature_parts = output_parts

    def cut(self, style: Style, name: str, full: torch.Tensor) -> torch.Tensor:
        if style.kind != "linear":
            return full
        if style.position == "first":
            return take(full, 0, self.q, self.t)
        return take(full, 1, self.q, self.t) if name == "weight" else full

    def full_shape(self, style: Style, name: str, shape) -> tuple:
        if style.kind != "linear" or (style.position, name) == ("second", "bias"):
            return tuple(shape)
        if style.position == "first":
            return (shape[0] * self.q,) + tuple(shape[1:])
        return (shape[0], shape[1] * self.q)

    def replicated_over(self, style: Style, name: str) -> tuple:
        """Without sequence parallelism copies see identical inputs and gradients: nothing to sum.
        With it, whatever acts on the sequence shard (norms, embedding tables, the row-parallel
        bias added after the reduce-scatter) holds a partial gradient: summed over "tensor". A head
        norm (Qwen3's q/k norms) acts on this rank's heads only: partial whatever the sequence."""
        if style.kind == "head_norm":
            return ("tensor",)
        if not self.sequence_parallel:
            return ()
        partial = style.kind in ("norm", "embedding") or (style.kind, style.position, name) == ("linear", "second", "bias")
        return ("tensor",) if partial else ()

    norm_family = None
    activation_feature_parts = 1  # Megatron keeps the residual stream whole on every rank

    @property
    def sequence_parts(self) -> int:
        """Chunks the residual stream's positions are split into between the parallel regions."""
        return self.q if self.sequence_parallel else 1

    @property
    def replicated_piece(self) -> bool:
        """Whether every rank of the tensor group holds the same whole piece of the residual stream
        (a boundary message may then be scattered over the group and gathered on arrival); with
        sequence parallelism each holds its own positions: nothing to scatter."""
        return not self.sequence_parallel
    vocabulary_family = "tensor"
    batch_families = ()

    def input_rows(self):
        return 0, 1

    logit_rows = input_rows

    def vocabulary_chunk(self):
        return self.t, self.q


def local_activation_shape(grid, rows: int, length: int, hidden: int) -> tuple:
    """This rank's piece of a [rows, length, hidden] residual-stream activation: what it holds
    between blocks and what a pipeline stage boundary carries to the same grid position (1-D with
    sequence parallelism: [rows, length/t, hidden])."""
    row_parts, feature_parts, sequence_parts = grid.input_rows()[1], grid.activation_feature_parts, grid.sequence_parts
    if rows % row_parts or hidden % feature_parts or length % sequence_parts:
        raise ValueError(f"an activation of {rows} sequences × {length} positions × {hidden} features does not "
                         f"split into {row_parts} row, {sequence_parts} position and {feature_parts} feature "
                         f"chunks on the {grid.name} grid")
    return rows // row_parts, length // sequence_parts, hidden // feature_parts


GRIDS = {"1d": Grid1D, "2d": Grid2D, "3d": Grid3D}


def grid_edge(tensor_grid: str, tensor_degree: int) -> int:
    """q such that q^dimension == tensor_degree (ValueError otherwise)."""
    dimension = DIMENSION[tensor_grid]
    edge = round(tensor_degree ** (1 / dimension))
    if edge ** dimension != tensor_degree:
        raise ValueError(f"a {tensor_grid} tensor grid needs a perfect power, got {tensor_degree}")
    return edge


def grid_of(tensor_grid: str, tensor_degree: int, local: int, sequence_parallel: bool = False):
    """The grid object of local tensor index `local` in a tensor block of `tensor_degree` (1-D: with
    its residual stream split along the sequence if `sequence_parallel`)."""
    edge = grid_edge(tensor_grid, tensor_degree)
    if sequence_parallel:
        if tensor_grid != "1d":
            raise ValueError(f"sequence parallelism splits the 1-D grid's whole residual stream; the "
                             f"{tensor_grid} grid already splits it")
        return Grid1D(edge, local, sequence_parallel=True)
    return GRIDS[tensor_grid](edge, local)


def family_members(family: str, tensor_grid: str, tensor_degree: int) -> tuple:
    """Local index lists of every group of `family`, sorted so coordinate order = rank order."""
    grid, edge = GRIDS[tensor_grid], grid_edge(tensor_grid, tensor_degree)
    fixed = lambda local: tuple(value for name, value in sorted(grid.coordinates(local, edge).items())
                                if name not in grid.VARYING[family])
    groups: Dict[tuple, list] = {}
    for local in range(tensor_degree):
        groups.setdefault(fixed(local), []).append(local)
    return tuple(tuple(members) for _, members in sorted(groups.items()))


def layout_arguments(tensor_grid: str, tensor_degree: int) -> dict:
    """ParallelLayout's arguments for this grid: its families (created after the axes, in this
    order on every rank); the grid's name comes with the layout (parallel.dims.Layout.tensor_grid)."""
    families = {family: family_members(family, tensor_grid, tensor_degree)
                for family in GRIDS[tensor_grid].VARYING}
    return {"families": families}
