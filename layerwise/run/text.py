"""Your text, your tokenizer: `data=text data.path=PATH data.tokenizer=DIR`, tokenized once, cached.

1. documents: a `.txt` file is one document, a `.jsonl` line's "text" field one, a `.parquet` row's
   "text" column one (PATH: a file, or a directory read in sorted order);
2. each document is encoded by the Hugging Face tokenizer in DIR (`tokenizer.json`, local files
   only) and followed by the tokenizer's EOS, so documents never run into each other unmarked;
3. every round(1/validation_fraction)-th document goes to validation, the rest to train (as
   text_files splits by file), written as token memmaps (uint16 when the vocabulary fits, uint32
   otherwise: Llama 3's 128,256 do not) under a cache directory keyed by a hash of the files'
   bytes, the tokenizer's files and the split, so a second run reads them without tokenizing.
The launching process tokenizes before any rank starts (layerwise/run/fit.py); ranks only read.
"""

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

SUFFIXES = (".txt", ".jsonl", ".parquet")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
UINT16_VOCABULARY = 2**16


def token_dtype(vocab_size: int):
    """uint16 when every id fits (nanoGPT's format), else uint32."""
    return np.uint16 if vocab_size <= UINT16_VOCABULARY else np.uint32


def text_files(path) -> list:
    """The .txt/.jsonl/.parquet files at `path` (a file or a directory), sorted by relative path."""
    root = Path(path).expanduser()
    if not root.exists():
        raise ValueError(f"data.path: {root} does not exist; point it at a .txt/.jsonl/.parquet file or a "
                         f"directory of them")
    if root.is_file():
        return [root]
    files = sorted((file for file in root.rglob("*") if file.is_file() and file.suffix in SUFFIXES
                    and not any(part.startswith(".") for part in file.relative_to(root).parts)),
                   key=lambda file: file.relative_to(root).as_posix())
    if not files:
        raise ValueError(f"data.path: {root} holds no {', '.join(SUFFIXES)} files")
    return files


def documents(file: Path):
    """The documents of one file, in order."""
    if file.suffix == ".jsonl":
        with file.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    record = json.loads(line)
                    if "text" not in record:
                        raise ValueError(f"data.path: {file} line {number} has no \"text\" field")
                    yield record["text"]
    elif file.suffix == ".parquet":
        try:
            import pyarrow.parquet as parquet
        except ImportError as error:
            raise ValueError(f"data.path: {file} is parquet, which needs pyarrow (pip install pyarrow)") from error
        table = parquet.ParquetFile(file)
        if "text" not in table.schema_arrow.names:
            raise ValueError(f"data.path: {file} has no \"text\" column (it has: "
                             f"{', '.join(table.schema_arrow.names)})")
        for batch in table.iter_batches(columns=["text"]):
            yield from batch.column("text").to_pylist()
    else:
        yield file.read_text(encoding="utf-8", errors="replace")


def load_tokenizer(directory):
    """(tokenizers.Tokenizer, EOS id) from a Hugging Face tokenizer directory, local files only."""
    from tokenizers import Tokenizer
    directory = Path(directory).expanduser()
    if not (directory / "tokenizer.json").is_file():
        raise ValueError(f"data.tokenizer: {directory} has no tokenizer.json; point data.tokenizer at a "
                         f"Hugging Face tokenizer (or model) directory")
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    return tokenizer, eos_id(tokenizer, directory)


def eos_id(tokenizer, directory: Path) -> int:
    """The EOS token named by tokenizer_config.json / special_tokens_map.json, else config.json's id."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        file = directory / name
        token = json.loads(file.read_text()).get("eos_token") if file.is_file() else None
        token = token.get("content") if isinstance(token, dict) else token
        if token is not None and tokenizer.token_to_id(token) is not None:
            return tokenizer.token_to_id(token)
    config = directory / "config.json"
    if config.is_file() and isinstance(json.loads(config.read_text()).get("eos_token_id"), int):
        return json.loads(config.read_text())["eos_token_id"]
    raise ValueError(f"data.tokenizer: {directory} names no EOS token (eos_token in tokenizer_config.json); "
                     f"documents are joined with it. Fix: add \"eos_token\" to its tokenizer_config.json")


def cache_key(files: list, tokenizer_directory, validation_fraction: float) -> str:
    """sha256 of every file's name and bytes, the tokenizer's files and the split."""
    digest = hashlib.sha256(f"v1/{validation_fraction}".encode())
    for file in files:
        digest.update(file.name.encode())
        with file.open("rb") as handle:
            for chunk in iter(lambda: handle.read(2**20), b""):
                digest.update(chunk)
    for name in TOKENIZER_FILES:
        file = Path(tokenizer_directory).expanduser() / name
        if file.is_file():
            digest.update(name.encode() + file.read_bytes())
    return digest.hexdigest()[:20]


def cache_root(cache_dir=None) -> Path:
    """data.cache_dir, else $LAYERWISE_CACHE/tokens, else ~/.cache/layerwise/tokens."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    return Path(os.environ.get("LAYERWISE_CACHE", Path.home() / ".cache" / "layerwise")) / "tokens"


def tokenized(path, tokenizer_directory, validation_fraction: float, cache_dir=None, say=print) -> Path:
    """The cache directory holding train.bin, val.bin and meta.json for this text and tokenizer;
    tokenizes (with progress lines) only when it is not there yet."""
    files = text_files(path)
    directory = cache_root(cache_dir) / cache_key(files, tokenizer_directory, validation_fraction)
    if (directory / "meta.json").is_file():
        say(f"tokens cached in {directory}: {describe(json.loads((directory / 'meta.json').read_text()))}")
        return directory
    tokenizer, eos = load_tokenizer(tokenizer_directory)
    vocabulary = tokenizer.get_vocab_size()
    dtype, stride = token_dtype(vocabulary), max(2, round(1.0 / validation_fraction))
    partial = directory.with_name(directory.name + f".partial{os.getpid()}")
    partial.mkdir(parents=True, exist_ok=True)
    counts = {"train": [0, 0], "validation": [0, 0]}  # documents, tokens
    started, index, last = time.perf_counter(), 0, [0.0]

    def progress(number: int, final: bool = False) -> None:  # a line every 5 s and at each file's end
        elapsed = time.perf_counter() - started
        if final or elapsed - last[0] > 5:
            last[0] = elapsed
            total = counts["train"][1] + counts["validation"][1]
            say(f"tokenizing: file {number}/{len(files)}, {index:,} documents, {total:,} tokens, "
                f"{total / max(elapsed, 1e-9):,.0f} tokens/s")

    with (partial / "train.bin").open("wb") as train, (partial / "val.bin").open("wb") as validation:
        for number, file in enumerate(files, 1):
            batch = []
            for text in documents(file):
                batch.append(text)
                if len(batch) == 256:
                    index = _write(tokenizer, batch, eos, dtype, index, stride, train, validation, counts)
                    batch = []
                    progress(number)
            index = _write(tokenizer, batch, eos, dtype, index, stride, train, validation, counts)
            progress(number, final=True)
    if index and not counts["train"][0]:  # a single document: hold out its tail instead
        _split_single(partial, dtype, validation_fraction, counts)
    meta = {"vocab_size": vocabulary, "dtype": np.dtype(dtype).name, "eos_id": eos, "files": len(files),
            "documents": {k: v[0] for k, v in counts.items()}, "tokens": {k: v[1] for k, v in counts.items()},
            "tokenize_seconds": round(time.perf_counter() - started, 3)}
    (partial / "meta.json").write_text(json.dumps(meta, indent=2))
    try:
        partial.rename(directory)  # atomic: a concurrent run sees the whole cache or none
    except OSError:  # another process finished first: theirs is the same
        pass
    say(f"tokenized into {directory}: {describe(meta)}")
    return directory


def _write(tokenizer, batch, eos, dtype, index, stride, train, validation, counts) -> int:
    for encoding in tokenizer.encode_batch(batch, add_special_tokens=False) if batch else ():
        ids = np.asarray(encoding.ids + [eos], dtype=dtype)
        split = "validation" if index % stride == 0 else "train"
        (validation if split == "validation" else train).write(ids.tobytes())
        counts[split][0] += 1
        counts[split][1] += len(ids)
        index += 1
    return index


def _split_single(directory: Path, dtype, validation_fraction: float, counts) -> None:
    tokens = np.fromfile(directory / "val.bin", dtype=dtype)
    cut = len(tokens) - max(1, round(validation_fraction * len(tokens)))
    tokens[:cut].tofile(directory / "train.bin")
    tokens[cut:].tofile(directory / "val.bin")
    counts["train"], counts["validation"] = [1, cut], [0, len(tokens) - cut]


def describe(meta: dict) -> str:
    """The printed split: documents and tokens of each."""
    documents, tokens = meta["documents"], meta["tokens"]
    return (f"train {documents['train']:,} documents / {tokens['train']:,} tokens, validation "
            f"{documents['validation']:,} documents / {tokens['validation']:,} tokens "
            f"({meta['dtype']}, vocabulary {meta['vocab_size']:,})")
