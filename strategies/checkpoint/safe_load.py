"""Reading checkpoints back without running code from them: the one loader every read goes through.

A pickle may name any importable callable, and unpickling calls it: a checkpoint read with plain
pickle or `torch.load(weights_only=False)` can run anything (Python's pickle documentation, "Restricting
Globals": https://docs.python.org/3/library/pickle.html#restricting-globals). Checkpoints travel
(a colleague's run directory, a shared file system, a downloaded model), so layerwise reads them as:

- `torch.save` files — `last.ckpt`, `previous.ckpt`, per-rank `rank{r}.pt`, the portable sidecar
  `lightning.pt`, fsdp2's `meta.pt`, DCP's non-tensor items: `torch.load(weights_only=True)`, PyTorch's
  restricted unpickler (https://pytorch.org/docs/stable/notes/serialization.html#weights-only-unpickler),
  which builds tensors, numbers, strings and containers and refuses every other global. Nothing is
  added to its allowlist (`TRUSTED_TYPES` is empty): every checkpoint layerwise writes holds only
  those (resolved configs are never pickled: `config.yaml` is YAML text, export's metadata JSON).
- DCP's `.metadata` (a protocol-4 pickle that `torch.load` cannot read; DCP itself reads it with plain
  `pickle.load`): `pickle.Unpickler` whose `find_class` admits only DCP's own metadata records
  (`dcp_metadata_types`), as the pickle documentation above recommends.
- DCP's tensor bytes: DCP reads them with `torch.load(weights_only=True)` itself.

A file that needs anything else is refused with `UnsafeCheckpointError`, naming the file, the types
it asked for and what to do; nothing from it was run or loaded.
"""

import pickle
from pathlib import Path

import torch

# Types added to torch.load's weights-only allowlist, for the duration of one load only (the scoped
# `torch.serialization.safe_globals`, never the process-wide add_safe_globals). Empty: layerwise's
# checkpoints need none (tests/test_safe_load.py loads every strategy's files with this loader).
TRUSTED_TYPES = ()

DOCS = "docs/reliability.md, section Security"


class UnsafeCheckpointError(ValueError):
    """A checkpoint asks to import and call something beyond tensors and plain data: refused.

    A ValueError, not a CheckpointError: a refused `last` is not damage, so a resume stops here
    instead of falling back to `previous` (the files beside it may have been tampered with too)."""


def refusal(file, types) -> UnsafeCheckpointError:
    """The error for a refused file: which file, what it wanted, what to do."""
    wanted = ", ".join(sorted(types)) or "a pickle operation outside the tensor-and-data subset"
    return UnsafeCheckpointError(
        f"refused to load {file}: it asks to import and call {wanted}, which no checkpoint written by "
        f"layerwise contains (checkpoints hold tensors, numbers, strings, lists and dicts; {DOCS}). "
        f"Nothing in it was run and nothing was loaded. Fix: if you did not make this file, delete it "
        f"and do not use its directory. If it is yours and written by another tool, re-save only its "
        f"tensors and plain values (a state dict) from a Python session you trust, then point layerwise "
        f"at that copy; a checkpoint of any layerwise version loads as it is.")


def load_torch_file(file, name=None):
    """`torch.load` of one torch.save file (a path or a seekable stream) that runs no code from it.

    `name` says what the file is in the error when `file` is a stream (a DCP item)."""
    with torch.serialization.safe_globals(list(TRUSTED_TYPES)):
        try:
            return torch.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            if "Weights only load failed" not in str(error):
                raise  # truncated or overwritten: damage (strategies/checkpoint/per_rank.py falls back)
            raise refusal(name or file, _unsafe_globals(file)) from None


def _unsafe_globals(file) -> list:
    """Every global of `file` outside the allowlist, listed from its opcodes without loading it."""
    if hasattr(file, "seek"):
        file.seek(0)
    try:
        with torch.serialization.safe_globals(list(TRUSTED_TYPES)):
            return torch.serialization.get_unsafe_globals_in_checkpoint(file)
    except Exception:  # noqa: BLE001 - the refusal stands; only its detail is missing
        return []


# ----- torch.distributed.checkpoint ----------------------------------------------------------------

def dcp_metadata_types() -> dict:
    """{(module, name): object} a DCP `.metadata` pickle may name: DCP's metadata records (dataclasses
    and an enum: constructing one stores fields, runs nothing), torch.Size, dtypes, the layout lookup
    by name (`_get_layout`: a dictionary lookup) and the path type of `storage_meta.checkpoint_id`."""
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata
    records = [metadata.Metadata, metadata.TensorStorageMetadata, metadata.BytesStorageMetadata,
               metadata.ChunkStorageMetadata, metadata.TensorProperties, metadata.MetadataIndex,
               metadata.StorageMeta, metadata._MEM_FORMAT_ENCODING, filesystem._StorageInfo,
               torch.Size, torch.serialization._get_layout,
               pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath]
    allowed = {(record.__module__, record.__qualname__): record for record in records}
    allowed.update({("torch", name): value for name, value in vars(torch).items()
                    if isinstance(value, torch.dtype)})
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that resolves only DCP's metadata records (see dcp_metadata_types)."""

    def __init__(self, file, allowed: dict):
        super().__init__(file)
        self.allowed = allowed

    def find_class(self, module, name):
        found = self.allowed.get((module, name))
        if found is None:
            raise _Refused(f"{module}.{name}")
        return found


class _Refused(pickle.UnpicklingError):
    pass


def _metadata_reader():
    """FileSystemReader whose `.metadata` is read by _MetadataUnpickler (DCP's own uses pickle.load)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            # as FileSystemReader.read_metadata (torch 2.13), with the restricted unpickler
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as stream:
                try:
                    metadata = _MetadataUnpickler(stream, dcp_metadata_types()).load()
                except _Refused as refused:
                    raise refusal(path, [str(refused)]) from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader


def dcp_reader(path):
    """A DCP storage reader for the checkpoint directory `path` that runs no code from its files."""
    return _metadata_reader()(str(path))


def dcp_planner(path):
    """DCP's default load planner, reading non-tensor items with load_torch_file (DCP's own uses
    torch.load(weights_only=False)); only fsdp2's checkpoints have such items (optimizer groups)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            key = read_item.dest_index.fqn
            loaded = load_torch_file(value, name=f"{path} (item {key})")
            if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes
                set_element(self.original_state_dict, self.mappings[key], loaded)
            else:
                self.state_dict[key] = loaded

    return SafeLoadPlanner()


def dcp_load(state: dict, path, **options) -> None:
    """`torch.distributed.checkpoint.load` of `state` from `path` through the safe reader and planner."""
    import torch.distributed.checkpoint as dcp
    dcp.load(state, storage_reader=dcp_reader(path), planner=dcp_planner(path), **options)


def dcp_metadata(path):
    """The `.metadata` of the DCP checkpoint `path`, read safely."""
    return dcp_reader(path).read_metadata()


def dcp_file_problems(path, metadata=None) -> list:
    """What is wrong with the data files of the DCP checkpoint `path`, one line per file ([] if none).

    `.metadata` records, for every item, the file (`relative_path`) and the byte range (offset,
    length) that hold it; a file that is absent, or shorter than the end of its last range, would
    fail DCP's read on whichever rank asks for it, as a raw `CheckpointException` (a truncated file
    can also unpickle as garbage). Checking costs one stat per file, so validation does it before
    any process starts and the load again. DCP keeps no checksums: bytes overwritten in place at
    the same size are not seen here."""
    metadata = dcp_metadata(path) if metadata is None else metadata
    ends = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, end in sorted(ends.items()):
        file = Path(path) / name
        if not file.is_file():
            problems.append(f"{file} is missing")
        elif file.stat().st_size < end:
            problems.append(f"{file} is truncated ({file.stat().st_size} bytes; .metadata places data up "
                            f"to byte {end})")
    return problems


def read_dcp_tensors(path, prefix: str) -> dict:
    """Every tensor of the DCP checkpoint `path` whose key starts with `prefix`, whole, in this one
    process (export, validation and tests: no process group)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    metadata = dcp_metadata(path).state_dict_metadata
    state = {key: torch.empty(tuple(value.size), dtype=value.properties.dtype)  # host: offline reading
             for key, value in metadata.items()
             if key.startswith(prefix) and isinstance(value, TensorStorageMetadata)}
    dcp_load(state, Path(path), no_dist=True)
    return state
