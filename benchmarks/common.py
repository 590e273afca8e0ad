"""What the benchmarks share: a config composed as train.py composes it, and forked gloo ranks.

The library's own pieces (layerwise.config.store.compose, layerwise.run.launch.run_ranks), never
tests/: a benchmark is a command line over the library. The point-to-point issue order is checked
on every step (`trainer.check_point_to_point_order`, NCCL's rule, parallel/comm.py), as in the
tests: the figures in docs/ were measured so.
"""

from layerwise.config.store import compose
from layerwise.run.launch import run_ranks

STRICT_POINT_TO_POINT = "trainer.check_point_to_point_order=true"
RANK_TIMEOUT_S = 300  # a rank that has not finished by then is killed and its traceback raised


def compose_config(*overrides: str):
    """conf/ composed with these overrides (the point-to-point check first, so one can turn it off)."""
    return compose([STRICT_POINT_TO_POINT, *overrides])


def run_on_ranks(function, world_size: int, *arguments):
    """`function(rank, *arguments)` on `world_size` forked gloo ranks; their return values."""
    return run_ranks(function, world_size, *arguments, timeout=RANK_TIMEOUT_S)
