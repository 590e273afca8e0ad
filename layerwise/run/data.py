"""Token streams and the deterministic batches every strategy trains on.

A corpus is two 1-D token tensors (train, validation). Global batch number i is a pure function of
(seed, split, i, global_batch_size, sequence_length, objective); a data-parallel rank takes its
contiguous slice of rows. So the data an optimizer step sees is the same under every strategy and
every data-parallel degree, which is what lets the numerics tests compare strategies exactly.
This file knows nothing about process groups: the rank and degree arrive as plain ints.
"""

import codecs
import functools
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from models.documents import documents_of
from layerwise.run.text import readable, skipped_words, token_dtype, tokenized

BYTE_VOCABULARY = 256
DEFAULT_MAX_BYTES = 16 * 2**20  # enough text to learn from, small enough to start in a second
MASK_FRACTION = 0.15  # BERT: share of positions per sequence the model must recover
SPLITS = ("train", "validation")
OBJECTIVES = ("causal", "masked")
CORPORA = ("stdlib", "text_files", "token_bin", "text")
TOKEN_BIN_FILES = ("train.bin", "val.bin")  # under data.path; layerwise/config/validate.py checks them first


class DataError(ValueError):
    """Bad data configuration; the message starts with the config field to change."""


@dataclass(frozen=True)
class Corpus:
    """Tokens of the train and validation splits (1-D integer tensors) and their vocabulary."""

    train: torch.Tensor
    validation: torch.Tensor
    vocab_size: int
    name: str
    eos_id: Optional[int] = None  # the id ending every document (data=text); None: no document boundaries known


# ----------------------------------------------------------------------------- loading


def configured_corpus(cfg, say=lambda message: None) -> Corpus:
    """The corpus the configuration's `data` group names: what a run and a dry run both train on."""
    data = cfg.data
    return load_corpus(data.corpus, path=data.path, max_bytes=data.max_bytes,
                       validation_fraction=data.validation_fraction, vocab_size=data.vocab_size,
                       tokenizer=data.get("tokenizer"), cache_dir=data.get("cache_dir"),
                       encoding=data.get("encoding", "utf-8"), say=say)


def load_corpus(kind: str, *, path: Optional[str] = None, max_bytes: Optional[int] = None,
                validation_fraction: float = 0.05, vocab_size: int = 50304, tokenizer: Optional[str] = None,
                cache_dir: Optional[str] = None, encoding: str = "utf-8", say=print) -> Corpus:
    """The corpus `kind` ("stdlib" | "text_files" | "token_bin" | "text"), split into train and validation.

    stdlib and text_files are read as bytes (vocabulary 256), at most `max_bytes` of them
    (default 16 MiB), and split by file. token_bin reads nanoGPT's train.bin / val.bin (uint16, or
    uint32 when vocab_size exceeds 65,536). text tokenizes .txt/.jsonl/.parquet documents with the
    Hugging Face tokenizer in `tokenizer`, once, into a cache of token memmaps (layerwise/run/text.py).
    text and text_files read their files in `encoding` (data.encoding) and skip, naming and counting
    them through `say`, the binary and undecodable ones (text.py's rule, `readable`).
    """
    if kind == "text":
        return _load_text(path, tokenizer, validation_fraction, cache_dir, say, encoding)
    max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    if kind == "stdlib":
        return _load_stdlib(max_bytes, validation_fraction)
    if kind == "text_files":
        return _load_text_files(path, max_bytes, validation_fraction, encoding, say)
    if kind == "token_bin":
        return _load_token_bin(path, vocab_size)
    raise DataError(f"data.corpus: unknown corpus {kind!r}; choose one of {', '.join(CORPORA)}")


@functools.lru_cache(maxsize=4)
def _load_stdlib(max_bytes: int, validation_fraction: float) -> Corpus:
    # Cached: the tests and every rank of a forked run load it many times, and it never changes.
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _files_under(root, lambda name: name.endswith(".py"), skip=("site-packages",))
    train, validation = _split_by_file(_read_files(files, max_bytes), validation_fraction)
    return Corpus(train, validation, BYTE_VOCABULARY, "stdlib")


def _load_text_files(path: Optional[str], max_bytes: int, validation_fraction: float, encoding: str = "utf-8",
                     say=print) -> Corpus:
    """Every text file under `path` as UTF-8 bytes: binary and undecodable files skipped (said),
    text in another `encoding` (latin-1) transcoded, so the byte model always sees UTF-8."""
    directory = _existing_directory(path, "text_files")
    files = [file for file in _files_under(directory, lambda name: True) if file.stat().st_size]
    if files:
        try:
            files, skipped, reasons = readable(files, directory, encoding, max_bytes)
        except ValueError as error:
            raise DataError(str(error)) from error
        if any(skipped.values()):
            say(f"data.path={directory}: {skipped_words(skipped, encoding)}: "
                + "; ".join(f"{name}: {why}" for name, why in list(reasons.items())[:3]))
    contents = _read_files(files, max_bytes, None if codecs.lookup(encoding).name == "utf-8" else encoding)
    if not any(contents):
        raise DataError(
            f"data.path: directory {directory} has no non-empty files; "
            "point data.path at a directory of text files (*.txt, *.md, *.py, ...)"
        )
    train, validation = _split_by_file(contents, validation_fraction)
    return Corpus(train, validation, BYTE_VOCABULARY, f"text_files:{directory}")


def _load_token_bin(path: Optional[str], vocab_size: int) -> Corpus:
    directory = _existing_directory(path, "token_bin")
    dtype = token_dtype(vocab_size)
    splits = [_memmap_tokens(directory / name, dtype) for name in TOKEN_BIN_FILES]
    return Corpus(splits[0], splits[1], vocab_size, f"token_bin:{directory}")


def _load_text(path, tokenizer, validation_fraction: float, cache_dir, say, encoding: str = "utf-8") -> Corpus:
    if not tokenizer:
        raise DataError("data.tokenizer is not set: data=text tokenizes with a Hugging Face tokenizer. "
                        "Fix: data.tokenizer=/a/tokenizer/or/model/directory")
    try:
        directory = tokenized(path, tokenizer, validation_fraction, cache_dir, say, encoding=encoding)
    except ValueError as error:
        raise DataError(str(error)) from error
    meta = json.loads((directory / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"]).type
    splits = [_memmap_tokens(directory / name, dtype) for name in TOKEN_BIN_FILES]
    return Corpus(splits[0], splits[1], meta["vocab_size"], f"text:{path}", eos_id=meta.get("eos_id"))


def _files_under(root: Path, wanted, skip=()) -> List[Path]:
    """Regular files under root whose name is `wanted`, sorted by relative path (stable everywhere).

    Hidden files and folders (.git, .DS_Store) are tooling, not text, and are left out. Folders
    named in `skip` are pruned before descending: the stdlib's site-packages is 6x the stdlib.
    """
    files = []
    for folder, folders, names in os.walk(root):
        folders[:] = [f for f in folders if f not in skip and not f.startswith(".")]
        files += [Path(folder, name) for name in names if not name.startswith(".") and wanted(name)]
    files = [file for file in files if file.is_file()]
    return sorted(files, key=lambda file: file.relative_to(root).as_posix())


def _existing_directory(path: Optional[str], kind: str) -> Path:
    if path is None:
        raise DataError(f"data.path: the {kind} corpus reads a directory; set data.path=/your/dir")
    directory = Path(path).expanduser()
    if not directory.exists():
        raise DataError(f"data.path: {directory} does not exist")
    if not directory.is_dir():
        raise DataError(f"data.path: {directory} is not a directory")
    return directory


def _memmap_tokens(file: Path, dtype=np.uint16) -> torch.Tensor:
    kind = np.dtype(dtype).name
    if not file.is_file():
        raise DataError(f"data.path: {file.parent} has no {file.name} (nanoGPT's format, {kind} here)")
    size = file.stat().st_size
    if size == 0 or size % np.dtype(dtype).itemsize != 0:
        raise DataError(f"data.path: {file} holds {size} bytes, not a non-empty {kind} array "
                        f"(uint16 when data.vocab_size <= 65536, else uint32)")
    # Copy-on-write mode: the tensor is writable as torch wants, and the file is never modified.
    return torch.from_numpy(np.memmap(file, dtype=dtype, mode="c"))


def _read_files(files: List[Path], max_bytes: int, encoding: Optional[str] = None) -> List[bytes]:
    """The files' bytes in order (decoded from `encoding` and re-encoded as UTF-8 when one is
    given), the last one cut so the total is at most max_bytes."""
    contents, total = [], 0
    for file in files:
        if total >= max_bytes:
            break
        data = file.read_bytes()
        data = (data.decode(encoding).encode("utf-8") if encoding else data)[: max_bytes - total]
        contents.append(data)
        total += len(data)
    return contents


def _split_by_file(contents: List[bytes], validation_fraction: float):
    """Every round(1/fraction)-th file (0, n, 2n, ...) goes to validation, the rest to train.

    Splitting by file rather than by position keeps near-duplicate windows out of both splits.
    A single file has nothing to split by, so its last `fraction` of bytes is held out instead.
    """
    if not 0.0 < validation_fraction < 1.0:
        raise DataError(
            f"data.validation_fraction: {validation_fraction} must be between 0 and 1 (exclusive)"
        )
    if len(contents) == 1:
        cut = len(contents[0]) - max(1, round(validation_fraction * len(contents[0])))
        return _bytes_tensor([contents[0][:cut]]), _bytes_tensor([contents[0][cut:]])
    stride = max(2, round(1.0 / validation_fraction))
    validation = [data for index, data in enumerate(contents) if index % stride == 0]
    train = [data for index, data in enumerate(contents) if index % stride != 0]
    return _bytes_tensor(train), _bytes_tensor(validation)


def _bytes_tensor(contents: List[bytes]) -> torch.Tensor:
    joined = b"".join(contents)
    if not joined:
        return torch.empty(0, dtype=torch.uint8)  # host: a corpus; frombuffer rejects an empty buffer
    # uint8 keeps 16 MiB of text at 16 MiB; bytearray because frombuffer wants a writable buffer.
    return torch.frombuffer(bytearray(joined), dtype=torch.uint8)


# ----------------------------------------------------------------------------- batches


def model_vocab_size(corpus: Corpus, objective: str) -> int:
    """The model's vocabulary: the corpus's, plus one [MASK] id (= corpus.vocab_size) for BERT."""
    _check_objective(objective)
    return corpus.vocab_size + (1 if objective == "masked" else 0)


def language_model_batch(corpus: Corpus, *, split: str, index: int, global_batch_size: int,
                         sequence_length: int, seed: int, objective: str, data_rank: int = 0,
                         data_degree: int = 1, packing: bool = False) -> dict:
    """This data rank's rows of global batch `index`: {"tokens", "targets"}, LongTensor[B/n, s].

    With `packing` (data.packing) also "documents" and "positions", LongTensor[B/n, s]: each token's
    document number in its row and its position in that document (models/documents.py documents_of,
    the EOS closing its document). The window is the same as without packing, so its first and last
    documents may be cut; every target is kept, the one after an EOS too (the EOS predicts the next
    document's first token, as in torchtitan): every row keeps s scored targets, so micro-batch means
    still average to the global mean under every strategy.

    The global batch depends on (seed, split, index, B, s, objective) only; rank r of n gets rows
    [r·B/n, (r+1)·B/n). So the n slices concatenated are exactly the data_degree=1 batch.
    """
    _check_objective(objective)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if global_batch_size < 1 or global_batch_size % data_degree != 0:
        raise DataError(
            f"data.global_batch_size: {global_batch_size} sequences cannot be divided evenly over "
            f"{data_degree} data-parallel ranks; use a positive multiple of {data_degree}"
        )
    if not 0 <= data_rank < data_degree:
        raise ValueError(f"data_rank {data_rank} is outside 0..{data_degree - 1}")
    tokens = corpus.train if split == "train" else corpus.validation
    _check_sequence_fits(corpus, split, tokens, sequence_length)

    # The whole global batch is drawn on every rank (cheap: B·s integers) so that no rank's rows
    # depend on how many rows the other ranks take.
    generator = torch.Generator(device="cpu").manual_seed(_batch_seed(seed, split, index))
    windows = _sample_windows(tokens, global_batch_size, sequence_length, generator)
    if objective == "causal":
        batch_tokens, targets = windows[:, :-1], windows[:, 1:]
    else:
        batch_tokens, targets = _mask_tokens(windows[:, :-1], corpus.vocab_size, generator)

    rows = global_batch_size // data_degree
    mine = slice(data_rank * rows, (data_rank + 1) * rows)
    batch = {"tokens": batch_tokens[mine].contiguous(), "targets": targets[mine].contiguous()}
    if packing:
        batch.update(_packed(corpus, objective, batch["tokens"]))
    return batch


def _packed(corpus: Corpus, objective: str, tokens: torch.Tensor) -> dict:
    """{"documents", "positions"} of EOS-joined rows (data.packing)."""
    if corpus.eos_id is None or objective != "causal":
        raise DataError(f"data.packing: corpus {corpus.name} marks no document ends (or the objective "
                        f"{objective!r} is not causal). Fix: data=text with a tokenizer that names an EOS, "
                        "a causal model, or data.packing=false")
    documents = documents_of(tokens, corpus.eos_id)
    return {"documents": documents.ids, "positions": documents.positions}


def _check_objective(objective: str) -> None:
    if objective not in OBJECTIVES:
        raise DataError(
            f"objective: unknown {objective!r}; use 'causal' (model.architecture=gpt) "
            "or 'masked' (model.architecture=bert)"
        )


def _check_sequence_fits(corpus: Corpus, split: str, tokens: torch.Tensor,
                         sequence_length: int) -> None:
    # A window is sequence_length + 1 tokens: the inputs plus the one-token shift of the targets.
    if sequence_length < 1 or tokens.numel() < sequence_length + 1:
        raise DataError(
            f"data.sequence_length: {sequence_length} needs at least {sequence_length + 1} tokens "
            f"per split, but the {split} split of corpus {corpus.name} has {tokens.numel()} "
            f"(train {corpus.train.numel()}, validation {corpus.validation.numel()}); "
            "lower data.sequence_length or add more text"
        )


def _batch_seed(seed: int, split: str, index: int) -> int:
    digest = hashlib.sha256(f"{seed}/{split}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _sample_windows(tokens: torch.Tensor, batch: int, sequence_length: int,
                    generator: torch.Generator) -> torch.Tensor:
    """B random windows of sequence_length + 1 tokens, as int64 [B, s + 1]."""
    # Batches are cut on the host, as a DataLoader does; the strategy moves them to its device.
    offsets = torch.randint(0, tokens.numel() - sequence_length, (batch,), generator=generator)  # host: a loader's draw
    return torch.stack([tokens[o : o + sequence_length + 1] for o in offsets.tolist()]).long()


def _mask_tokens(tokens: torch.Tensor, mask_id: int, generator: torch.Generator):
    """BERT's corruption: per row, k = max(1, round(0.15·s)) distinct positions become targets.

    Of those positions 80% show [MASK], 10% a random token, 10% the original token.
    """
    batch, length = tokens.shape
    # A fixed count per row (not a coin flip per position) means every row, and so every
    # micro-batch, has the same number of scored targets: the mean of micro-batch mean losses is
    # then exactly the global mean loss, whatever the micro-batching or data-parallel split.
    count = max(1, round(MASK_FRACTION * length))
    positions = torch.rand(batch, length, generator=generator).argsort(dim=1)[:, :count]  # host: data
    choice = torch.rand(batch, count, generator=generator)  # host: data
    random_tokens = torch.randint(0, mask_id, (batch, count), generator=generator)  # host: data

    originals = tokens.gather(1, positions)
    replacement = torch.where(choice < 0.8, torch.full_like(originals, mask_id),
                              torch.where(choice < 0.9, random_tokens, originals))
    targets = torch.full_like(tokens, -100).scatter(1, positions, originals)
    return tokens.clone().scatter(1, positions, replacement), targets


# ----------------------------------------------------------------------------- datasets


class TrainBatches(IterableDataset):
    """Global batches start_step, start_step + 1, ... of the train split, this rank's rows, forever.

    Set `start_step` to trainer.global_step on resume so the data continues where it stopped.
    Use with DataLoader(batch_size=None, num_workers=0): each item is already a batch.
    """

    def __init__(self, corpus: Corpus, *, global_batch_size: int, sequence_length: int,
                 seed: int, objective: str, data_rank: int = 0, data_degree: int = 1,
                 start_step: int = 0, packing: bool = False):
        self.corpus = corpus
        self.options = dict(global_batch_size=global_batch_size, sequence_length=sequence_length,
                            seed=seed, objective=objective, data_rank=data_rank,
                            data_degree=data_degree, packing=packing)
        self.start_step = start_step
        # Fail at construction, before any process starts training, not at the first step.
        language_model_batch(corpus, split="train", index=0, **self.options)

    def __iter__(self) -> Iterator[dict]:
        index = self.start_step
        while True:
            yield language_model_batch(self.corpus, split="train", index=index, **self.options)
            index += 1


class ValidationBatches(Dataset):
    """The first `batches` global batches of the validation split, this rank's rows: fixed."""

    def __init__(self, corpus: Corpus, *, batches: int, global_batch_size: int,
                 sequence_length: int, seed: int, objective: str, data_rank: int = 0,
                 data_degree: int = 1, packing: bool = False):
        self.corpus = corpus
        self.batches = batches
        self.options = dict(global_batch_size=global_batch_size, sequence_length=sequence_length,
                            seed=seed, objective=objective, data_rank=data_rank,
                            data_degree=data_degree, packing=packing)
        language_model_batch(corpus, split="validation", index=0, **self.options)

    def __len__(self) -> int:
        return self.batches

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.batches:
            raise IndexError(f"validation batch {index} outside 0..{self.batches - 1}")
        return language_model_batch(self.corpus, split="validation", index=index, **self.options)
