"""The portable save (strategies/checkpoint/portable.py) stages one tensor at a time, and its
rectangles are exactly the elements each rank holds.

1. Peak: the save is run under the compute-side memory meter (parallel/memory.py) with the
   parameters and optimizer state registered as resident; every storage an operator creates during
   the save and not marked as host work counts. On a GPU the save's extra device memory is at most
   one rectangle staged to the host (a strided view copied contiguous on its way out), so the bound
   is the largest local tensor's bytes. The earlier save cloned every rectangle on the device and held
   them until `dcp.save` returned: +1x parameters and AdamW state.
2. Rectangles: for every tensor grid (1-D, 2-D, 3-D; fused qkv interleaved, transposed weights) and
   ZeRO flat ranges through them, each rectangle's local view holds exactly the plain elements of its
   offsets, the rectangles are disjoint and cover every local element once — checked against the
   element-by-element map (the grid's own `cut` applied to an index tensor).
"""

from types import SimpleNamespace

import pytest
import torch

from models import build_model
from parallel.memory import ComputeMemoryMeter
from strategies.checkpoint.portable import read_portable, save_portable


def trained_model(hidden=64):
    """A small GPT after one AdamW step: parameters, exp_avg and exp_avg_sq all exist."""
    model = build_model("gpt", vocab_size=64, sequence_length=16, layers=2, hidden=hidden, heads=2, mlp_ratio=4,
                        dropout=0.0, tie_embeddings=False, seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, 64, (2, 16), generator=generator) for _ in range(2))
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


class OneRank:
    """The parts of a strategy `save_portable` reads; `world_size` 2 makes every tensor a
    ShardedTensor (the multi-rank form) while this rank alone writes all of it."""

    def __init__(self, model, optimizer, world_size):
        self.lightning_module = SimpleNamespace(model=model, state_dict=model.state_dict)
        self.optimizers, self.layout = [optimizer], None
        self.global_rank, self.world_size = 0, world_size

    def barrier(self, name=None):
        pass


def resident_state(model, optimizer) -> list:
    return list(model.parameters()) + [value for state in optimizer.state.values() for value in state.values()
                                       if isinstance(value, torch.Tensor)]


@pytest.mark.parametrize("world_size", [1, 2], ids=["plain_tensors", "sharded_tensors"])
def test_the_portable_save_stages_one_tensor_at_a_time(tmp_path, world_size):
    model, optimizer = trained_model()
    resident = resident_state(model, optimizer)
    meter = ComputeMemoryMeter()
    meter.resident(resident)
    before = meter.live_bytes
    with meter:
        save_portable(OneRank(model, optimizer, world_size), {}, tmp_path / "last")
    extra, largest = meter.peak_bytes - before, max(tensor.nbytes for tensor in resident)
    state_bytes = sum(tensor.nbytes for tensor in resident)
    assert extra <= largest, (f"the portable save held {extra} bytes on the device beyond the state "
                              f"({state_bytes} bytes of parameters and AdamW state; bound: the largest "
                              f"tensor, {largest} bytes)")
    saved_parameters, saved_state = read_portable(tmp_path / "last"), read_portable(tmp_path / "last", "optimizer.")
    for name, parameter in model.named_parameters():
        assert torch.equal(saved_parameters[f"model.{name}"], parameter.detach()), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            saved = saved_state[f"optimizer.{name}.{key}"]
            assert torch.equal(saved, optimizer.state[parameter][key].reshape(saved.shape)), (name, key)


# ----- rectangles against the element-by-element map ---------------------------------------------

GRIDS = [("1d", 2, rank) for rank in range(2)] + [("2d", 4, rank) for rank in range(4)] + \
        [("3d", 8, rank) for rank in range(8)]


def plain_model(architecture):
    return build_model(architecture, vocab_size=64, sequence_length=16, layers=1, hidden=16, heads=2, mlp_ratio=4,
                       dropout=0.0, seed=1)


def cut_index(name, shape, grid):
    """Flat plain index of every local element: the grid's own cut of an index tensor (the map the
    rectangles replace), or the whole index where the plan does not split `name`."""
    from strategies.checkpoint.portable import _style
    from strategies.tensor_parallel.parallelize import cut
    index = torch.arange(torch.Size(shape).numel()).reshape(shape)
    style, leaf = _style(name)
    return index if style is None else cut(grid, style, leaf, index)


def ranges(count, columns):
    """Flat ranges [begin, end) of a local tensor a ZeRO shard may hold: whole, partial rows at both
    ends, within one row, whole rows only."""
    found = {(0, count), (1, count - 2), (columns + 3, count - columns // 2), (2, min(count, 5)),
             (columns, min(count, 3 * columns))}
    return sorted((begin, end) for begin, end in found if 0 <= begin < end <= count)


@pytest.mark.parametrize("architecture", ["gpt", "llama"])
@pytest.mark.parametrize("grid_name,degree,rank", GRIDS, ids=[f"{g}_t{r}" for g, _, r in GRIDS])
def test_rectangles_hold_exactly_the_elements_of_the_grids_cut(architecture, grid_name, degree, rank):
    from strategies.checkpoint.portable import placement, rectangles
    from strategies.tensor_parallel.grids import grid_of
    grid, base = grid_of(grid_name, degree, rank), 7
    for name, parameter in plain_model(architecture).named_parameters():
        index = cut_index(name, parameter.shape, grid)
        where = placement(name, index.shape, grid)
        assert where.shape == tuple(parameter.shape), name
        plain = torch.arange(parameter.numel()).reshape(parameter.shape)
        columns = index.shape[-1]
        for begin, end in ranges(index.numel(), columns):
            flat = torch.full((base + index.numel() + 3,), -1, dtype=torch.long)  # a ZeRO shard around it
            flat[base:base + index.numel()] = index.reshape(-1)
            covered = torch.zeros_like(flat)
            for rectangle in rectangles(where, begin, end, base):
                block = plain[tuple(slice(o, o + s) for o, s in zip(rectangle.offsets, rectangle.sizes))]
                assert torch.equal(rectangle.of(flat), block), (name, begin, end, rectangle)
                rectangle.of(covered).add_(1)
            expected = torch.zeros_like(flat)
            expected[base + begin:base + end] = 1
            assert torch.equal(covered, expected), (name, begin, end, "not each local element exactly once")


# ----- the staging bound where rectangles are strided (a 2-D grid's transposed weights) ----------

class GridLayout:
    """The parts of a layout local_pieces reads: a 2-D tensor grid of 4, this rank's position."""

    def __init__(self, rank):
        self.degrees, self.tensor_grid, self.rank = SimpleNamespace(tensor=4), "2d", rank

    def index(self, family):
        return self.rank if family == "tensor" else 0


def test_strided_rectangles_are_staged_one_at_a_time_and_load_in_place(tmp_path):
    """On a 2-D grid every weight is a transposed block: each rectangle is made dense on the device
    before it goes to the host. The extra device peak stays one rectangle (at most a weight's
    block), not the sum; a fresh rank loads the same rectangles back into its views in place."""
    from strategies.checkpoint.portable import load_portable
    from strategies.tensor_parallel.grids import grid_of
    grid = grid_of("2d", 4, 1)
    saved_model, saved_optimizer = grid_rank(grid, generator_seed=0)
    resident = resident_state(saved_model, saved_optimizer)
    strategy = OneRank(saved_model, saved_optimizer, world_size=2)
    strategy.layout = GridLayout(1)
    meter = ComputeMemoryMeter()
    meter.resident(resident)
    before = meter.live_bytes
    with meter:
        save_portable(strategy, {}, tmp_path / "last")
    extra, largest = meter.peak_bytes - before, max(tensor.nbytes for tensor in resident)
    assert 0 < extra <= largest, f"extra device peak {extra} bytes; bound {largest} (one rectangle)"

    model, optimizer = grid_rank(grid, generator_seed=1)  # other values: the load must overwrite them
    strategy = OneRank(model, optimizer, world_size=2)
    strategy.layout = GridLayout(1)
    load_portable(strategy, tmp_path / "last")
    for (name, parameter), expected in zip(model.named_parameters(), saved_model.parameters()):
        assert torch.equal(parameter, expected), name
        for key, value in optimizer.state[parameter].items():
            assert torch.equal(value, saved_optimizer.state[expected][key]), (name, key)


def grid_rank(grid, generator_seed):
    """A small GPT as `grid`'s rank holds it (each parameter its cut, a transposed block for
    weights, under the plain names) after one AdamW step with seeded gradients."""
    model = plain_model("gpt")
    generator = torch.Generator().manual_seed(generator_seed)
    for name, parameter in model.named_parameters():
        index = cut_index(name, parameter.shape, grid)
        parameter.data = parameter.detach().reshape(-1)[index.reshape(-1)].reshape(index.shape)
        parameter.grad = torch.randn(parameter.shape, generator=generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer
