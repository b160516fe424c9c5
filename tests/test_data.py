import sysconfig
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxshard.data import corpus as data
from jaxshard.errors import DataError
from jaxshard.mesh import build_mesh
from jaxshard.rules import ShardingRules


def test_default_corpus_is_python_source_bytes():
    corpus = data.load_corpus(data.DataConfig(max_bytes=1 << 20))
    assert corpus.name == data.STDLIB and corpus.vocab_size == 256
    assert corpus.train.dtype == np.uint8 and len(corpus.train) > 900_000
    assert 0.04 < len(corpus.val) / (len(corpus.train) + len(corpus.val)) < 0.06
    assert b"def " in corpus.train[:200_000].tobytes()
    again = data.load_corpus(data.DataConfig(max_bytes=1 << 20))
    np.testing.assert_array_equal(again.train, corpus.train)


def test_default_corpus_separates_source_files_with_nul():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.rglob("*.py")) if "site-packages" not in p.parts and p.stat().st_size]
    first, second = files[0].read_bytes(), files[1].read_bytes()
    corpus = data.load_corpus(data.DataConfig(max_bytes=1 << 20))
    assert corpus.train[:len(first) + 1 + 100].tobytes() == first + b"\0" + second[:100]
    assert corpus.tokenizer.eot_id == 0 and corpus.tokenizer.vocab_size == corpus.vocab_size


def test_text_and_bin_files(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_bytes(b"hello world\n" * 100)
    corpus = data.load_corpus(data.DataConfig(path=str(text)))
    assert corpus.vocab_size == 256 and corpus.train[:5].tobytes() == b"hello"

    ids = np.arange(1000, dtype=np.int64) * 37 % 50_000
    data.write_bin(tmp_path / "tokens.bin", ids)
    corpus = data.load_corpus(data.DataConfig(path=str(tmp_path / "tokens.bin"), val_fraction=0.1))
    np.testing.assert_array_equal(np.concatenate([corpus.train, corpus.val]), ids)
    assert corpus.vocab_size == ids.max() + 1 and len(corpus.val) == 100


def test_bad_data_fails_clearly(tmp_path):
    with pytest.raises(DataError, match="data file not found: .*missing.txt"):
        data.load_corpus(data.DataConfig(path=str(tmp_path / "missing.txt")))
    (tmp_path / "odd.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(DataError, match="odd size"):
        data.load_corpus(data.DataConfig(path=str(tmp_path / "odd.bin")))
    (tmp_path / "tiny.txt").write_bytes(b"ab")
    with pytest.raises(DataError, match="too few to train on"):
        data.load_corpus(data.DataConfig(path=str(tmp_path / "tiny.txt")))
    with pytest.raises(DataError, match="the corpus has 10 tokens, fewer than --seq-len"):
        data.Batches(np.arange(10), seq_len=16, global_batch=2, seed=0)


def test_batches_are_shifted_windows_in_a_seeded_order():
    tokens = np.arange(10_000) % 251
    b = data.Batches(tokens, seq_len=8, global_batch=4, seed=0)
    first = b.batch_at(0)
    assert first["inputs"].shape == (4, 8) and first["inputs"].dtype == np.int32
    np.testing.assert_array_equal(first["targets"][:, :-1], first["inputs"][:, 1:])
    np.testing.assert_array_equal(data.Batches(tokens, 8, 4, seed=0).batch_at(12)["inputs"], b.batch_at(12)["inputs"])
    assert not np.array_equal(data.Batches(tokens, 8, 4, seed=1).batch_at(0)["inputs"], first["inputs"])


def test_an_epoch_visits_every_window_once():
    tokens = np.arange(8 * 12 + 1)
    b = data.Batches(tokens, seq_len=8, global_batch=4, seed=3)
    assert b.n_windows == 12
    starts = np.concatenate([b.window_starts(np.arange(4 * s, 4 * s + 4)) for s in range(3)])
    assert sorted(starts) == list(range(0, 96, 8))
    assert not np.array_equal(b.window_starts(np.arange(12)), b.window_starts(np.arange(12, 24)))


def test_a_process_reads_only_its_block_of_the_global_batch():
    tokens = np.arange(5_000) % 199
    full = data.Batches(tokens, seq_len=16, global_batch=8, seed=0)
    part = data.Batches(tokens, seq_len=16, global_batch=8, seed=0, rows=slice(4, 8), cols=slice(8, 16))
    for offset in (0, 40):
        np.testing.assert_array_equal(part.batch_at(offset)["inputs"], full.batch_at(offset)["inputs"][4:8, 8:])
        np.testing.assert_array_equal(part.batch_at(offset)["targets"], full.batch_at(offset)["targets"][4:8, 8:])


def test_global_batch_assembled_from_process_rows():
    rules = ShardingRules(build_mesh("data=2,fsdp=4"))
    sharding = rules.batch_sharding()
    assert data.process_block(sharding, 16, 32) == (slice(0, 16), slice(0, 32))  # one process: all
    b = data.Batches(np.arange(20_000) % 256, seq_len=32, global_batch=16, seed=0)
    local = b.batch_at(0)
    arr = data.to_global(local, sharding, (16, 32))["inputs"]
    assert arr.shape == (16, 32) and arr.sharding == sharding
    np.testing.assert_array_equal(np.asarray(arr), local["inputs"])
    assert {s.data.shape for s in arr.addressable_shards} == {(2, 32)}
    assert len(jax.devices()) == 8


def test_a_process_block_must_be_contiguous():
    # this process's devices hold rows 4:8 and 8:16 (one device's rows repeated): one block
    assert data._span([slice(4, 8), slice(8, None), slice(4, 8)], 16) == slice(4, 16)
    assert data._span([slice(None, None)], 16) == slice(0, 16)
    with pytest.raises(DataError, match="not contiguous; put the batch and sequence axes outermost"):
        data._span([slice(0, 4), slice(8, 12)], 16)  # a gap: rows 4:8 live on another process
