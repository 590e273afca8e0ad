"""Portable checkpoints: any strategy's state under the plain model's names, readable by any other.

    checkpoints/last/           torch.distributed.checkpoint (DCP) directory, next to last.ckpt
        .metadata, __*.distcp   every tensor under its plain name, each rank's pieces at their offsets
        lightning.pt            what is not a tensor piece: loops, LR schedulers, callbacks (the
                                evidence history), optimizer hyper-parameters, step counters

Each rank describes what it holds as *pieces*: for every local parameter, which rectangles of
which plain parameter it holds (`local_pieces`): a pipeline stage whole tensors, a tensor-grid rank
the block its grid cut, a ZeRO rank the flat range of its shard (through the grid's cut when one is
composed), L2L its host copy. Nothing is computed element by element: where a local tensor lies in
its plain tensor (`placement`: origin, transposed or not, fused blocks reordered) is read from the
grid's own cut applied to a meta tensor, and a flat range of a matrix is a partial row, whole rows
and a partial row (`rectangles`). Each rectangle is a strided view of the local tensor, a local
shard of a ShardedTensor at its offsets, so

1. save: every rank writes its own rectangles in parallel (dcp.save); the same rectangle held by
   several ranks (data replicas, copies on a tensor grid) is written once, by the lowest rank
   (DefaultSavePlanner(dedup_save_to_lowest_rank=True)), and DCP's global plan check refuses a
   checkpoint whose rectangles overlap or leave an element out. Each rectangle goes to the host
   when DCP's writer asks for it (`HostStagingPlanner`): the save's extra device memory is one
   rectangle made dense, never a copy of the whole state;
2. load: every rank asks for the rectangles of the pieces the new strategy materialised, and DCP
   reads exactly those bytes from whichever files hold them (resharding by offsets), copying each
   into its view: straight into the local parameters and optimizer state.

Optimizer state moves with its parameter: a per-element state (AdamW exp_avg, exp_avg_sq; SGD's
momentum buffer) has the parameter's pieces; a scalar (AdamW's step) is saved under each plain
parameter it covers. K-FAC's factors and inverses are not carried (they are per-layout matrices
of a stage's layers and a few steps stale by design): the resuming strategy rebuilds them with a
synchronous K-FAC step (strategies/kfac.py `KFACInCheckpoint`).
"""

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from typing_extensions import override

from parallel.memory import ComputeMemoryMeter, host_side
from strategies.checkpoint.per_rank import CheckpointError, portable_problems, read_checkpoint_file, swap_in
from strategies.expert_parallel import expert_origin, expert_placements
from strategies.checkpoint.safe_load import (UnsafeCheckpointError, dcp_file_problems, dcp_load, dcp_metadata,
                                             read_dcp_tensors)

SIDECAR = "lightning.pt"
MODEL, OPTIMIZER = "model.", "optimizer."
NOT_CARRIED = ("state_dict", "optimizer_states", "kfac")  # rebuilt from the pieces, or per layout


def portable_path(path) -> Path:
    """The portable checkpoint beside a per-rank or single-file one: `last.ckpt` -> `last`."""
    path = Path(path)
    return path.with_suffix("") if path.suffix == ".ckpt" else path


def is_portable(path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file() and (path / SIDECAR).is_file()


def resolve_portable(path) -> Path:
    """The portable checkpoint `resume_from` names: itself, the one beside `last.ckpt`, or a run
    directory's `checkpoints/last`; a damaged or half-swapped one falls back to `previous`."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints" / "last"
    path = portable_path(path)
    previous = path.with_name("previous" if path.name == "last" else path.name + ".previous")
    for candidate in (path, previous):
        if is_portable(candidate):
            return candidate
    return path


def resume_errors(path, expected_shapes) -> list:
    """Why `resume_from=path` cannot start this run ([] if it can); `expected_shapes(vocabulary)`
    gives this config's plain parameter shapes for the checkpoint's vocabulary."""
    resolved = resolve_portable(path)
    if not Path(path).exists():
        return [f"resume_from={path} does not exist. Fix: give the portable checkpoint of another run, "
                f"runs/<run_name>/checkpoints/last (or its run directory), or remove resume_from."]
    if not is_portable(resolved):
        return [f"resume_from={path} is not a portable checkpoint (no {SIDECAR} and .metadata in "
                f"{resolved}). Fix: point it at runs/<run_name>/checkpoints/last, which every run writes "
                f"beside last.ckpt."]
    try:
        read_sidecar(resolved)  # refused here, before any process starts, if it would run code
        saved = plain_shapes(resolved)
        damage = dcp_file_problems(resolved)  # a missing or short shard: here, not as DCP's raw error in a rank
    except UnsafeCheckpointError as error:
        return [f"resume_from={path}: {error}"]
    except Exception as error:  # noqa: BLE001 - a damaged .metadata: say which file
        return [f"resume_from={path}: {resolved / '.metadata'} is unreadable ({type(error).__name__}). "
                f"{damage_fix(resolved)}"]
    if damage:
        return [f"resume_from={path}: {damaged_message(resolved, damage)}"]
    vocabulary = saved.get("embed.token.weight", (0,))[0]
    expected = expected_shapes(vocabulary)
    differ = sorted(name for name in set(saved) | set(expected) if saved.get(name) != expected.get(name))
    if differ:
        examples = ", ".join(f"{name} {saved.get(name)} saved vs {expected.get(name)} here" for name in differ[:3])
        return [f"resume_from={path} holds another model shape ({len(differ)} parameters differ: {examples}). "
                f"Fix: set model.* (layers, hidden, heads, mlp_ratio, max_sequence_length) to the values "
                f"of the run that wrote it (its config.yaml), or remove resume_from."]
    return []


def damaged_message(path: Path, problems: list) -> str:
    """A damaged portable checkpoint in one paragraph: which files, why it cannot load, the fix."""
    return (f"the portable checkpoint {path} is damaged: {'; '.join(problems)}. Its .metadata places "
            f"tensors there, so no resume can load them (an incomplete copy, or a file lost or cut short "
            f"on disk). {damage_fix(Path(path))}")


def damage_fix(path: Path) -> str:
    """What to resume from instead of the damaged portable checkpoint `path`, naming what exists:
    the intact portable checkpoint saved before it (`previous/`), and the per-rank copy saved with
    it (`last.ckpt`, same step, loadable only by the run that wrote it, in its layout)."""
    path = Path(path)
    fixes = []
    earlier = path.with_name("previous") if path.name == "last" else None
    if earlier is not None and earlier.is_dir() and not portable_problems(earlier):
        fixes.append(f"resume from the portable checkpoint saved before it: resume_from={earlier}")
    per_rank = path.with_name(path.name + ".ckpt")
    if per_rank.exists() and path.parent.name == "checkpoints":
        run = path.parent.parent
        fixes.append(f"continue the run that wrote it from its own copy of the same step, {per_rank}: "
                     f"rerun that run's command in its directory (hydra.run.dir={run}, with the overrides "
                     f"in {run / '.hydra' / 'overrides.yaml'}), its strategy and layout unchanged")
    if not fixes:
        return ("Fix: copy the checkpoint directory again, whole, from where it came from, or remove "
                "resume_from to start from scratch.")
    return "Fix: " + "; or ".join(fixes) + "."


# ----- what each rank holds ----------------------------------------------------------------------

def _grid(layout):
    if layout is None or layout.degrees.tensor == 1 or not getattr(layout, "tensor_grid", None):
        return None
    from strategies.tensor_parallel.grids import grid_of
    return grid_of(layout.tensor_grid, layout.degrees.tensor, layout.index("tensor"))


def _style(name: str):
    """(Style, leaf) of a plain parameter name under the tensor-parallel plan, or (None, None)."""
    from strategies.tensor_parallel.parallelize import plan_of_parts
    parts = name.split(".")
    part = ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]
    for module_name, style in plan_of_parts([part]).items():
        if name.startswith(module_name + "."):
            return style, parts[-1]
    return None, None


@dataclass(frozen=True)
class Placement:
    """Where a local tensor lies in its plain tensor of `shape`, from shapes and offsets alone.

    Local element (i, j) is element (origin[0] + i, origin[1] + j) of the plain tensor with dim 0
    reordered in blocks, or (origin[0] + j, origin[1] + i) when `transposed` (a 2-D/3-D grid cuts
    a weight's transpose); a 1-D tensor has i only. Reordered: row r lies in block r // `block`,
    which is plain block `order[r // block]` (a fused qkv output interleaved per grid part;
    `block` 0: no reordering)."""

    shape: tuple
    local_shape: tuple
    origin: tuple
    transposed: bool = False
    block: int = 0
    order: tuple = ()


def placement(name: str, local_shape, grid) -> Placement:
    """The Placement of local parameter `name` on this rank's grid position (None: whole).

    The grid's own cut (strategies/tensor_parallel/parallelize.py `cut`: interleave the fused
    outputs, then `grid.cut`) is applied to a meta tensor of the plain shape: chunks and transposes
    are views, whose storage offset and strides are the origin and orientation, with no memory.
    The interleave is a block permutation of dim 0, read from `interleave_fused` on one element per
    block."""
    style, leaf = _style(name) if grid is not None else (None, None)
    local_shape = tuple(local_shape)
    if style is None:
        return Placement(local_shape, local_shape, (0,) * len(local_shape))
    from strategies.tensor_parallel.grids import interleave_fused
    shape = tuple(grid.full_shape(style, leaf, local_shape))
    probe = torch.empty(shape, device="meta")  # meta: shapes, offsets and strides only
    local = grid.cut(style, leaf, probe)
    columns = shape[1] if len(shape) == 2 else 1
    transposed = len(shape) == 2 and columns > 1 and local.stride() == (1, columns)
    contiguous = (columns, 1)[:len(shape)]
    if (not (local is probe or local._base is probe) or tuple(local.shape) != local_shape
            or len(shape) > 2 or (not transposed and local.stride() != contiguous)):
        raise CheckpointError(f"{name}: the grid's cut of a {shape} parameter to {local_shape} is not a "
                              f"block of it; the portable format cannot describe this rank's piece. "
                              f"Fix: save with a layout whose grid cuts blocks (1d, 2d, 3d).")
    origin = divmod(local.storage_offset(), columns) if len(shape) == 2 else (local.storage_offset(),)
    fused = style.fused if style.kind == "linear" else 1
    if fused == 1:
        return Placement(shape, local_shape, tuple(origin), transposed)
    blocks = fused * grid.output_parts
    order = interleave_fused(torch.arange(blocks), fused, grid.output_parts)  # host: block ids
    return Placement(shape, local_shape, tuple(origin), transposed, shape[0] // blocks, tuple(order.tolist()))


@dataclass(frozen=True)
class Rectangle:
    """Plain elements [offsets, offsets + sizes) held locally as the strided view (`start`,
    `strides`) of the local flat tensor, row-major over the rectangle."""

    offsets: tuple
    sizes: tuple
    start: int
    strides: tuple

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """The rectangle's elements in the local flat tensor, as a view: no copy."""
        return flat.as_strided(self.sizes, self.strides, flat.storage_offset() + self.start)


@dataclass
class Piece:
    """Plain tensor `name` (of `shape`)'s rectangles that one local tensor holds."""

    name: str
    shape: tuple
    rectangles: list


def rectangles(where: Placement, begin: int, end: int, base: int = 0) -> list:
    """[Rectangle] of local elements [begin, end) (row-major in the local tensor), which sit at
    positions base + e of the local flat tensor.

    Analytic: the range is a partial row, whole rows and a partial row of the local matrix; each is
    a block of the plain tensor (transposed if the cut transposed), split where the fused blocks of
    dim 0 leave adjacent rows apart. At most 3 × (fused blocks) rectangles, whatever the size."""
    if begin == 0 and end == math.prod(where.local_shape) and where == Placement(where.shape, where.shape,
                                                                                 (0,) * len(where.shape)):
        return [Rectangle(where.origin, where.shape, base, _contiguous(where.shape))]  # whole, in place
    if len(where.local_shape) == 1:
        return _split_rows(where, (where.origin[0] + begin,), (end - begin,), base + begin, (1,))
    if len(where.local_shape) != 2:
        raise CheckpointError(f"a {len(where.local_shape)}-D parameter split into flat ranges has no portable "
                              f"form (pieces are rectangles of 1-D and 2-D tensors). Fix: keep it whole "
                              f"(outside ZeRO's flat shards).")
    columns, (row0, column0), found = where.local_shape[1], where.origin, []
    for row, column, rows, width in _runs(begin, end, columns):
        start = base + row * columns + column
        if where.transposed:  # local rows are plain columns
            found += _split_rows(where, (row0 + column, column0 + row), (width, rows), start, (1, columns))
        else:
            found += _split_rows(where, (row0 + row, column0 + column), (rows, width), start, (columns, 1))
    return found


def _contiguous(shape) -> tuple:
    """Row-major strides of `shape`."""
    return tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))


def _runs(begin: int, end: int, columns: int) -> list:
    """[(row, column, rows, width)]: flat range [begin, end) of a row-major matrix of `columns`
    columns as a partial row, whole rows and a partial row."""
    found = []
    while begin < end:
        row, column = divmod(begin, columns)
        if column == 0 and end - begin >= columns:
            rows = (end - begin) // columns
            found.append((row, 0, rows, columns))
            begin += rows * columns
        else:
            width = min(columns - column, end - begin)
            found.append((row, column, 1, width))
            begin += width
    return found


def _split_rows(where: Placement, offsets, sizes, start: int, strides) -> list:
    """The block at `offsets` of the reordered plain tensor, as rectangles of the plain one: rows
    cut where consecutive rows lie in blocks that are not adjacent in the plain tensor."""
    if not where.block:
        return [Rectangle(tuple(offsets), tuple(sizes), start, tuple(strides))]
    found, first, last = [], offsets[0], offsets[0] + sizes[0]
    while first < last:
        block, within = divmod(first, where.block)
        end = min(last, (block + 1) * where.block)
        while end < last and where.order[end // where.block] == where.order[block] + (end // where.block - block):
            end = min(last, end + where.block)
        plain = where.order[block] * where.block + within
        found.append(Rectangle((plain, *offsets[1:]), (end - first, *sizes[1:]),
                               start + (first - offsets[0]) * strides[0], tuple(strides)))
        first = end
    return found


def local_pieces(model, layout) -> dict:
    """{name of a parameter of `model`: [Piece]} for every parameter this rank holds."""
    grid, pieces = _grid(layout), {}
    experts = expert_placements(model)  # an expert-parallel rank's experts: a block of the plain [E, ...] tensor
    for name, parameter in model.named_parameters():
        if name in experts:
            shape, origin = experts[name]
            pieces[name] = [Piece(name, shape, [Rectangle(origin, tuple(parameter.shape), 0,
                                                          _contiguous(parameter.shape))])]
        elif not name.startswith("zero_shards."):
            where = placement(name, parameter.shape, grid)
            pieces[name] = [Piece(name, where.shape, rectangles(where, 0, parameter.numel()))]
    for name, buffer in persistent_buffers(model):  # saved state that is no parameter (an MoE's expert bias): whole
        pieces[name] = [Piece(name, tuple(buffer.shape), rectangles(Placement(tuple(buffer.shape), tuple(buffer.shape),
                                                                              (0,) * buffer.dim()), 0, buffer.numel()))]
    if getattr(model, "zero_shards", None) is not None:
        # the shard's index over data × context (strategies/zero_layered.py shards over data_context)
        replica = layout.group("data_context").ranks.index(layout.rank)
        pieces.update(_zero_pieces(model.zero_shards, replica, grid, layout, model))
    return pieces


def expert_rectangles(local_shape, first: int, begin: int, end: int, base: int = 0) -> list:
    """[Rectangle] of flat elements [begin, end) of a contiguous local tensor of experts
    [first, first + n) (shape (n, ...)), at positions base + e of the flat shard, in the plain
    [E, ...] tensor: boxes of whole experts, whole rows and partial rows (`_boxes`)."""
    strides = _contiguous(local_shape)
    return [Rectangle((first + offsets[0], *offsets[1:]), sizes, base + start, strides)
            for offsets, sizes, start in _boxes(tuple(local_shape), begin, end)]


def _boxes(shape: tuple, begin: int, end: int) -> list:
    """[(offsets, sizes, flat start)]: flat range [begin, end) of a row-major tensor of `shape` as boxes:
    a partial head along dim 0, the whole indices between, a partial tail (each partial one recursively)."""
    if len(shape) == 1:
        return [((begin,), (end - begin,), begin)]
    inner = math.prod(shape[1:])
    first, last = begin // inner, (end - 1) // inner
    if first == last:
        return [((first, *offsets), (1, *sizes), first * inner + start)
                for offsets, sizes, start in _boxes(shape[1:], begin - first * inner, end - first * inner)]
    found = []
    if begin % inner:
        found += _boxes(shape, begin, (first + 1) * inner)
        first += 1
    whole = end // inner
    if whole > first:
        found.append(((first, *(0,) * (len(shape) - 1)), (whole - first, *shape[1:]), first * inner))
    if end % inner:
        found += _boxes(shape, whole * inner, end)
    return found


def persistent_buffers(model) -> list:
    """(name, buffer) of the buffers `model`'s state dict holds (models/moe.py's expert_bias), in order."""
    found = []
    for prefix, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                found.append((f"{prefix}.{name}" if prefix else name, buffer))
    return found


def _zero_pieces(container, data_rank: int, grid, layout=None, model=None) -> dict:
    """A flat shard holds elements [r·S, (r+1)·S) of its entries flattened in order (sharding.py); r is
    this rank's index in the shard's own group where it has one (split experts: expert_data), and a
    split expert's elements lie in its block of the plain [E, ...] tensor (`expert_rectangles`)."""
    pieces = {}
    for key, shard in container.shards.items():
        index = data_rank if getattr(shard, "group", None) is None else shard.group.ranks.index(layout.rank)
        start, end, found = index * shard.shard_size, (index + 1) * shard.shard_size, []
        for entry in shard.entries:
            first, last = max(start, entry.offset), min(end, entry.offset + entry.numel)
            origin = expert_origin(model, entry.name) if model is not None else None
            if first < last and origin is not None:
                found.append(Piece(entry.name, (origin[1], *entry.shape[1:]), expert_rectangles(
                    entry.shape, origin[0], first - entry.offset, last - entry.offset, base=entry.offset - start)))
            elif first < last:
                where = placement(entry.name, entry.shape, grid)
                found.append(Piece(entry.name, where.shape, rectangles(
                    where, first - entry.offset, last - entry.offset, base=entry.offset - start)))
        pieces[f"zero_shards.flat.{key}"] = found
    return pieces


def _sharded(shape, chunks: list, rank: int, dtype):
    """A ShardedTensor of these local (offsets, tensor) chunks of a plain tensor of `shape`.

    DCP reads only a ShardedTensor's local shards and its global size; the global shard list
    (which ShardedTensor insists covers the tensor) is one placeholder covering all of it."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.api import ShardedTensorBase
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
    shards = [Shard(tensor, ShardMetadata(list(offsets), list(tensor.shape), f"rank:{rank}/{tensor.device}"))
              for offsets, tensor in chunks]
    placeholder = ShardMetadata([0] * len(shape), list(shape), f"rank:{rank}/{chunks[0][1].device}")
    metadata = ShardedTensorMetadata([placeholder], torch.Size(shape), TensorProperties(dtype=dtype))
    tensor = ShardedTensorBase._init_from_local_shards_and_global_metadata(shards, metadata)
    assert isinstance(tensor, ShardedTensor)
    tensor._process_group = None  # the planner's .size() dispatches through it; no collective runs
    return tensor


# ----- the portable state of one rank ------------------------------------------------------------

class PortableState:
    """This rank's pieces of the model and optimizer state, as a DCP state dict of views.

    `entries`: (DCP key, plain shape, the local flat tensor, [Rectangle], dtype). `views()` gives
    each rectangle as a view of the local tensor (no copy): DCP saves from them through
    `HostStagingPlanner` (one rectangle staged to the host at a time) and loads into them in place.
    `optimizer_pieces` ({id(optimizer parameter): (name, model parameter, begin, end)}, the strategy's
    `optimizer_pieces()`) names the optimizer parameters that hold a flat range of a model parameter
    (the distributed optimizer's shards): their state is saved as that range's rectangles."""

    def __init__(self, module, optimizers, layout, rank: int, optimizer_pieces: dict = None):
        self.rank, self.entries, self.scalars = rank, [], {}
        model, self.grid = module.model, _grid(layout)
        self.model = model
        self.pieces = local_pieces(model, layout)
        names = {id(parameter): name for name, parameter in model.named_parameters()}
        for name, parameter in model.named_parameters():
            self._add(MODEL, name, parameter.data, parameter.dtype)
        for name, buffer in persistent_buffers(model):
            self._add(MODEL, name, buffer, buffer.dtype)
        optimizer_pieces = optimizer_pieces or {}
        for optimizer in optimizers:
            for parameter in (p for group in optimizer.param_groups for p in group["params"]):
                for key, value in optimizer.state.get(parameter, {}).items():
                    if id(parameter) in optimizer_pieces:
                        self._add_range_state(*optimizer_pieces[id(parameter)], key, value)
                    else:
                        self._add_state(names[id(parameter)], parameter, key, value)

    def _add(self, prefix: str, name: str, values, dtype, suffix: str = "") -> None:
        if not values.is_contiguous():
            raise CheckpointError(f"{prefix}{name}{suffix} is not contiguous: its rectangles are views of "
                                  f"its flat storage. Fix: keep parameters and optimizer state contiguous.")
        for piece in self.pieces.get(name, []):
            self.entries.append((f"{prefix}{piece.name}{suffix}", piece.shape, values.view(-1),
                                 piece.rectangles, dtype))

    def _add_state(self, name: str, parameter, key: str, value) -> None:
        if isinstance(value, torch.Tensor) and value.numel() == parameter.numel() and value.dim() > 0:
            self._add(OPTIMIZER, name, value, value.dtype, f".{key}")
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            for piece in self.pieces.get(name, []):  # one counter per parameter: equal on every holder
                self.scalars[f"{OPTIMIZER}{piece.name}.{key}"] = value
        else:
            raise CheckpointError(f"optimizer state {key!r} of {name} ({type(value).__name__}) has no "
                                  f"portable form: neither per element nor a scalar")

    def _add_range_state(self, name: str, parameter, begin: int, end: int, key: str, value) -> None:
        """State of an optimizer parameter holding flat elements [begin, end) of model parameter `name`."""
        if isinstance(value, torch.Tensor) and value.numel() == end - begin and value.dim() > 0:
            if not value.is_contiguous():
                raise CheckpointError(f"{OPTIMIZER}{name}.{key} is not contiguous. Fix: keep optimizer state contiguous.")
            origin = expert_origin(self.model, name)  # a split expert: its block of the plain [E, ...] tensor
            if origin is not None:
                self.entries.append((f"{OPTIMIZER}{name}.{key}", (origin[1], *parameter.shape[1:]), value.view(-1),
                                     expert_rectangles(parameter.shape, origin[0], begin, end, base=-begin), value.dtype))
                return
            where = placement(name, parameter.shape, self.grid)
            self.entries.append((f"{OPTIMIZER}{name}.{key}", where.shape, value.view(-1),
                                 rectangles(where, begin, end, base=-begin), value.dtype))  # element begin at 0
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            self.scalars[f"{OPTIMIZER}{name}.{key}"] = value  # one counter per parameter: equal on every holder
        else:
            raise CheckpointError(f"optimizer state {key!r} of {name}'s shard ({type(value).__name__}) has no "
                                  f"portable form: neither per element nor a scalar")

    def views(self, world_size: int) -> dict:
        """{DCP key: ShardedTensor (several ranks) or plain tensor (one rank)} whose local data are
        views of this rank's parameters and optimizer state (and the scalar counters themselves)."""
        chunks = {}
        for key, shape, flat, found, dtype in self.entries:
            chunks.setdefault(key, (shape, dtype, []))[2].extend((r.offsets, r.of(flat)) for r in found)
        state = {key: value.detach() for key, value in self.scalars.items()}
        for key, (shape, dtype, found) in chunks.items():
            whole = len(found) == 1 and list(found[0][1].shape) == list(shape)
            state[key] = found[0][1] if world_size == 1 and whole else _sharded(shape, found, self.rank, dtype)
        return state


def staged(view: torch.Tensor) -> torch.Tensor:
    """A rectangle's bytes in host memory, made when DCP's writer asks for this item.

    The one device allocation of the save is a strided view made dense (a grid block, a transposed
    weight; a contiguous view is used as it is), released when this returns: so the save's extra
    device memory is one rectangle, at most the largest local tensor. The host copy is host memory,
    DCP's to write and free (parallel/memory.py: never counted as the device's)."""
    dense = view.contiguous()
    with host_side():
        host = dense.to("cpu", copy=True)  # host: what DCP's writer serialises
    for meter in _active_meters():  # DCP's writer touches it (detach, views) outside host_side()
        meter.host(host)
    return host


def _active_meters() -> list:
    """The compute-side memory meters active in this thread (tests and mode=calibrate; none in a run)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    return [mode for mode in _get_current_dispatch_mode_stack() if isinstance(mode, ComputeMemoryMeter)]


def host_staging_planner():
    """DCP's DefaultSavePlanner (each rectangle written once, by the lowest rank holding it) whose
    `resolve_data` stages one item to the host when the writer asks for it, instead of every
    tensor being copied before `dcp.save` starts."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class HostStagingPlanner(DefaultSavePlanner):
        def resolve_data(self, write_item):
            data = super().resolve_data(write_item)
            return staged(data) if isinstance(data, torch.Tensor) else data

    return HostStagingPlanner(dedup_save_to_lowest_rank=True)


# ----- save and load -----------------------------------------------------------------------------

def save_portable(strategy, checkpoint: dict, path) -> None:
    """Write the portable checkpoint `path` (a directory) atomically: into `path.tmp`, then swapped
    in by rank 0 after every rank wrote its pieces (the replaced one kept as `previous`)."""
    import torch.distributed.checkpoint as dcp
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    state = PortableState(strategy.lightning_module, strategy.optimizers, strategy_layout(strategy),
                          strategy.global_rank, optimizer_pieces(strategy))
    if strategy.global_rank == 0:
        import shutil
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
    strategy.barrier("portable checkpoint directory created")
    dcp.save(state.views(strategy.world_size), checkpoint_id=str(temporary), planner=host_staging_planner())
    if strategy.global_rank == 0:
        torch.save(sidecar(checkpoint), temporary / SIDECAR)
        swap_in(temporary, path)
    strategy.barrier("portable checkpoint swapped in")


def sidecar(checkpoint: dict) -> dict:
    """Everything but the tensor pieces: loops, schedulers, callbacks, the optimizer's hyper-parameters."""
    kept = {key: value for key, value in checkpoint.items() if key not in NOT_CARRIED}
    kept["optimizer_param_groups"] = [[{k: v for k, v in group.items() if k != "params"}
                                       for group in state["param_groups"]]
                                      for state in checkpoint.get("optimizer_states", [])]
    kept["optimizer_state_keys"] = [sorted({key for value in state["state"].values() for key in value})
                                    for state in checkpoint.get("optimizer_states", [])]
    return kept


def strategy_layout(strategy):
    return getattr(strategy, "layout", None)


def optimizer_pieces(strategy) -> dict:
    """The strategy's `optimizer_pieces()` (PortableCheckpoints): {} for one that is not ours (a test's
    stand-in, any strategy without the mixin), whose optimizer holds whole parameters."""
    return strategy.optimizer_pieces() if isinstance(strategy, PortableCheckpoints) else {}


def _initialise_optimizer_state(optimizers, keys_by_optimizer) -> None:
    """Give each parameter the state keys the checkpoint has (zeros, to be overwritten): a fresh
    optimizer creates its state only at its first step."""
    for optimizer, keys in zip(optimizers, keys_by_optimizer):
        for parameter in (p for group in optimizer.param_groups for p in group["params"]):
            state = optimizer.state[parameter]
            for key in keys:
                if key not in state:
                    state[key] = (torch.zeros((), dtype=torch.float32, device=step_device(optimizer, parameter))
                                  if key == "step" else torch.zeros_like(parameter))


def step_device(optimizer, parameter) -> torch.device:
    """Where torch keeps an optimizer's `step` counter: on the host (read by .item() each step, no
    device sync), on the parameter's device only for capturable or fused optimizers."""
    on_device = optimizer.defaults.get("capturable") or optimizer.defaults.get("fused")
    return parameter.device if on_device else torch.device("cpu")


def load_portable(strategy, path) -> dict:
    """A Lightning checkpoint for this rank, read from the portable checkpoint `path` into the
    pieces this strategy materialised (the model and optimizers must exist: restore after setup)."""
    path = Path(path)
    damage = dcp_file_problems(path)  # validation checked it; checked again, a file may go since
    if damage:  # every rank sees the same files and stops alike, before any of DCP's collectives
        raise CheckpointError(damaged_message(path, damage))
    saved = read_sidecar(path)
    if "model_depth" in saved:  # a grown model (progressive stacking): its blocks exist before they load
        strategy.lightning_module.grow_to(saved["model_depth"])
    optimizers = strategy.optimizers
    _initialise_optimizer_state(optimizers, saved.get("optimizer_state_keys", []))
    state = PortableState(strategy.lightning_module, optimizers, strategy_layout(strategy), strategy.global_rank,
                          optimizer_pieces(strategy))
    try:
        dcp_load(state.views(strategy.world_size), path)  # in place: DCP copies each rectangle into its view
    except Exception as error:  # DCP's CheckpointException gathers every rank's failure, raised on all
        raise_load_failure(error, path)
    checkpoint = {key: value for key, value in saved.items()
                  if key not in ("optimizer_param_groups", "optimizer_state_keys")}
    checkpoint["state_dict"] = strategy.lightning_module.state_dict()
    checkpoint["optimizer_states"] = [_with_groups(optimizer.state_dict(), groups, path) for optimizer, groups
                                      in zip(optimizers, saved.get("optimizer_param_groups", []))]
    return checkpoint


def raise_load_failure(error: Exception, path: Path) -> None:
    """Re-raise DCP's `CheckpointException` (a dict of rank -> wrapped exception and traceback) as
    a CheckpointError naming the first failing rank and its error; a refusal to run code from a file
    stays an UnsafeCheckpointError (not damage)."""
    failures = getattr(error, "failures", None)
    if not failures:
        raise error
    rank, failure = min(failures.items(), key=lambda item: item[0])
    cause = getattr(failure, "exc", failure)
    if isinstance(cause, UnsafeCheckpointError):
        raise cause from error
    text = str(cause).splitlines()[0] if str(cause) else ""
    raise CheckpointError(f"the portable checkpoint {path} could not be read: rank {rank} failed with "
                          f"{type(cause).__name__}: {text}. {damage_fix(Path(path))}") from error


def read_sidecar(path) -> dict:
    """The portable checkpoint's `lightning.pt`: CRC-checked and read without running code, as every
    checkpoint file is (per_rank.read_checkpoint_file; a refusal is not damage and passes through)."""
    return read_checkpoint_file(Path(path) / SIDECAR)


def _with_groups(state: dict, saved_groups: list, path: Path) -> dict:
    """The live optimizer's state dict with the checkpoint's hyper-parameters (lr, betas, ...)."""
    if len(saved_groups) != len(state["param_groups"]):
        raise CheckpointError(f"{path}: {len(saved_groups)} optimizer parameter groups saved, this run "
                              f"has {len(state['param_groups'])}. Fix: resume with the same optimizer.")
    state["param_groups"] = [{**group, **saved, "params": group["params"]}
                             for group, saved in zip(state["param_groups"], saved_groups)]
    return state


def plain_shapes(path) -> dict:
    """{plain parameter name: shape} recorded in a portable checkpoint (validation reads it)."""
    metadata = dcp_metadata(path).state_dict_metadata
    return {key[len(MODEL):]: tuple(value.size) for key, value in metadata.items()
            if key.startswith(MODEL) and hasattr(value, "size")}


def read_portable(path, prefix: str = MODEL) -> dict:
    """Every tensor of a portable checkpoint whose key starts with `prefix` ("model.": the plain
    model's state dict; "optimizer.": its optimizer state), whole, read in this one process."""
    return read_dcp_tensors(path, prefix)


class PortableCheckpoints:
    """Strategy mixin: every checkpoint is also written portable beside it, and `resume_from` a
    portable checkpoint restores after setup, into whatever this strategy materialised."""

    portable_resume = False  # set by the run before fit when it resumes from a portable checkpoint
    portable_resumed_step = None  # the global step a portable resume started from

    def optimizer_pieces(self) -> dict:
        """{id(optimizer parameter): (model parameter name, model parameter, begin, end)} for optimizer
        parameters that hold a flat range of a model parameter (strategies/distributed_optimizer.py);
        {}: the optimizer holds whole model parameters."""
        return {}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True if self.portable_resume else super().restore_checkpoint_after_setup

    @override
    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)
        save_portable(self, checkpoint, portable_path(filepath))

    @override
    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        if not is_portable(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only)
        checkpoint = load_portable(self, checkpoint_path)
        self.portable_resumed_step = checkpoint.get("global_step")
        return checkpoint
