"""Portable checkpoints: any strategy's state under the plain model's names, readable by any other.

    checkpoints/last/           torch.distributed.checkpoint (DCP) directory, next to last.ckpt
        .metadata, __*.distcp   every tensor under its plain name, each rank's pieces at their offsets
        lightning.pt            what is not a tensor piece: loops, LR schedulers, callbacks (the
                                evidence history), optimizer hyper-parameters, step counters

Each rank describes what it holds as *pieces*: for every local parameter, which elements of which
plain parameter it holds (`local_pieces`): a pipeline stage whole tensors, a tensor-grid rank the
block its grid cut (the index tensor cut exactly as the weight was), a ZeRO rank the flat range of
its shard (through the grid's cut when one is composed), L2L its host copy. A piece becomes
rectangles of the plain tensor (`rectangles`: a flat range of a matrix is partial row, whole rows,
partial row; a grid block is merged into one rectangle per column range), written as the local
shards of a ShardedTensor at their offsets, so

1. save: every rank writes its own rectangles in parallel (dcp.save); the same rectangle held by
   several ranks (data replicas, copies on a tensor grid) is written once, by the lowest rank
   (DefaultSavePlanner(dedup_save_to_lowest_rank=True)), and DCP's global plan check refuses a
   checkpoint whose rectangles overlap or leave an element out;
2. load: every rank asks for the rectangles of the pieces the new strategy materialised, and DCP
   reads exactly those bytes from whichever files hold them (resharding by offsets); they are
   scattered back into the local parameters and optimizer state.

Optimizer state moves with its parameter: a per-element state (AdamW exp_avg, exp_avg_sq; SGD's
momentum buffer) has the parameter's pieces; a scalar (AdamW's step) is saved under each plain
parameter it covers. K-FAC's factors and inverses are not carried (they are per-layout matrices
of a stage's layers and a few steps stale by design): the resuming strategy rebuilds them with a
synchronous K-FAC step (strategies/kfac.py `KFACInCheckpoint`).
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from typing_extensions import override

from strategies.checkpoint.per_rank import CheckpointError, read_checkpoint_file, swap_in
from strategies.checkpoint.safe_load import UnsafeCheckpointError, dcp_load, dcp_metadata, read_dcp_tensors

SIDECAR = "lightning.pt"
MODEL, OPTIMIZER = "model.", "optimizer."
NOT_CARRIED = ("state_dict", "optimizer_states", "kfac")  # rebuilt from the pieces, or per layout


@dataclass
class Piece:
    """Elements `positions` of a local tensor (flat) are elements `indices` of plain tensor `name`."""

    name: str
    shape: tuple
    positions: torch.Tensor  # host: index bookkeeping, never on the device
    indices: torch.Tensor  # host


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
    except UnsafeCheckpointError as error:
        return [f"resume_from={path}: {error}"]
    except Exception as error:  # noqa: BLE001 - a damaged .metadata: say which file
        return [f"resume_from={path}: {resolved / '.metadata'} is unreadable ({type(error).__name__}). "
                f"Fix: resume from its previous checkpoint ({resolved.with_name('previous')})."]
    vocabulary = saved.get("embed.token.weight", (0,))[0]
    expected = expected_shapes(vocabulary)
    differ = sorted(name for name in set(saved) | set(expected) if saved.get(name) != expected.get(name))
    if differ:
        examples = ", ".join(f"{name} {saved.get(name)} saved vs {expected.get(name)} here" for name in differ[:3])
        return [f"resume_from={path} holds another model shape ({len(differ)} parameters differ: {examples}). "
                f"Fix: set model.* (layers, hidden, heads, mlp_ratio, max_sequence_length) to the values "
                f"of the run that wrote it (its config.yaml), or remove resume_from."]
    return []


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


def plain_indices(name: str, local_shape, grid) -> tuple:
    """(plain shape, flat plain index of each local element) of parameter `name` on this rank."""
    style, leaf = _style(name) if grid is not None else (None, None)
    if style is None:
        return tuple(local_shape), torch.arange(torch.Size(local_shape).numel())  # host
    from strategies.tensor_parallel.parallelize import cut
    shape = tuple(grid.full_shape(style, leaf, tuple(local_shape)))
    index = torch.arange(torch.Size(shape).numel()).reshape(shape)  # host: index bookkeeping
    return shape, cut(grid, style, leaf, index).reshape(-1)


def local_pieces(model, layout) -> dict:
    """{name of a parameter of `model`: [Piece]} for every parameter this rank holds."""
    grid, pieces = _grid(layout), {}
    for name, parameter in model.named_parameters():
        if not name.startswith("zero_shards."):
            shape, indices = plain_indices(name, parameter.shape, grid)
            positions = torch.arange(indices.numel())  # host: index bookkeeping, never on the device
            pieces[name] = [Piece(name, shape, positions, indices)]
    if getattr(model, "zero_shards", None) is not None:
        pieces.update(_zero_pieces(model.zero_shards, layout.index("data"), grid))
    return pieces


def _zero_pieces(container, data_rank: int, grid) -> dict:
    """A flat shard holds elements [r·S, (r+1)·S) of its entries flattened in order (sharding.py)."""
    pieces = {}
    for key, shard in container.shards.items():
        start, end, found = data_rank * shard.shard_size, (data_rank + 1) * shard.shard_size, []
        for entry in shard.entries:
            first, last = max(start, entry.offset), min(end, entry.offset + entry.numel)
            if first < last:
                shape, indices = plain_indices(entry.name, entry.shape, grid)
                positions = torch.arange(first - start, last - start)  # host: index bookkeeping
                found.append(Piece(entry.name, shape, positions,
                                   indices[first - entry.offset:last - entry.offset]))
        pieces[f"zero_shards.flat.{key}"] = found
    return pieces


# ----- pieces as rectangles of the plain tensor --------------------------------------------------

def rectangles(piece: Piece) -> list:
    """[(offsets, sizes, positions)] covering the piece: `positions` (row-major over the
    rectangle) are where its elements sit in the local flat tensor.

    Sorted by plain index, the piece splits into runs of consecutive elements; a run of a matrix
    is a partial row, whole rows and a partial row; rectangles with the same columns on adjacent
    rows are merged (a tensor-grid block is one rectangle, not one per row)."""
    order = torch.argsort(piece.indices)
    indices, positions = piece.indices[order], piece.positions[order]
    breaks = (torch.nonzero(indices[1:] != indices[:-1] + 1).reshape(-1) + 1).tolist()
    bounds = [0, *breaks, indices.numel()]
    columns = piece.shape[-1] if len(piece.shape) == 2 else None
    found = []
    for begin, end in zip(bounds[:-1], bounds[1:]):
        first = int(indices[begin])
        if columns is None:
            found.append([[first], [end - begin], positions[begin:end]])
            continue
        found.extend(_run_rectangles(first, end - begin, columns, positions[begin:end]))
    return _merge_rows(found) if columns is not None else [tuple(r) for r in found]


def _run_rectangles(first: int, length: int, columns: int, positions) -> list:
    """A flat run [first, first + length) of a matrix: partial row, whole rows, partial row."""
    found, done = [], 0
    while done < length:
        row, column = divmod(first + done, columns)
        if column == 0 and length - done >= columns:
            rows = (length - done) // columns
            found.append([[row, 0], [rows, columns], positions[done:done + rows * columns]])
            done += rows * columns
        else:
            width = min(columns - column, length - done)
            found.append([[row, column], [1, width], positions[done:done + width]])
            done += width
    return found


def _merge_rows(found: list) -> list:
    """Stack rectangles of equal column range on consecutive rows into one."""
    found.sort(key=lambda r: (r[0][1], r[1][1], r[0][0]))
    merged = []
    for offsets, sizes, positions in found:
        last = merged[-1] if merged else None
        if (last is not None and last[0][1] == offsets[1] and last[1][1] == sizes[1]
                and last[0][0] + last[1][0] == offsets[0]):
            last[1][0] += sizes[0]
            last[2] = torch.cat([last[2], positions])
        else:
            merged.append([list(offsets), list(sizes), positions])
    return [tuple(r) for r in merged]


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
    """This rank's pieces of the model and optimizer state, as a DCP state dict.

    `entries`: (DCP key, plain shape, the local flat tensor, [(offsets, sizes, positions)]);
    `gather()` copies the local values into fresh rectangle tensors (for saving, or as the buffers
    DCP loads into), `scatter()` copies loaded rectangles back into the local tensors."""

    def __init__(self, module, optimizers, layout, rank: int):
        self.rank, self.entries, self.scalars = rank, [], {}
        model = module.model
        self.pieces = local_pieces(model, layout)
        names = {id(parameter): name for name, parameter in model.named_parameters()}
        for name, parameter in model.named_parameters():
            self._add(MODEL, name, parameter.data, parameter.dtype)
        for optimizer in optimizers:
            for parameter in (p for group in optimizer.param_groups for p in group["params"]):
                for key, value in optimizer.state.get(parameter, {}).items():
                    self._add_state(names[id(parameter)], parameter, key, value)

    def _add(self, prefix: str, name: str, values, dtype, suffix: str = "") -> None:
        for piece in self.pieces.get(name, []):
            self.entries.append((f"{prefix}{piece.name}{suffix}", piece.shape, values.reshape(-1),
                                 rectangles(piece), dtype))

    def _add_state(self, name: str, parameter, key: str, value) -> None:
        if isinstance(value, torch.Tensor) and value.numel() == parameter.numel() and value.dim() > 0:
            self._add(OPTIMIZER, name, value, value.dtype, f".{key}")
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            for piece in self.pieces.get(name, []):  # one counter per parameter: equal on every holder
                self.scalars[f"{OPTIMIZER}{piece.name}.{key}"] = value
        else:
            raise CheckpointError(f"optimizer state {key!r} of {name} ({type(value).__name__}) has no "
                                  f"portable form: neither per element nor a scalar")

    def gather(self, world_size: int) -> dict:
        """{DCP key: ShardedTensor (several ranks) or plain tensor (one rank)} of the local values."""
        chunks = {}
        for key, shape, flat, found, dtype in self.entries:
            target = chunks.setdefault(key, (shape, dtype, []))[2]
            target.extend((offsets, flat[positions].reshape(sizes).clone()) for offsets, sizes, positions in found)
        state = {key: value.detach().clone() for key, value in self.scalars.items()}
        for key, (shape, dtype, found) in chunks.items():
            whole = len(found) == 1 and list(found[0][1].shape) == list(shape)
            state[key] = found[0][1] if world_size == 1 and whole else _sharded(shape, found, self.rank, dtype)
        return state

    @torch.no_grad()
    def scatter(self, state: dict) -> None:
        """Copy the loaded rectangles (and scalars) of `state` (made by `gather`) into the local tensors."""
        loaded = {}
        for key, value in state.items():
            shards = value.local_shards() if hasattr(value, "local_shards") else [None]
            loaded[key] = [value.reshape(-1) if shard is None else shard.tensor.reshape(-1) for shard in shards]
        cursor = {}
        for key, _, flat, found, _ in self.entries:
            for _, _, positions in found:
                index = cursor.get(key, 0)
                flat[positions] = loaded[key][index].to(flat.dtype)
                cursor[key] = index + 1
        for key, value in self.scalars.items():
            value.copy_(state[key])


# ----- save and load -----------------------------------------------------------------------------

def save_portable(strategy, checkpoint: dict, path) -> None:
    """Write the portable checkpoint `path` (a directory) atomically: into `path.tmp`, then swapped
    in by rank 0 after every rank wrote its pieces (the replaced one kept as `previous`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    state = PortableState(strategy.lightning_module, strategy.optimizers, strategy_layout(strategy),
                          strategy.global_rank)
    if strategy.global_rank == 0:
        import shutil
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
    strategy.barrier("portable checkpoint directory created")
    dcp.save(state.gather(strategy.world_size), checkpoint_id=str(temporary),
             planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
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
    saved = read_sidecar(path)
    if "model_depth" in saved:  # a grown model (progressive stacking): its blocks exist before they load
        strategy.lightning_module.grow_to(saved["model_depth"])
    optimizers = strategy.optimizers
    _initialise_optimizer_state(optimizers, saved.get("optimizer_state_keys", []))
    state = PortableState(strategy.lightning_module, optimizers, strategy_layout(strategy), strategy.global_rank)
    buffers = state.gather(strategy.world_size)
    dcp_load(buffers, path)
    state.scatter(buffers)
    checkpoint = {key: value for key, value in saved.items()
                  if key not in ("optimizer_param_groups", "optimizer_state_keys")}
    checkpoint["state_dict"] = strategy.lightning_module.state_dict()
    checkpoint["optimizer_states"] = [_with_groups(optimizer.state_dict(), groups, path) for optimizer, groups
                                      in zip(optimizers, saved.get("optimizer_param_groups", []))]
    return checkpoint


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
