"""Layout: how a run's world is split, the one description training, planning and search share.

Pure data (no process group, no config): strategies build it from a config (StrategyEntry.degrees),
parallel/layout.py's ParallelLayout creates its process groups, cost/ prices it, the search
enumerates it. torchtitan's ParallelDims plays the same part (torchtitan/distributed/parallel_dims.py).
"""

from dataclasses import dataclass
from typing import Dict, Optional

# Outermost first. `context` sits between pipeline and tensor: a sequence's shards exchange keys and
# values every layer, so they are kept near each other (Megatron-core orders tp, cp, dp, pp the same
# way: megatron/core/parallel_state.py `order="tp-cp-ep-dp-pp"`).
AXES = ("data", "pipeline", "context", "tensor")
# A tensor grid's block has q^dimension ranks (strategies/tensor_parallel/grids.py: 1-D Megatron,
# 2-D SUMMA-style, 3-D Bian et al. 2021).
DIMENSION = {"1d": 1, "2d": 2, "3d": 3}


def tensor_ranks(tensor_grid: Optional[str], edge: int) -> int:
    """Ranks of one tensor block: q^dimension of the grid `tensor_grid` of edge q, 1 without one."""
    return edge ** DIMENSION[tensor_grid] if tensor_grid else 1


@dataclass(frozen=True)
class Layout:
    """The degrees of one run: data × pipeline × context × tensor == world size.

    1. `data` replicas, outermost; `pipeline` ranks, one per stage group;
    2. `context`: each sequence split over c ranks (context parallelism), which hold the same
       parameters and so reduce their gradients with the data replicas (the `data_context` group);
    3. `tensor`: one block of q^dimension ranks arranged as the grid `tensor_grid` of edge `edge`
       (q), innermost; 1 without a grid;
    4. `zero`: the parameters, gradients and optimizer state are sharded over the data ranks
       (ZeRO-3, Rajbhandari et al. 2020 §5) instead of replicated;
    5. `expert`: the experts of a mixture-of-experts block sharded over e of the data ranks (no
       factor of the world: e divides `data`; the `expert` and `expert_data` groups).
    Everything else (world size, ranks per axis) is derived here, once.
    """

    data: int = 1
    pipeline: int = 1
    tensor_grid: Optional[str] = None  # None | "1d" | "2d" | "3d"
    edge: int = 1  # q: the grid's side
    zero: bool = False
    context: int = 1  # c: ranks one sequence is split over
    expert: int = 1  # e: data ranks one MoE block's experts are split over

    def __post_init__(self):
        if self.data % self.expert:
            raise ValueError(f"strategy.expert_parallel: {self.expert} must divide the {self.data} "
                             "data-parallel ranks the experts are split over")

    @property
    def tensor(self) -> int:
        """Ranks of one tensor block (the tensor degree)."""
        return tensor_ranks(self.tensor_grid, self.edge)

    @property
    def data_context(self) -> int:
        """Ranks holding the same parameters once the pipeline and tensor splits are fixed: the data
        replicas × the context shards (the `data_context` group), over which gradients are reduced."""
        return self.data * self.context

    @property
    def world_size(self) -> int:
        return self.data * self.pipeline * self.context * self.tensor

    def as_dict(self) -> Dict[str, int]:
        """The degrees per axis (summary.json `layout`, a checkpoint's layout); `context` and
        `expert` only where they split something, so layouts written before they existed read the same."""
        degrees = {axis: getattr(self, axis) for axis in AXES if axis != "context" or self.context > 1}
        if self.expert > 1:
            degrees["expert"] = self.expert
        return degrees
