"""Layout: how a run's world is split, the one description training, planning and search share.

Pure data (no process group, no config): strategies build it from a config (StrategyEntry.degrees),
parallel/layout.py's ParallelLayout creates its process groups, cost/ prices it, the search
enumerates it. torchtitan's ParallelDims plays the same part (torchtitan/distributed/parallel_dims.py).
"""

from dataclasses import dataclass
from typing import Dict, Optional

AXES = ("data", "pipeline", "tensor")
# A tensor grid's block has q^dimension ranks (strategies/tensor_parallel/grids.py: 1-D Megatron,
# 2-D SUMMA-style, 3-D Bian et al. 2021).
DIMENSION = {"1d": 1, "2d": 2, "3d": 3}


def tensor_ranks(tensor_grid: Optional[str], edge: int) -> int:
    """Ranks of one tensor block: q^dimension of the grid `tensor_grid` of edge q, 1 without one."""
    return edge ** DIMENSION[tensor_grid] if tensor_grid else 1


@dataclass(frozen=True)
class Layout:
    """The degrees of one run: data × pipeline × tensor == world size.

    1. `data` replicas, outermost; `pipeline` ranks, one per stage group;
    2. `tensor`: one block of q^dimension ranks arranged as the grid `tensor_grid` of edge `edge`
       (q), innermost; 1 without a grid;
    3. `zero`: the parameters, gradients and optimizer state are sharded over the data ranks
       (ZeRO-3, Rajbhandari et al. 2020 §5) instead of replicated.
    Everything else (world size, ranks per axis) is derived here, once.
    """

    data: int = 1
    pipeline: int = 1
    tensor_grid: Optional[str] = None  # None | "1d" | "2d" | "3d"
    edge: int = 1  # q: the grid's side
    zero: bool = False

    @property
    def tensor(self) -> int:
        """Ranks of one tensor block (the tensor degree)."""
        return tensor_ranks(self.tensor_grid, self.edge)

    @property
    def world_size(self) -> int:
        return self.data * self.pipeline * self.tensor

    def as_dict(self) -> Dict[str, int]:
        """The degrees per axis (summary.json `layout`, a checkpoint's layout)."""
        return {axis: getattr(self, axis) for axis in AXES}
