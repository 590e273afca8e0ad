"""data=text: documents tokenized by a Hugging Face tokenizer (a small BPE trained here on the standard
library's text, nothing downloaded), joined with EOS, cached once as token memmaps, split by document."""

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

tokenizers = pytest.importorskip("tokenizers")

from layerwise.run import data as data_lib  # noqa: E402
from layerwise.run.text import load_tokenizer, token_dtype, tokenized  # noqa: E402

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCES = ["textwrap.py", "string.py", "shlex.py", "glob.py", "fnmatch.py", "colorsys.py", "keyword.py"]


def train_tokenizer(directory: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE of `vocab_size` ids trained on a few stdlib modules, saved as transformers does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(STDLIB / name) for name in SOURCES], trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return directory


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    """Two .txt documents and a .jsonl of eight: ten documents."""
    root = tmp_path_factory.mktemp("text")
    (root / "a.txt").write_text((STDLIB / "textwrap.py").read_text())
    (root / "b.txt").write_text((STDLIB / "shlex.py").read_text())
    lines = (STDLIB / "string.py").read_text().splitlines()
    (root / "c.jsonl").write_text("".join(json.dumps({"text": "\n".join(lines[i::8])}) + "\n" for i in range(8)))
    return root


def test_documents_are_tokenized_with_eos_split_by_document_and_cached_once(tokenizer_dir, text_dir, tmp_path):
    printed = []
    first = tokenized(text_dir, tokenizer_dir, 0.25, tmp_path, printed.append)
    meta = json.loads((first / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 300
    # every 4th of the 10 documents (0, 4, 8) is validation
    assert meta["documents"] == {"train": 7, "validation": 3}
    tokenizer, eos = load_tokenizer(tokenizer_dir)
    corpus = data_lib.load_corpus("text", path=str(text_dir), tokenizer=str(tokenizer_dir),
                                  validation_fraction=0.25, cache_dir=str(tmp_path), say=printed.append)
    assert int((corpus.train == eos).sum()) == 7 and int((corpus.validation == eos).sum()) == 3
    assert len(corpus.train) == meta["tokens"]["train"] and corpus.train.dtype == torch.uint16
    expected = tokenizer.encode((text_dir / "a.txt").read_text(), add_special_tokens=False).ids + [eos]
    assert corpus.validation[:len(expected)].tolist() == expected  # document 0, a.txt, leads validation
    assert any(line.startswith("tokenizing: file 3/3") for line in printed)
    assert printed[-1].startswith("tokens cached in") and "train 7 documents" in printed[-1]  # second time: no tokenizing
    (text_dir / "b.txt").write_text("changed")  # the files' bytes key the cache
    try:
        assert tokenized(text_dir, tokenizer_dir, 0.25, tmp_path, printed.append) != first
    finally:
        (text_dir / "b.txt").write_text((STDLIB / "shlex.py").read_text())


def test_a_parquet_text_column_gives_the_same_documents_as_jsonl(text_dir, tmp_path):
    """A .parquet file's "text" column is read row by row, as a .jsonl's lines (pyarrow, a test
    dependency; users without it get an error naming it)."""
    parquet = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    from layerwise.run.text import documents
    expected = list(documents(text_dir / "c.jsonl"))
    parquet.write_table(pyarrow.table({"text": expected, "id": list(range(len(expected)))}), tmp_path / "c.parquet",
                        row_group_size=3)  # three row groups: the reader goes batch by batch
    assert list(documents(tmp_path / "c.parquet")) == expected and len(expected) == 8
    parquet.write_table(pyarrow.table({"body": expected}), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r'd.parquet has no "text" column \(it has: body\)'):
        list(documents(tmp_path / "d.parquet"))


def test_token_bin_reads_uint32_for_vocabularies_past_uint16(tmp_path):
    assert token_dtype(65536) is np.uint16 and token_dtype(128256) is np.uint32
    ids = np.array([0, 70000, 128255, 5], dtype=np.uint32)
    for name in data_lib.TOKEN_BIN_FILES:
        ids.tofile(tmp_path / name)
    corpus = data_lib.load_corpus("token_bin", path=str(tmp_path), vocab_size=128256)
    assert corpus.train.tolist() == ids.tolist()


def test_missing_tokenizer_or_text_is_refused_before_launch(tmp_path):
    from layerwise.config.errors import ConfigError
    from layerwise.preflight import validate
    from tests.ranks import compose_config
    cfg = compose_config("data=text", f"data.path={tmp_path / 'nothing'}", f"data.tokenizer={tmp_path}")
    with pytest.raises(ConfigError, match="data.path=.* does not exist") as error:
        validate(cfg)
    assert "holds no tokenizer.json" in str(error.value)


# ----- text checked as it is read (issue 55 item 4): binary and undecodable files skipped and counted,
# data.encoding, one progress line, nothing left behind by an interrupted tokenization

LATIN = "Café crème, señor: naïve façade à la mode.\n" * 40


@pytest.fixture
def dirty_dir(tmp_path):
    """a.txt (text), ls.txt (the ls program: binary) and latin.txt (Latin-1 bytes, invalid UTF-8)."""
    root = tmp_path / "dirty"
    root.mkdir()
    (root / "a.txt").write_text((STDLIB / "textwrap.py").read_text())
    (root / "ls.txt").write_bytes(Path("/bin/ls").read_bytes())
    (root / "latin.txt").write_bytes(LATIN.encode("latin-1"))
    return root


def test_a_binary_file_and_an_undecodable_one_are_skipped_and_counted(tokenizer_dir, dirty_dir, tmp_path):
    printed = []
    directory = tokenized(dirty_dir, tokenizer_dir, 0.5, tmp_path / "cache", printed.append)
    meta = json.loads((directory / "meta.json").read_text())
    assert meta["skipped"]["binary"] == ["ls.txt"] and meta["skipped"]["undecodable"] == ["latin.txt"]
    assert meta["files"] == 1 and sum(meta["documents"].values()) == 1
    tokenizer, eos = load_tokenizer(tokenizer_dir)
    expected = tokenizer.encode((dirty_dir / "a.txt").read_text(), add_special_tokens=False).ids + [eos]
    assert sum(meta["tokens"].values()) == len(expected)  # the text only: no byte of ls, no U+FFFD
    summary = printed[-1]
    assert "skipped 1 binary file (ls.txt), 1 undecodable as utf-8 (latin.txt)" in summary, printed
    again = []
    tokenized(dirty_dir, tokenizer_dir, 0.5, tmp_path / "cache", again.append)  # the cached summary says it too
    assert "skipped 1 binary file (ls.txt)" in again[-1]


def test_latin_1_text_is_read_right_with_data_encoding(tokenizer_dir, dirty_dir, tmp_path):
    (dirty_dir / "ls.txt").unlink()
    utf8 = json.loads((tokenized(dirty_dir, tokenizer_dir, 0.5, tmp_path, lambda line: None) / "meta.json").read_text())
    latin = tokenized(dirty_dir, tokenizer_dir, 0.5, tmp_path, lambda line: None, encoding="latin-1")
    meta = json.loads((latin / "meta.json").read_text())
    assert utf8["skipped"]["undecodable"] == ["latin.txt"] and meta["skipped"] == {"binary": [], "undecodable": []}
    tokenizer, eos = load_tokenizer(tokenizer_dir)
    corpus = data_lib.load_corpus("text", path=str(dirty_dir), tokenizer=str(tokenizer_dir), validation_fraction=0.5,
                                  cache_dir=str(tmp_path), encoding="latin-1", say=lambda line: None)
    expected = tokenizer.encode(LATIN, add_special_tokens=False).ids + [eos]  # latin.txt: document 1, train
    assert corpus.train.tolist() == expected and "\ufffd" not in tokenizer.decode(corpus.train.tolist())


def test_tokenizing_many_files_prints_one_updating_line(tokenizer_dir, tmp_path):
    import io
    root = tmp_path / "many"
    root.mkdir()
    for index in range(40):
        (root / f"{index:03d}.txt").write_text(f"document {index}: " + "some words here " * 20)

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    printed, terminal = [], Terminal()
    tokenized(root, tokenizer_dir, 0.25, tmp_path / "a", printed.append, stream=io.StringIO())
    assert len(printed) <= 3, printed  # a pipe: a few lines, not one per file (issue 55: 301 for 301 files)
    assert printed[-2].startswith("tokenizing: file 40/40") and printed[-1].startswith("tokenized into")
    printed.clear()
    tokenized(root, tokenizer_dir, 0.25, tmp_path / "b", printed.append, stream=terminal)
    shown = terminal.getvalue()
    assert "\n" not in shown.rstrip("\n") and shown.count("\r") >= 1 and "file 40/40" in shown  # rewritten in place
    assert len(printed) == 1 and printed[0].startswith("tokenized into")  # the summary: its own line


def test_an_interrupted_tokenization_leaves_nothing_and_a_dead_runs_partial_is_removed(tokenizer_dir, tmp_path):
    root = tmp_path / "text"
    root.mkdir()
    (root / "a.txt").write_text("first document " * 50)
    (root / "b.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match='line 2 has no "text" field'):
        tokenized(root, tokenizer_dir, 0.5, cache, lambda line: None)
    assert not [path.name for path in cache.iterdir() if ".partial" in path.name]
    (root / "b.jsonl").write_text(json.dumps({"text": "fine"}) + "\n")
    dead = cache / "0123456789abcdef0123.partial999999999"  # a run killed with SIGKILL left it (no such pid)
    dead.mkdir()
    (dead / "train.bin").write_bytes(b"\0" * 64)
    tokenized(root, tokenizer_dir, 0.5, cache, lambda line: None)
    assert not dead.exists()


def test_text_files_skips_binary_and_undecodable_files_and_says_so(dirty_dir):
    printed = []
    corpus = data_lib.load_corpus("text_files", path=str(dirty_dir), validation_fraction=0.5, say=printed.append)
    assert corpus.train.numel() + corpus.validation.numel() == len((dirty_dir / "a.txt").read_bytes())
    assert any("skipped 1 binary file (ls.txt), 1 undecodable as utf-8 (latin.txt)" in line for line in printed)
    latin = data_lib.load_corpus("text_files", path=str(dirty_dir), validation_fraction=0.5, encoding="latin-1",
                                 say=printed.append)
    read = bytes(torch.cat([latin.validation, latin.train]).tolist()).decode("utf-8")  # as UTF-8 bytes
    assert LATIN in read


def test_ctrl_c_while_tokenizing_removes_the_partial_directory(tokenizer_dir, tmp_path, monkeypatch):
    """A KeyboardInterrupt (Ctrl-C) in the middle of a file leaves no `.partial` behind and no cache."""
    from layerwise.run import text
    root = tmp_path / "text"
    root.mkdir()
    for name in ("a.txt", "b.txt"):
        (root / name).write_text("words " * 100)
    real = text.documents

    def interrupted(file, encoding="utf-8"):
        if file.name == "b.txt":
            raise KeyboardInterrupt
        yield from real(file, encoding)
    monkeypatch.setattr(text, "documents", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tokenized(root, tokenizer_dir, 0.5, tmp_path / "cache", lambda line: None)
    assert [path.name for path in (tmp_path / "cache").iterdir()] == ["handshakes"]


def test_text_files_checks_only_the_files_max_bytes_reads(tmp_path):
    """data.max_bytes bounds what text_files reads, the check included: a binary file past the
    budget is neither read nor counted."""
    root = tmp_path / "texts"
    root.mkdir()
    (root / "a.txt").write_text("a" * 1000)
    (root / "b.txt").write_bytes(b"\0" * 1000)  # sorted after a.txt: beyond max_bytes=1000
    printed = []
    corpus = data_lib.load_corpus("text_files", path=str(root), max_bytes=1000, say=printed.append)
    assert corpus.train.numel() + corpus.validation.numel() == 1000 and printed == []
    data_lib.load_corpus("text_files", path=str(root), max_bytes=1001, say=printed.append)
    assert "skipped 1 binary file (b.txt)" in printed[-1]


def test_a_dry_run_trains_on_the_configured_text(tokenizer_dir, text_dir, tmp_path):
    """plan.dry_run with data=text reads the tokenized corpus a run reads (data.configured_corpus):
    before, the dry run passed no tokenizer: 'DataError: data.tokenizer is not set'."""
    from layerwise.tools.dry_run import dry_run
    from tests.ranks import QUICK, compose_config
    cfg = compose_config(*QUICK, "data=text", f"data.path={text_dir}", f"data.tokenizer={tokenizer_dir}",
                         f"data.cache_dir={tmp_path}", "mode=plan", "strategy=single",
                         "hardware.devices_per_node=1", "data.global_batch_size=2", "data.sequence_length=16")
    corpus = data_lib.configured_corpus(cfg)
    assert corpus.vocab_size == 300  # the tokenizer's ids, not the 256 bytes of the default corpus
    result = dry_run(cfg, 0, 1)
    assert result["peak_compute_bytes"] > 0
