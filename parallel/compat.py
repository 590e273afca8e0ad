"""The torch versions we accept (pyproject: torch>=2.11,<2.14), and the one place their APIs differ.

Every call whose name or form changed between torch 2.11 and 2.13 goes through here, so the rest
of the code is written once, against the names below, and no version branch lies anywhere else.

The single-tensor collectives: torch 2.13 calls them `all_gather_single` / `reduce_scatter_single`
and keeps `all_gather_into_tensor` / `reduce_scatter_tensor` as deprecated wrappers (FutureWarning)
that call the new ones; torch 2.11 and 2.12.1 have only the old names (read in each release's
torch/distributed/distributed_c10d.py). The arguments are the same in both: (output, input[, op], group, async_op), dim 0.
We call whichever the installed torch has natively, looked up on `torch.distributed` at each call,
so a counter that wraps that name there (tests/test_three_d.py, layerwise/reproduce/measure.py)
sees every call under either version.
"""

import torch.distributed as dist


def _native(new: str, old: str) -> str:
    """The name torch.distributed gives the collective: `new` where it exists (2.13), else `old`
    (2.11, 2.12)."""
    return new if hasattr(dist, new) else old


ALL_GATHER_SINGLE = _native("all_gather_single", "all_gather_into_tensor")
REDUCE_SCATTER_SINGLE = _native("reduce_scatter_single", "reduce_scatter_tensor")
SINGLE_TENSOR_COLLECTIVES = (ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE)


def all_gather_single(output, input, group=None, async_op=False):
    """Gather every member's equal `input` along dim 0 into `output` (torch's all-gather into one
    tensor, under this torch's name)."""
    return getattr(dist, ALL_GATHER_SINGLE)(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """Reduce `input` over the group with `op` and keep this member's dim-0 chunk in `output`
    (torch's reduce-scatter of one tensor, under this torch's name)."""
    return getattr(dist, REDUCE_SCATTER_SINGLE)(output, input, op=op, group=group, async_op=async_op)
