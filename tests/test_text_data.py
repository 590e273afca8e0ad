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
