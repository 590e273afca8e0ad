"""Tests of layerwise/run/data.py: corpora, deterministic batches, data-parallel slices, errors."""

import numpy as np
import pytest
import torch

from layerwise.run.data import (Corpus, DataError, TrainBatches, ValidationBatches, language_model_batch, load_corpus,
                                model_vocab_size)

OBJECTIVES = ["causal", "masked"]


@pytest.fixture(scope="module")
def stdlib():
    return load_corpus("stdlib", max_bytes=2 * 2**20)


def batch(corpus, **overrides):
    options = dict(split="train", index=0, global_batch_size=8, sequence_length=32, seed=0,
                   objective="causal")
    return language_model_batch(corpus, **{**options, **overrides})


def write_files(directory, contents):
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in contents.items():
        (directory / name).write_bytes(text)
    return directory


# ----------------------------------------------------------------------------- corpora


def test_stdlib_corpus_is_bytes_and_deterministic(stdlib):
    assert stdlib.vocab_size == 256
    assert stdlib.train.dim() == 1 and stdlib.validation.dim() == 1
    assert stdlib.train.numel() + stdlib.validation.numel() == 2 * 2**20
    assert 0 < stdlib.validation.numel() < stdlib.train.numel() / 5
    again = load_corpus("stdlib", max_bytes=2 * 2**20)
    assert torch.equal(again.train, stdlib.train)
    assert torch.equal(again.validation, stdlib.validation)
    text = bytes(stdlib.train[:100_000].tolist()).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text


def test_text_files_split_by_file_is_disjoint(tmp_path):
    # 40 files, each a distinct repeated letter pair: validation gets files 0 and 20 (stride 20).
    letters = [chr(ord("A") + i // 26) + chr(ord("a") + i % 26) for i in range(40)]
    write_files(tmp_path / "texts", {f"{i:02d}.txt": letters[i].encode() * 50
                                     for i in range(40)})
    corpus = load_corpus("text_files", path=str(tmp_path / "texts"))
    assert corpus.vocab_size == 256
    train = bytes(corpus.train.tolist()).decode()
    validation = bytes(corpus.validation.tolist()).decode()
    assert validation == letters[0] * 50 + letters[20] * 50
    for index, pair in enumerate(letters):
        assert (pair in validation) == (index % 20 == 0)
        assert (pair in train) == (index % 20 != 0)


def test_text_files_respects_max_bytes_and_skips_hidden_files(tmp_path):
    write_files(tmp_path / "texts", {"a.txt": b"a" * 600, "b.md": b"b" * 600, ".hidden": b"h" * 9})
    corpus = load_corpus("text_files", path=str(tmp_path / "texts"), max_bytes=1000)
    everything = bytes(torch.cat([corpus.validation, corpus.train]).tolist())
    assert everything == b"a" * 600 + b"b" * 400


def test_single_file_is_split_by_its_tail(tmp_path):
    book = (bytes(range(32, 127)) * 22)[:2000]  # printable: text_files skips binary files (text.py's rule)
    write_files(tmp_path / "one", {"book.txt": book})
    corpus = load_corpus("text_files", path=str(tmp_path / "one"))
    assert corpus.validation.numel() == 100  # 5% of 2000 bytes
    assert torch.equal(torch.cat([corpus.train, corpus.validation]).long(), torch.tensor(list(book)))


def test_token_bin_round_trip(tmp_path):
    train = np.arange(5000, dtype=np.uint16) % 50000 + 3
    validation = np.arange(700, dtype=np.uint16) + 40000
    train.tofile(tmp_path / "train.bin")
    validation.tofile(tmp_path / "val.bin")
    corpus = load_corpus("token_bin", path=str(tmp_path), vocab_size=50304)
    assert corpus.vocab_size == 50304
    assert torch.equal(corpus.train.long(), torch.from_numpy(train.astype(np.int64)))
    assert torch.equal(corpus.validation.long(), torch.from_numpy(validation.astype(np.int64)))
    rows = batch(corpus, split="validation", sequence_length=16)
    assert rows["tokens"].dtype == torch.long
    # Consecutive ids make the window structure visible: each target is its token + 1.
    assert torch.equal(rows["targets"], rows["tokens"] + 1)
    assert (rows["tokens"] >= 40000).all()
    assert train.tolist() == np.fromfile(tmp_path / "train.bin", dtype=np.uint16).tolist()


# ----------------------------------------------------------------------------- batches


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_batches_are_deterministic_and_depend_on_their_arguments(stdlib, objective):
    first = batch(stdlib, objective=objective)
    second = batch(stdlib, objective=objective)
    assert first["tokens"].shape == first["targets"].shape == (8, 32)
    assert first["tokens"].dtype == first["targets"].dtype == torch.long
    assert torch.equal(first["tokens"], second["tokens"])
    assert torch.equal(first["targets"], second["targets"])
    for change in [dict(index=1), dict(seed=1), dict(split="validation")]:
        assert not torch.equal(batch(stdlib, objective=objective, **change)["tokens"],
                               first["tokens"])


def test_causal_targets_are_tokens_shifted_by_one(stdlib):
    rows = batch(stdlib)
    assert torch.equal(rows["tokens"][:, 1:], rows["targets"][:, :-1])


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("data_degree", [2, 4])
def test_data_slices_concatenate_to_the_global_batch(stdlib, objective, data_degree):
    whole = batch(stdlib, objective=objective, index=5)
    slices = [batch(stdlib, objective=objective, index=5, data_rank=rank, data_degree=data_degree)
              for rank in range(data_degree)]
    assert all(s["tokens"].shape == (8 // data_degree, 32) for s in slices)
    for key in ("tokens", "targets"):
        assert torch.equal(torch.cat([s[key] for s in slices]), whole[key])


def test_masked_objective_scores_exactly_k_positions_per_row(stdlib):
    rows = batch(stdlib, objective="masked", global_batch_size=64, sequence_length=40)
    mask_id = stdlib.vocab_size
    scored = rows["targets"] != -100
    assert (scored.sum(dim=1) == round(0.15 * 40)).all()
    unmasked = batch(stdlib, global_batch_size=64, sequence_length=40)  # same windows, causal
    assert torch.equal(rows["targets"][scored], unmasked["tokens"][scored])
    # Unscored positions are untouched; scored ones are mostly [MASK], sometimes other tokens.
    assert torch.equal(rows["tokens"][~scored], unmasked["tokens"][~scored])
    shown = rows["tokens"][scored]
    assert (rows["tokens"] == mask_id).sum() == (shown == mask_id).sum()
    assert 0.7 < (shown == mask_id).float().mean() < 0.9
    assert (shown != mask_id).any()
    assert model_vocab_size(stdlib, "masked") == 257
    assert model_vocab_size(stdlib, "causal") == 256


def test_short_sequence_masks_at_least_one_position(stdlib):
    rows = batch(stdlib, objective="masked", sequence_length=3)
    assert ((rows["targets"] != -100).sum(dim=1) == 1).all()


# ----------------------------------------------------------------------------- datasets


def test_train_batches_resume_at_start_step(stdlib):
    options = dict(global_batch_size=4, sequence_length=16, seed=3, objective="causal",
                   data_rank=1, data_degree=2)
    resumed = iter(TrainBatches(stdlib, start_step=3, **options))
    for index in (3, 4):
        expected = language_model_batch(stdlib, split="train", index=index, **options)
        got = next(resumed)
        assert torch.equal(got["tokens"], expected["tokens"])
        assert torch.equal(got["targets"], expected["targets"])
    assert next(resumed)["tokens"].shape == (2, 16)


def test_validation_batches_are_a_fixed_list(stdlib):
    options = dict(global_batch_size=4, sequence_length=16, seed=3, objective="masked")
    batches = ValidationBatches(stdlib, batches=3, **options)
    assert len(batches) == 3
    loader = torch.utils.data.DataLoader(batches, batch_size=None, num_workers=0)
    items = list(loader)
    assert len(items) == 3
    expected = language_model_batch(stdlib, split="validation", index=2, **options)
    assert torch.equal(items[2]["tokens"], expected["tokens"])
    assert torch.equal(items[2]["targets"], expected["targets"])
    with pytest.raises(IndexError):
        batches[3]


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("make_path, field", [
    (lambda tmp: None, "data.path"),
    (lambda tmp: tmp / "missing", "data.path"),
    (lambda tmp: write_files(tmp / "empty", {}), "data.path"),
    (lambda tmp: write_files(tmp / "blank", {"a.txt": b""}), "data.path"),
    (lambda tmp: write_files(tmp, {"file.txt": b"x"}) / "file.txt", "data.path"),
])
def test_text_files_errors_name_the_field(tmp_path, make_path, field):
    path = make_path(tmp_path)
    with pytest.raises(DataError, match=field):
        load_corpus("text_files", path=None if path is None else str(path))


def test_too_short_corpus_names_sequence_length(tmp_path):
    # File 0 (100 bytes) is the validation split, file 1 (30 bytes) the train split.
    write_files(tmp_path / "short", {"a.txt": b"a" * 100, "b.txt": b"b" * 30})
    corpus = load_corpus("text_files", path=str(tmp_path / "short"))
    assert batch(corpus, split="validation", sequence_length=64)["tokens"].shape == (8, 64)
    with pytest.raises(DataError, match="data.sequence_length") as error:
        batch(corpus, split="train", sequence_length=64)
    assert "has 30" in str(error.value)  # the split's size is in the message
    with pytest.raises(DataError, match="data.sequence_length"):
        TrainBatches(corpus, global_batch_size=2, sequence_length=64, seed=0, objective="causal")


def test_token_bin_errors_name_the_field(tmp_path):
    with pytest.raises(DataError, match="data.path"):
        load_corpus("token_bin", path=str(tmp_path / "missing"))
    with pytest.raises(DataError, match="data.path.*val.bin"):
        np.arange(10, dtype=np.uint16).tofile(tmp_path / "train.bin")
        load_corpus("token_bin", path=str(tmp_path))
    with pytest.raises(DataError, match="data.path"):
        (tmp_path / "val.bin").write_bytes(b"")
        load_corpus("token_bin", path=str(tmp_path))


def test_unknown_corpus_names_the_field_and_the_choices():
    with pytest.raises(DataError, match="data.corpus.*stdlib, text_files, token_bin"):
        load_corpus("wikipedia")


def test_indivisible_batch_names_global_batch_size(stdlib):
    with pytest.raises(DataError, match="data.global_batch_size"):
        batch(stdlib, global_batch_size=6, data_degree=4, data_rank=0)


def test_bad_validation_fraction_names_the_field(tmp_path):
    write_files(tmp_path / "texts", {"a.txt": b"a" * 100, "b.txt": b"b" * 100})
    with pytest.raises(DataError, match="data.validation_fraction"):
        load_corpus("text_files", path=str(tmp_path / "texts"), validation_fraction=0.0)


def test_data_error_is_a_value_error():
    assert issubclass(DataError, ValueError)
    assert Corpus.__dataclass_params__.frozen
