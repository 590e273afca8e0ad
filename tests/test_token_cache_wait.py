"""data=text under torchrun/Slurm: only global rank 0 hashes and tokenizes the corpus; the other ranks
learn its cache key from rank 0's handshake file (layerwise/run/text.py learned_key), report rank 0's
failure at once and give up on a silent rank 0 with an error naming the launch, the cache directory
and the fix. Each process's rank and launch come from the environment torchrun sets (monkeypatch
restores it); deadlines are tiny and no duration is asserted."""

import os

import pytest

pytest.importorskip("tokenizers")

from layerwise.run import text  # noqa: E402
from layerwise.run.text import TokenCacheError, learned_key, tokenized, wait_seconds  # noqa: E402
from tests.test_text_data import STDLIB, train_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "text"
    root.mkdir()
    (root / "a.txt").write_text((STDLIB / "textwrap.py").read_text())
    (root / "b.txt").write_text((STDLIB / "shlex.py").read_text())
    return root


def as_rank(monkeypatch, rank: int, run_id: str = "job7"):
    """This process becomes global rank `rank` of torchrun run `run_id`; nothing it knew carries over."""
    for name, value in dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=2, TORCHELASTIC_RUN_ID=run_id,
                            TORCHELASTIC_RESTART_COUNT=0, MASTER_ADDR="node0", MASTER_PORT=29500).items():
        monkeypatch.setenv(name, str(value))
    text.KEYS.clear()  # a rank is a new process: it has learned no key yet


@pytest.fixture(autouse=True)
def forget_keys():
    yield
    text.KEYS.clear()


def forge(file):
    """Other bytes of the same size with the same modification time: what rank 0's hash sees and a
    listing (stat) does not. A rank that hashed would find another key."""
    stat = file.stat()
    data = bytearray(file.read_bytes())
    data[:5] = b"#!!!\n"
    file.write_bytes(bytes(data))
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert file.stat().st_size == stat.st_size and file.stat().st_mtime_ns == stat.st_mtime_ns


def test_other_ranks_take_rank_zeros_key_without_reading_the_corpus(corpus, tokenizer_dir, tmp_path, monkeypatch):
    from layerwise.run.fit import load_corpus, tokenize_once
    from tests.ranks import compose_config
    cache = tmp_path / "cache"
    cfg = compose_config("data=text", f"data.path={corpus}", f"data.tokenizer={tokenizer_dir}",
                         f"data.cache_dir={cache}", "data.validation_fraction=0.25")
    as_rank(monkeypatch, 0)
    tokenize_once(cfg)
    expected = load_corpus(cfg)
    (directory,) = [path for path in cache.iterdir() if path.name != "handshakes"]
    forge(corpus / "a.txt")
    as_rank(monkeypatch, 1)
    tokenize_once(cfg)  # learns rank 0's key: returns at once
    got = load_corpus(cfg)  # the rank's own load: the key it learned, no hash
    assert got.train.tolist() == expected.train.tolist()
    assert sorted(path.name for path in cache.iterdir()) == sorted([directory.name, "handshakes"])
    # the forged bytes hash to another key: a rank that hashed would not have found rank 0's cache
    assert text.cache_key(text.text_files(corpus), tokenizer_dir, 0.25) != directory.name


def test_a_failed_rank_zero_is_reported_at_once(corpus, tokenizer_dir, tmp_path, monkeypatch):
    from layerwise.run.fit import tokenize_once
    from tests.ranks import compose_config
    broken = tmp_path / "broken_tokenizer"
    broken.mkdir()
    cfg = compose_config("data=text", f"data.path={corpus}", f"data.tokenizer={broken}",
                         f"data.cache_dir={tmp_path / 'cache'}", "trainer.collective_timeout_s=600")
    as_rank(monkeypatch, 0)
    with pytest.raises(Exception, match="has no tokenizer.json"):
        tokenize_once(cfg)
    as_rank(monkeypatch, 1)
    with pytest.raises(TokenCacheError) as error:
        tokenize_once(cfg)  # with a 600 s deadline: only an immediate report ends this test
    message = str(error.value)
    assert "rank 1: global rank 0 of torchrun run job7" in message and "failed to tokenize" in message
    assert "has no tokenizer.json" in message and str(tmp_path / "cache") in message


def test_a_silent_rank_zero_ends_the_wait_naming_the_launch_the_cache_and_the_fix(corpus, tokenizer_dir, tmp_path,
                                                                                   monkeypatch):
    as_rank(monkeypatch, 1)
    with pytest.raises(TokenCacheError) as error:
        learned_key(corpus, tokenizer_dir, 0.25, tmp_path / "cache", timeout_s=0.05, poll_s=0.01)
    message = str(error.value)
    assert "rank 1: no word for 0.05 s from global rank 0 of torchrun run job7" in message
    assert f"into {tmp_path / 'cache'}" in message and "last seen: nothing" in message
    assert "Fix: data.cache_dir=/a/shared/path" in message and "trainer.collective_timeout_s" in message


def test_another_launchs_failure_is_not_this_launchs(corpus, tmp_path, monkeypatch):
    broken = tmp_path / "broken_tokenizer"
    broken.mkdir()
    as_rank(monkeypatch, 0, run_id="earlier")
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        tokenized(corpus, broken, 0.25, tmp_path / "cache", say=lambda line: None)
    as_rank(monkeypatch, 1, run_id="now")  # its rank 0 has not written yet
    with pytest.raises(TokenCacheError, match="no word for .*last seen: nothing"):
        learned_key(corpus, broken, 0.25, tmp_path / "cache", timeout_s=0.05, poll_s=0.01)


def test_the_wait_has_a_deadline_even_with_the_watchdog_off():
    assert wait_seconds(0) == text.WAIT_S and wait_seconds(3.0) == text.MIN_WAIT_S and wait_seconds(600.0) == 600.0
