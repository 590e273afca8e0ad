"""The torch versions we accept (pyproject: torch>=2.11,<2.14) and parallel/compat.py, the one place
their APIs differ. The suite runs on torch 2.13 (`make test`); `make smoke-torch211` runs the tests
marked `smoke` under torch 2.11 as well: these, and one run of each strategy family marked where it
lives (`pytest -m smoke --collect-only -q` lists them):

  tests/test_resume_matrix.py   [first]   ddp, modular_pipeline, zero_layered, tp_1d, l2l, three_d,
                                          each resuming the previous one's portable checkpoint, = single
  tests/test_pipefisher.py      [gpipe_pp2_m4_k2]  pipefisher = one-process kfac
  tests/test_zero_layered.py    [fsdp2_dp2_m4]     fsdp2 (torch's fully_shard) = single under SGD
  tests/test_zero_bubble_strategies.py  ZB-H1 over ZeRO (split backward), its bytes counted on
                                        torch.distributed's own names (layerwise/reproduce/measure.py)
  tests/test_hf.py              [tp_1d_p2]  a Hugging Face import, sliced per rank
  tests/test_training.py        a resume from Lightning's checkpoint, bit-identical
  tests/test_three_d.py         the 3-D operators' traffic, counted on torch.distributed's own names
"""

import ast
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from parallel import compat
from tests.ranks import run_on_ranks

pytestmark = pytest.mark.smoke

REPOSITORY = Path(__file__).resolve().parents[1]
LIBRARY = ("models", "parallel", "strategies", "cost", "layerwise", "hydra_plugins")
# torch.distributed's names for the single-tensor collectives, old (2.11, 2.12) and new (2.13).
VERSIONED = {"all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor"}


def declared_torch_range() -> tuple:
    """(lowest, highest excluded) minor versions from pyproject's `torch>=2.a,<2.b`."""
    text = (REPOSITORY / "pyproject.toml").read_text()
    low, high = re.search(r'"torch>=(\d+\.\d+),<(\d+\.\d+)"', text).groups()
    return tuple(map(int, low.split("."))), tuple(map(int, high.split(".")))


def test_the_installed_torch_is_one_we_accept():
    low, high = declared_torch_range()
    assert low == (2, 11) and high == (2, 14)
    installed = tuple(map(int, torch.__version__.split("+")[0].split(".")[:2]))
    assert low <= installed < high, f"torch {torch.__version__} is outside pyproject's torch>={low},<{high}"


def test_compat_names_collectives_this_torch_has_natively():
    """The name compat calls exists here, and it is the newest one: 2.13 keeps the old names as
    deprecated wrappers of the new, so calling the old would warn and (to a counter wrapping both)
    count twice."""
    for new, old, chosen in (("all_gather_single", "all_gather_into_tensor", compat.ALL_GATHER_SINGLE),
                             ("reduce_scatter_single", "reduce_scatter_tensor", compat.REDUCE_SCATTER_SINGLE)):
        assert hasattr(dist, chosen)
        assert chosen == (new if hasattr(dist, new) else old)


def library_files():
    yield REPOSITORY / "train.py"
    for top in LIBRARY:
        yield from sorted((REPOSITORY / top).rglob("*.py"))


def test_no_module_but_compat_calls_a_versioned_collective():
    """Every use of the single-tensor collectives goes through parallel/compat.py: an attribute
    named like one of them on anything but `compat` (dist.all_gather_single(...)) is a version
    branch waiting to break on the other torch."""
    found = []
    for path in library_files():
        if path == REPOSITORY / "parallel" / "compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in VERSIONED and \
                    not (isinstance(node.value, ast.Name) and node.value.id == "compat"):
                found.append(f"{path.relative_to(REPOSITORY)}:{node.lineno} .{node.attr}")
    assert found == []


def collectives_on_rank(rank: int) -> dict:
    """On 2 gloo ranks: compat's gather and reduce-scatter, synchronous and async, against the
    expected values; no FutureWarning (a deprecated name) raised; and a counter wrapping the name
    compat reports on torch.distributed sees each call once."""
    dist.init_process_group("gloo")
    calls = {name: 0 for name in compat.SINGLE_TENSOR_COLLECTIVES}
    for name in calls:
        original = getattr(dist, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)
        setattr(dist, name, counted)
    shard = torch.full((2, 3), float(rank + 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        gathered = torch.empty(4, 3)
        compat.all_gather_single(gathered, shard)
        posted = torch.empty(4, 3)
        compat.all_gather_single(posted, shard, async_op=True).wait()
        full = torch.arange(12.0).reshape(4, 3) * (rank + 1)  # ranks hold 1× and 2×: the sum is 3×
        mine = torch.empty(2, 3)
        compat.reduce_scatter_single(mine, full)
        largest = torch.empty(2, 3)
        compat.reduce_scatter_single(largest, full, op=dist.ReduceOp.MAX, async_op=True).wait()
    expected_gather = torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)])
    whole = torch.arange(12.0).reshape(4, 3)
    assert torch.equal(gathered, expected_gather) and torch.equal(posted, expected_gather)
    assert torch.equal(mine, (3 * whole).chunk(2)[rank])
    assert torch.equal(largest, (2 * whole).chunk(2)[rank])
    return calls


def test_compat_collectives_compute_and_are_counted_on_torchs_own_name():
    for calls in run_on_ranks(collectives_on_rank, 2):
        assert calls == {compat.ALL_GATHER_SINGLE: 2, compat.REDUCE_SCATTER_SINGLE: 2}
