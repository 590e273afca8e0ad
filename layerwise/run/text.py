"""Your text, your tokenizer: `data=text data.path=PATH data.tokenizer=DIR`, tokenized once, cached.

1. documents: a `.txt` file is one document, a `.jsonl` line's "text" field one, a `.parquet` row's
   "text" column one (PATH: a file, or a directory read in sorted order);
2. each document is encoded by the Hugging Face tokenizer in DIR (`tokenizer.json`, local files
   only) and followed by the tokenizer's EOS, so documents never run into each other unmarked;
3. every round(1/validation_fraction)-th document goes to validation, the rest to train (as
   text_files splits by file), written as token memmaps (uint16 when the vocabulary fits, uint32
   otherwise: Llama 3's 128,256 do not) under a cache directory keyed by a hash of the files'
   bytes, the tokenizer's files, the split and the encoding, so a second run reads them without
   tokenizing.
The launching process tokenizes before any rank starts (layerwise/run/fit.py); ranks only read.

Text is checked as it is read (`unreadable`), by one rule: a .txt or .jsonl file is skipped, named
and counted in the printed summary (and in meta.json's "skipped") when it is
- binary: a NUL byte, or more than 30% control bytes other than tab, newline, CR, FF, VT, BS and ESC,
  in its first 8000 bytes (git's test for a NUL in the first 8000 bytes, Perl's -B share), or
- undecodable: not valid in `data.encoding` (default utf-8; latin-1 for Latin-1 corpora), rather
  than decoded with U+FFFD replacement characters the model would learn.
A corpus whose every file is skipped is refused. Progress is one line rewritten in place on a
terminal (a line every 30 s otherwise); an interrupted tokenization removes its `.partial`
directory, and one left by a killed run (its process gone) is removed by the next run.

Under torchrun/Slurm only global rank 0 hashes and tokenizes; every other rank learns the cache key
from it through a small handshake file in the cache directory (`learned_key`), named by a listing
of the files (`listing`: names, sizes, modification times — stat only, identical on every node of
a shared filesystem) and the launch. Rank 0 writes its progress there, then the key, or its error;
the others wait for it with a deadline that restarts at each sign of progress, and report rank 0's
error at once.
"""

import codecs
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path

import numpy as np

SUFFIXES = (".txt", ".jsonl", ".parquet")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
UINT16_VOCABULARY = 2**16
PROGRESS_S = 5.0  # rank 0 writes its progress to the handshake file at most this often
WAIT_S = 600.0  # a waiting rank's deadline without progress when the watchdog is off (0)
MIN_WAIT_S = 6 * PROGRESS_S  # never shorter: several of rank 0's progress writes fit in it
# A file modified this recently may change again within its filesystem's timestamp resolution
# (FAT: 2 s; git's "racily clean" entries): its key is not remembered from its listing.
RACY_NS = 2 * 10**9
KEYS = {}  # listing -> content key known in this process; forked ranks inherit it
BINARY_SAMPLE = 8000  # bytes sniffed for binary content: git's buffer_is_binary (xdiff-interface.c) reads 8000
CONTROL_SHARE = 0.30  # Perl's -B: a file whose first block is more than 30% odd characters is binary
TEXT_CONTROLS = frozenset(b"\t\n\r\f\v\b\x1b")  # control bytes plain text does hold
LINE_S = 30.0  # without a terminal, a progress line at most this often
REDRAW_S = 0.2  # on a terminal, the line is rewritten at most this often
PARTIAL = re.compile(r"\.partial(\d+)(?:@(.+))?$")  # <key>.partial<pid>@<host>: a tokenization under way


class TokenCacheError(RuntimeError):
    """A rank other than 0 could not learn the token cache's key: rank 0 failed, or went silent."""


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


def unreadable(file: Path, encoding: str = "utf-8"):
    """None when `file` is text in `encoding`; else ("binary" | "undecodable", why). Binary: a NUL
    byte (unless the encoding is UTF-16/32, whose text holds them) or more than CONTROL_SHARE
    control bytes in the first BINARY_SAMPLE bytes. Undecodable: the whole file, decoded
    incrementally 1 MiB at a time, raises in `encoding`. Parquet holds strings: never refused."""
    if file.suffix == ".parquet":
        return None
    wide = codecs.lookup(encoding).name.startswith(("utf-16", "utf-32"))
    decoder, offset = codecs.getincrementaldecoder(encoding)("strict"), 0
    with file.open("rb") as handle:
        for chunk in iter(lambda: handle.read(2**20), b""):
            if offset == 0 and not wide:
                sample = chunk[:BINARY_SAMPLE]
                if b"\0" in sample:
                    return "binary", f"NUL byte at offset {sample.index(0)}"
                controls = sum(1 for byte in sample if (byte < 32 or byte == 127) and byte not in TEXT_CONTROLS)
                if controls > CONTROL_SHARE * len(sample):
                    return "binary", f"{controls} of its first {len(sample)} bytes are control bytes"
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as error:
                return "undecodable", f"byte {offset + error.start} (0x{chunk[error.start]:02x}) is not {encoding}"
            offset += len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as error:
        return "undecodable", f"it ends inside a {encoding} character ({error.reason})"
    return None


def shown_name(file: Path, root) -> str:
    """`file` as the user knows it: relative to data.path when that is a directory."""
    root = Path(root).expanduser()
    return file.relative_to(root).as_posix() if root.is_dir() else file.name


def readable(files: list, root, encoding: str = "utf-8", max_bytes: int = None):
    """(the files that are text in `encoding`, {"binary": [names], "undecodable": [names]},
    {name: why}): the rule of this module's docstring. With `max_bytes` (data=text_files reads at
    most that much) the files after the kept ones reach it are neither read nor returned: a large
    directory is not read through for its first 16 MiB. Raises ValueError when none is left."""
    kept, skipped, reasons, total = [], {"binary": [], "undecodable": []}, {}, 0
    for file in files:
        if max_bytes is not None and total >= max_bytes:
            break
        problem = unreadable(file, encoding)
        total += file.stat().st_size if problem is None else 0
        if problem is None:
            kept.append(file)
            continue
        name = shown_name(file, root)
        skipped[problem[0]].append(name)
        reasons[name] = problem[1]
    if not kept:
        raise ValueError(f"data.path: every one of the {len(files)} files at {root} was skipped: "
                         f"{skipped_words(skipped, encoding)} ({'; '.join(f'{k}: {v}' for k, v in list(reasons.items())[:3])}). "
                         f"Fix: data.encoding=latin-1 (or the corpus's encoding) if the text is not UTF-8, "
                         f"or point data.path at text files.")
    return kept, skipped, reasons


def skipped_words(skipped: dict, encoding: str) -> str:
    """"skipped 1 binary file (ls.txt), 0 undecodable as utf-8": counts, and the first names."""
    def names(items):
        shown = ", ".join(items[:3]) + (f" and {len(items) - 3} more" if len(items) > 3 else "")
        return f" ({shown})" if items else ""
    binary, undecodable = skipped.get("binary", []), skipped.get("undecodable", [])
    return (f"skipped {len(binary)} binary file{'' if len(binary) == 1 else 's'}{names(binary)}, "
            f"{len(undecodable)} undecodable as {encoding}{names(undecodable)}")


def documents(file: Path, encoding: str = "utf-8"):
    """The documents of one file, in order, decoded strictly (a byte invalid in `encoding` raises:
    never a U+FFFD the model would learn; `readable` skips such files first)."""
    if file.suffix == ".jsonl":
        with file.open(encoding=encoding) as lines:
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
        yield file.read_text(encoding=encoding)


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
    """The EOS token named by tokenizer_config.json / special_tokens_map.json, else config.json's id
    (models/hf.py special_token_ids, which export and validation read too)."""
    from models.hf import special_token_ids  # torch and safetensors: only when a tokenizer is read
    eos = special_token_ids(directory, tokenizer.token_to_id)["eos"]
    if eos is None:
        raise ValueError(f"data.tokenizer: {directory} names no EOS token (eos_token in tokenizer_config.json); "
                         f"documents are joined with it. Fix: add \"eos_token\" to its tokenizer_config.json")
    return eos


def version(validation_fraction: float, encoding: str) -> str:
    """What keys a cache besides the bytes: the format (v2: files checked as they are read, skipped
    files counted), the split and the encoding (codecs' name: latin-1 and iso-8859-1 are one)."""
    return f"v2/{validation_fraction}/{codecs.lookup(encoding).name}"


def cache_key(files: list, tokenizer_directory, validation_fraction: float, progress=None,
              encoding: str = "utf-8") -> str:
    """sha256 of every file's name and bytes, the tokenizer's files, the split and the encoding.
    `progress(bytes=n)` is called after each MiB read (rank 0's sign of life to the waiting ranks)."""
    digest, hashed = hashlib.sha256(version(validation_fraction, encoding).encode()), 0
    for file in files:
        digest.update(file.name.encode())
        with file.open("rb") as handle:
            for chunk in iter(lambda: handle.read(2**20), b""):
                digest.update(chunk)
                hashed += len(chunk)
                if progress:
                    progress(bytes=hashed)
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


def listing(files: list, tokenizer_directory, validation_fraction: float, encoding: str = "utf-8") -> tuple:
    """(fingerprint, newest modification time in ns) of the corpus and tokenizer files, from their
    paths, sizes and modification times: rsync's quick check and git's index, read by stat alone.
    Every rank computes the same fingerprint on a shared filesystem without reading the bytes."""
    digest, newest = hashlib.sha256(version(validation_fraction, encoding).encode()), 0
    tokenizer = Path(tokenizer_directory).expanduser()
    for file in [*files, *(tokenizer / name for name in TOKENIZER_FILES)]:
        if not file.is_file():
            continue
        stat = file.stat()
        digest.update(f"{file.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
        newest = max(newest, stat.st_mtime_ns)
    return digest.hexdigest()[:20], newest


def launch_id():
    """What every process of this launch shares and the next launch does not: Slurm's job, step and
    requeue count, or torchrun's run id, restart count and rendezvous address; None outside them."""
    environ = os.environ
    if "SLURM_JOB_ID" in environ and "SLURM_PROCID" in environ:
        return "slurm:" + ".".join(environ.get(name, "") for name in ("SLURM_JOB_ID", "SLURM_STEP_ID",
                                                                      "SLURM_RESTART_COUNT"))
    if "TORCHELASTIC_RUN_ID" in environ:
        return "torchrun:" + ".".join(environ.get(name, "") for name in (
            "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT"))
    return None


def _global_rank() -> int:
    from layerwise.run.launch import global_rank  # launch imports torch and Lightning: only when asked
    return global_rank()


class Handshake:
    """Rank 0's word to the other ranks about one corpus listing in one launch: a JSON file under
    `<cache root>/handshakes/`, rewritten whole (temporary file, then rename) as its state moves
    from "hashing" to "tokenizing" (with counts) to "ready" (with the key) or "failed" (with the
    error). Without a launcher the name is `<listing>-local`: the launching process writes it
    for the ranks it starts."""

    def __init__(self, root: Path, fingerprint: str, launch=None):
        self.launch = launch
        name = hashlib.sha256(launch.encode()).hexdigest()[:12] if launch else "local"
        self.path = Path(root) / "handshakes" / f"{fingerprint}-{name}.json"
        self.last = 0.0

    def write(self, state: str, **fields) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps({"state": state, "launch": self.launch, **fields}))
        os.replace(temporary, self.path)
        self.last = time.monotonic()

    def progress(self, state: str, **counts) -> None:
        """write(state, counts), at most every PROGRESS_S."""
        if time.monotonic() - self.last >= PROGRESS_S:
            self.write(state, **counts)

    def read(self):
        """The record, or None while there is none (or it is being replaced)."""
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None


def wait_seconds(collective_timeout_s: float) -> float:
    """How long a rank waits for rank 0 without progress: trainer.collective_timeout_s (resolved;
    0 = the watchdog off: WAIT_S, since nothing else watches this wait), at least MIN_WAIT_S."""
    return max(collective_timeout_s or WAIT_S, MIN_WAIT_S)


def learned_key(path, tokenizer_directory, validation_fraction: float, cache_dir=None,
                timeout_s: float = WAIT_S, poll_s: float = 1.0, encoding: str = "utf-8") -> str:
    """The cache key global rank 0 of this launch computed for these files, read from its
    handshake file; this rank lists the files (stat) but never reads them. Waits while rank 0
    hashes and tokenizes; the deadline `timeout_s` restarts whenever the file changes. Raises
    TokenCacheError at once when rank 0 of this launch wrote that it failed, and at the deadline
    naming the launch, the cache directory and the fix."""
    files, root = text_files(path), cache_root(cache_dir)
    fingerprint, _ = listing(files, tokenizer_directory, validation_fraction, encoding)
    handshake = Handshake(root, fingerprint, launch_id())
    seen, since = None, time.monotonic()
    while True:
        record = handshake.read()
        if record != seen:
            seen, since = record, time.monotonic()
        state = (record or {}).get("state")
        if state == "ready" and (root / record["key"] / "meta.json").is_file():
            KEYS[fingerprint] = record["key"]
            return record["key"]
        if state == "failed":  # the file's name is this launch's: rank 0 replaced any earlier record
            raise TokenCacheError(f"rank {_global_rank()}: global rank 0 of {_described(handshake.launch)} failed "
                                  f"to tokenize data.path={path} into {root}: {record.get('error')} (written to "
                                  f"{handshake.path}). Fix the cause rank 0 names, then launch again.")
        if time.monotonic() - since > timeout_s:
            raise TokenCacheError(
                f"rank {_global_rank()}: no word for {timeout_s:g} s from global rank 0 of "
                f"{_described(handshake.launch)}, which tokenizes data.path={path} into {root} and writes "
                f"{handshake.path} (last seen: {json.dumps(record) if record else 'nothing'}). Either rank 0 "
                f"died or hangs (see its output), or it writes another directory than this rank reads: "
                f"data.cache_dir (or $LAYERWISE_CACHE) must be one directory every node shares. Fix: "
                f"data.cache_dir=/a/shared/path, or tokenize once before launching (a one-process run with "
                f"the same data settings), or raise trainer.collective_timeout_s if rank 0 is still working.")
        time.sleep(poll_s)


def _described(launch) -> str:
    if not launch:
        return "this launch"
    kind, _, fields = launch.partition(":")
    parts = fields.split(".")
    if kind == "slurm":
        return f"Slurm job {parts[0]} step {parts[1] or '?'} (requeue {parts[2] or 0})"
    return f"torchrun run {parts[0]} (restart {parts[1] or 0}, rendezvous {':'.join(parts[2:])})"


def tokenized(path, tokenizer_directory, validation_fraction: float, cache_dir=None, say=print,
              timeout_s: float = WAIT_S, encoding: str = "utf-8", stream=None) -> Path:
    """The cache directory holding train.bin, val.bin and meta.json for this text and tokenizer;
    tokenizes only when it is not there yet, its progress one line rewritten in place when
    `stream` (default sys.stdout) is a terminal, else a line via `say` every LINE_S. A rank other
    than global rank 0 never hashes: it takes the key this process already knows, or `learned_key`'s."""
    files, root = text_files(path), cache_root(cache_dir)
    fingerprint, newest = listing(files, tokenizer_directory, validation_fraction, encoding)
    key = KEYS.get(fingerprint)
    if key is None or not (root / key / "meta.json").is_file():
        if _global_rank() != 0:
            key = learned_key(path, tokenizer_directory, validation_fraction, cache_dir, timeout_s, encoding=encoding)
        else:
            corpus = TextSource(files, Path(path).expanduser(), encoding)
            return _rank_zero(corpus, tokenizer_directory, validation_fraction, root, (fingerprint, newest),
                              say, Progress(say, sys.stdout if stream is None else stream))
    directory = root / key
    say(f"tokens cached in {directory}: {describe(json.loads((directory / 'meta.json').read_text()))}")
    return directory


class TextSource:
    """The files to tokenize, the data.path they were listed from, and their encoding."""

    def __init__(self, files: list, root: Path, encoding: str):
        self.files, self.root, self.encoding = files, root, encoding


class Progress:
    """Tokenizing's progress: on a terminal one line, rewritten in place (carriage return) at most
    every REDRAW_S and ended with a newline; elsewhere (a pipe, a log file) a line through `say` at
    most every LINE_S and the last one. Before: a line at every file's end (301 lines for 301 files)."""

    def __init__(self, say, stream):
        isatty = getattr(stream, "isatty", None)
        self.say, self.stream, self.terminal = say, stream, bool(isatty and isatty())
        self.last, self.width, self.shown = time.monotonic(), 0, False

    def update(self, line: str, final: bool = False) -> None:
        now = time.monotonic()
        if self.terminal and (final or now - self.last >= REDRAW_S):
            self.stream.write("\r" + line.ljust(self.width) + ("\n" if final else ""))
            self.stream.flush()
            self.width, self.last, self.shown = len(line), now, not final
        elif not self.terminal and (final or now - self.last >= LINE_S):
            self.say(line)
            self.last = now

    def close(self) -> None:
        """End a line left open (an error interrupts it), so the next message starts on its own."""
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = False


def _rank_zero(corpus: TextSource, tokenizer_directory, validation_fraction, root, listed, say, progress) -> Path:
    """Hash, tokenize if the cache lacks this key, and tell the other ranks (Handshake): the key
    once the cache is whole, or the error."""
    handshake, started = Handshake(root, listed[0], launch_id()), time.time_ns()
    handshake.write("hashing")  # also replaces a record an earlier launch of the same id left
    try:
        key = cache_key(corpus.files, tokenizer_directory, validation_fraction,
                        lambda **counts: handshake.progress("hashing", **counts), corpus.encoding)
        if listed[1] < started - RACY_NS:  # no file changed since: its listing stands for its bytes
            KEYS[listed[0]] = key
        directory = root / key
        if (directory / "meta.json").is_file():
            say(f"tokens cached in {directory}: {describe(json.loads((directory / 'meta.json').read_text()))}")
        else:
            remove_stale_partials(root)
            _tokenize(corpus, tokenizer_directory, validation_fraction, directory, say,
                      lambda **counts: handshake.progress("tokenizing", **counts), progress)
    except BaseException as error:
        handshake.write("failed", error=f"{type(error).__name__}: {error}")
        raise
    handshake.write("ready", key=key)
    return directory


def partial_directory(directory: Path) -> Path:
    """Where this process writes `directory` before renaming it in: <key>.partial<pid>@<host>."""
    return directory.with_name(f"{directory.name}.partial{os.getpid()}@{socket.gethostname()}")


def remove_stale_partials(root: Path) -> list:
    """Remove the `.partial` directories of tokenizations whose process is gone (killed by SIGKILL
    or a crash of the machine: nothing of theirs ran to clean up), and return their names. A
    partial of this host is stale when its pid no longer exists (os.kill(pid, 0) raises
    ProcessLookupError); one without a host is from an older layerwise and taken as this host's;
    another host's is left alone (its pid means nothing here), however old."""
    removed, host = [], socket.gethostname()
    for entry in root.iterdir() if root.is_dir() else ():
        match = PARTIAL.search(entry.name)
        if not match or not entry.is_dir() or (match.group(2) or host) != host:
            continue
        try:
            os.kill(int(match.group(1)), 0)
            continue  # alive (or another user's: PermissionError below)
        except ProcessLookupError:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
        except (PermissionError, OverflowError):
            continue
    return removed


def _tokenize(corpus: TextSource, tokenizer_directory, validation_fraction: float, directory: Path, say, beat,
              progress: Progress) -> None:
    """Documents -> train.bin/val.bin/meta.json in `directory`, written aside and renamed in; on
    any failure or interrupt (KeyboardInterrupt, SIGTERM's SystemExit) the aside is removed."""
    files, skipped, reasons = readable(corpus.files, corpus.root, corpus.encoding)
    tokenizer, eos = load_tokenizer(tokenizer_directory)
    vocabulary = tokenizer.get_vocab_size()
    dtype, stride = token_dtype(vocabulary), max(2, round(1.0 / validation_fraction))
    partial = partial_directory(directory)
    partial.mkdir(parents=True, exist_ok=True)
    try:
        counts, started = _write_splits(files, corpus.encoding, tokenizer, eos, dtype, stride, partial, beat, progress)
        if counts["validation"][0] and not counts["train"][0]:  # a single document: hold out its tail instead
            _split_single(partial, dtype, validation_fraction, counts)
        meta = {"vocab_size": vocabulary, "dtype": np.dtype(dtype).name, "eos_id": eos, "files": len(files),
                "encoding": corpus.encoding, "skipped": skipped, "skip_reasons": reasons,
                "documents": {k: v[0] for k, v in counts.items()}, "tokens": {k: v[1] for k, v in counts.items()},
                "tokenize_seconds": round(time.perf_counter() - started, 3)}
        (partial / "meta.json").write_text(json.dumps(meta, indent=2))
        try:
            partial.rename(directory)  # atomic: a concurrent run sees the whole cache or none
        except OSError:  # another process finished first: theirs is the same
            shutil.rmtree(partial, ignore_errors=True)
    except BaseException:
        progress.close()
        shutil.rmtree(partial, ignore_errors=True)
        raise
    say(f"tokenized into {directory}: {describe(meta)}")


def _write_splits(files, encoding, tokenizer, eos, dtype, stride, partial: Path, beat, progress):
    """Every file's documents encoded, EOS-terminated, into partial/train.bin and val.bin; returns
    ({split: [documents, tokens]}, the perf_counter it started at)."""
    counts = {"train": [0, 0], "validation": [0, 0]}  # documents, tokens
    started, index = time.perf_counter(), 0

    def show(number: int, final: bool = False) -> None:
        elapsed = time.perf_counter() - started
        total = counts["train"][1] + counts["validation"][1]
        progress.update(f"tokenizing: file {number}/{len(files)}, {index:,} documents, {total:,} tokens, "
                        f"{total / max(elapsed, 1e-9):,.0f} tokens/s", final)

    with (partial / "train.bin").open("wb") as train, (partial / "val.bin").open("wb") as validation:
        for number, file in enumerate(files, 1):
            batch = []
            for text in documents(file, encoding):
                batch.append(text)
                beat(file=number, documents=index + len(batch))
                if len(batch) == 256:
                    index = _write(tokenizer, batch, eos, dtype, index, stride, train, validation, counts)
                    batch = []
                    show(number)
            index = _write(tokenizer, batch, eos, dtype, index, stride, train, validation, counts)
            show(number, final=number == len(files))
    return counts, started


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
    skipped = meta.get("skipped") or {}
    words = f"; {skipped_words(skipped, meta.get('encoding', 'utf-8'))}" if any(skipped.values()) else ""
    return (f"train {documents['train']:,} documents / {tokens['train']:,} tokens, validation "
            f"{documents['validation']:,} documents / {tokens['validation']:,} tokens "
            f"({meta['dtype']}, vocabulary {meta['vocab_size']:,}){words}")
