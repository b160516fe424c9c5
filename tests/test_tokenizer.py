import struct
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import tokenizers as hf

from jaxshard.data import corpus as data
from jaxshard.data.token_file import TokenWriter, read_tokens
from jaxshard.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer, parse_spec, train_bpe
from jaxshard.errors import ConfigError, DataError

EOT = "<|endoftext|>"
UNICODE = "naïve café — 日本語のテキスト, Ελληνικά, emoji 🎉🧪, combining e\u0301, zero\u200bwidth\n"
ODD = "\ttabs\r\nCRLF  trailing  \n\n\n   indented\n\x00nul \\x escapes <|end|> ''' \"\"\"\n"


def _stdlib_docs(n: int = 6) -> list[str]:
    files = sorted((Path(sysconfig.get_paths()["stdlib"]) / "json").glob("*.py"))[:n]
    return [f.read_text(encoding="utf-8") for f in files]


@pytest.fixture(scope="module")
def bpe() -> HFTokenizer:
    return train_bpe(_stdlib_docs() + [UNICODE * 3], 600)


def _folder(root: Path, docs: dict[str, str | bytes]) -> Path:
    root.mkdir()
    for name, text in docs.items():
        (root / name).write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return root


def test_bpe_round_trips_any_utf8_text_exactly(bpe):
    texts = _stdlib_docs() + [UNICODE, ODD, "", " ", "\n", "ü" * 33, "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 unseen ∮ ⅋ ꙮ", "a" * 5000]
    for text in texts:
        ids = bpe.encode(text)
        assert ids.size == 0 or (ids.min() >= 0 and ids.max() < bpe.vocab_size)
        assert bpe.decode(ids) == text
    assert [bpe.decode(i) for i in bpe.encode_batch(texts)] == texts
    source = _stdlib_docs()[0]
    assert len(bpe.encode(source)) < len(source.encode("utf-8")) / 2  # merges were learned
    assert bpe.vocab_size == 600 and bpe.spec == "bpe:600"
    assert bpe.eot_id is not None and bpe.decode([bpe.eot_id]) == EOT
    assert 0 < bpe.encode(UNICODE).max()


def test_byte_tokenizer():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256 and tok.eot_id == 0 and tok.to_json() is None
    ids = tok.encode(UNICODE)
    assert bytes(ids.tolist()) == UNICODE.encode("utf-8") and tok.decode(ids) == UNICODE
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        tok.save("unused.json")


def test_saved_tokenizer_loads_with_the_same_ids(bpe, tmp_path):
    written = bpe.save(tmp_path)
    assert written == tmp_path / "tokenizer.json"
    text = _stdlib_docs()[1] + UNICODE
    for path in (tmp_path, written, str(written)):
        loaded = load_tokenizer(path)
        np.testing.assert_array_equal(loaded.encode(text), bpe.encode(text))
        assert (loaded.vocab_size, loaded.eot_id) == (bpe.vocab_size, bpe.eot_id)
    restored = HFTokenizer.from_json(bpe.to_json())
    assert restored.to_json() == bpe.to_json()  # stable: the token cache is keyed by it
    np.testing.assert_array_equal(restored.encode(text), bpe.encode(text))


def _word_level(tmp_path: Path, specials: list[str]) -> Path:
    vocab = {w: i for i, w in enumerate(["<unk>", "a", "b", *specials])}
    tok = hf.Tokenizer(hf.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.add_special_tokens(specials)
    path = tmp_path / f"{len(specials)}-{'_'.join(s.strip('<>/|') for s in specials)}.json"
    tok.save(str(path))
    return path


@pytest.mark.parametrize("specials, eot", [
    (["</s>", "<|eot_id|>"], "</s>"),
    (["<|eot_id|>", "<|end_of_text|>"], "<|end_of_text|>"),
    (["<pad>", "<|endoftext|>", "</s>"], "<|endoftext|>"),
    (["<pad>"], None),
])
def test_load_tokenizer_finds_the_end_of_text_id(tmp_path, specials, eot):
    tok = load_tokenizer(_word_level(tmp_path, specials))
    assert tok.eot_id == (None if eot is None else 3 + specials.index(eot))
    assert tok.vocab_size == 3 + len(specials)


def test_unreadable_tokenizers_fail_in_one_line(tmp_path):
    for path, match in [(tmp_path / "missing.json", "cannot read tokenizer .*missing.json"),
                        (tmp_path, "cannot read tokenizer .*tokenizer.json"),
                        (tmp_path / "bad.json", "bad.json is not JSON"),
                        (tmp_path / "other.json", "not a valid tokenizer.json")]:
        if path.name == "bad.json":
            path.write_text("{not json")
        if path.name == "other.json":
            path.write_text('{"model": 3}')
        with pytest.raises(DataError, match=match) as e:
            load_tokenizer(path)
        assert "\n" not in str(e.value)


def test_bad_specs_fail_in_one_line(tmp_path):
    assert parse_spec("bytes").kind == "bytes"
    assert (parse_spec("bpe:512").kind, parse_spec("bpe:512").vocab_size) == ("bpe", 512)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert parse_spec(str(tmp_path)).path == str(tmp_path)
    for bad in ["", "byte", "bpe", "bpe:", "bpe:x", "bpe:-300", "bpe:1e3", "bpe:256",
                str(tmp_path / "missing.json")]:
        with pytest.raises(ConfigError) as e:
            parse_spec(bad)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="at least 257"):
        train_bpe(["some text"], 256)
    with pytest.raises(ConfigError, match="--tokenizer must be"):
        data.DataConfig(tokenizer="bpe2")


def test_token_file_ids_are_uint16_up_to_65536_and_uint32_beyond(tmp_path):
    rng = np.random.default_rng(0)
    for vocab, width in [(1000, 2), (1 << 16, 2), ((1 << 16) + 1, 4), (200_000, 4)]:
        ids = rng.integers(0, vocab, size=3001)
        ids[-1] = vocab - 1
        path = tmp_path / f"{vocab}.tokens"
        with TokenWriter(path, vocab) as w:
            for chunk in np.array_split(ids, 7):  # appended document by document
                w.write(chunk)
        raw = path.read_bytes()
        magic, version, stored_width, stored_vocab, count = struct.unpack_from("<8sIIQQ", raw)
        assert (stored_width, stored_vocab, count) == (width, vocab, len(ids))
        assert len(raw) == 64 + width * len(ids)
        np.testing.assert_array_equal(np.frombuffer(raw[64:], dtype=f"<u{width}"), ids)
        tf = read_tokens(path)
        assert tf.tokens.dtype.itemsize == width and isinstance(tf.tokens, np.memmap)
        np.testing.assert_array_equal(tf.tokens, ids)
    with pytest.raises(DataError, match="do not fit a vocab of 10"):
        with TokenWriter(tmp_path / "x.tokens", 10) as w:
            w.write([3, 10])


def test_an_interrupted_write_leaves_no_file(tmp_path):
    with pytest.raises(RuntimeError):
        with TokenWriter(tmp_path / "a.tokens", 100) as w:
            w.write(np.arange(50))
            raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


def test_corrupt_token_files_fail_in_one_line(tmp_path):
    path = tmp_path / "good.tokens"
    with TokenWriter(path, 500) as w:
        w.write(np.arange(400))
    raw = path.read_bytes()
    cases = {"truncated": raw[:-1], "longer": raw + b"\x00\x00", "short": raw[:40], "empty": b"",
             "magic": b"NOTTOKEN" + raw[8:], "version": raw[:8] + struct.pack("<I", 99) + raw[12:],
             "width": raw[:12] + struct.pack("<I", 4) + raw[16:]}
    for name, content in cases.items():
        bad = tmp_path / f"{name}.tokens"
        bad.write_bytes(content)
        with pytest.raises(DataError, match=f"{name}.tokens is not a valid token file") as e:
            read_tokens(bad)
        assert "\n" not in str(e.value)
        with pytest.raises(DataError, match="not a valid token file"):
            data.load_corpus(data.DataConfig(path=str(bad)))


class _WideTokenizer(Tokenizer):
    """Each character is one id above 66,000: a vocabulary too large for uint16."""

    spec, vocab_size, eot_id = "wide", 66_000 + 0x3000, 65_999

    def encode(self, text: str) -> np.ndarray:
        return 66_000 + np.array([ord(c) for c in text], dtype=np.int64)

    def decode(self, ids) -> str:
        return "".join("\x1e" if i == self.eot_id else chr(i - 66_000) for i in np.asarray(ids).tolist())

    def to_json(self) -> None:
        return None


def test_a_large_vocab_corpus_round_trips_through_uint32_token_files(tmp_path):
    docs = {"a.txt": "first document\n" * 40, "b.md": "second, ü and ñ\n" * 40, "c.py": "x = 1\n" * 40}
    folder = _folder(tmp_path / "docs", docs)
    corpus = data.load_corpus(data.DataConfig(path=str(folder), cache_dir=str(tmp_path / "cache")),
                              tokenizer=_WideTokenizer())
    assert corpus.train.dtype == np.dtype("<u4") and corpus.vocab_size == _WideTokenizer.vocab_size
    whole = corpus.tokenizer.decode(np.concatenate([corpus.train, corpus.val]))
    assert whole == "\x1e".join(docs[k] for k in sorted(docs))


def _corpus_docs() -> dict[str, str | bytes]:
    docs = dict(zip(["a.py", "b.py", "c.py"], _stdlib_docs(3)))
    docs.update({"d.txt": UNICODE * 20, "e.md": ODD * 10, "f.txt": "the end of the corpus.\n" * 300,
                 "latin1.txt": "caf\xe9 latin-1 only\n".encode("latin-1"), "skip.bin": b"\xff\xfe",
                 "empty.txt": ""})
    return docs


def test_bpe_corpus_joins_documents_with_end_of_text(tmp_path):
    docs = _corpus_docs()
    folder = _folder(tmp_path / "docs", docs)
    cfg = data.DataConfig(path=str(folder), tokenizer="bpe:700", cache_dir=str(tmp_path / "cache"))
    corpus = data.load_corpus(cfg)
    tok = corpus.tokenizer
    assert corpus.vocab_size == tok.vocab_size <= 700 and tok.spec == "bpe:700"
    assert corpus.train.dtype == np.uint16 and corpus.train.max() < corpus.vocab_size
    texts = [docs[k] for k in sorted(docs) if k.endswith((".py", ".txt", ".md")) and k not in
             ("latin1.txt", "empty.txt")]  # not UTF-8, and no text
    train, val = tok.decode(corpus.train), tok.decode(corpus.val)
    assert train + val == EOT.join(texts)
    total = sum(len(t.encode("utf-8")) for t in texts)
    assert len(val.encode("utf-8")) == int(total * cfg.val_fraction)
    assert np.sum(corpus.train == tok.eot_id) == len(texts) - 1 and not np.any(corpus.val == tok.eot_id)


def test_byte_corpus_separates_documents_with_nul(tmp_path):
    docs = {"b.txt": "second\n" * 30, "a.md": "first ü\n" * 30, "c/d.py": "nested = 1\n" * 30,
            "ignored.json": "{}"}
    (tmp_path / "docs" / "c").mkdir(parents=True)
    for name, text in docs.items():
        (tmp_path / "docs" / name).write_text(text, encoding="utf-8")
    corpus = data.load_corpus(data.DataConfig(path=str(tmp_path / "docs"), val_fraction=0.1))
    assert isinstance(corpus.tokenizer, ByteTokenizer) and corpus.vocab_size == 256
    joined = np.concatenate([corpus.train, corpus.val]).tobytes()
    assert joined == b"\0".join(docs[k].encode("utf-8") for k in ("a.md", "b.txt", "c/d.py"))
    assert not (tmp_path / "cache").exists()


def test_bpe_is_trained_on_the_training_split_only(tmp_path):
    train_word, val_word = "quetzalcoatl", "zyxwvutsrqpon"
    docs = {"1.txt": f"{train_word} and more words here\n" * 100, "2.txt": f"{val_word} " * 150}
    folder = _folder(tmp_path / "docs", docs)
    cfg = data.DataConfig(path=str(folder), tokenizer="bpe:2000", val_fraction=0.5, cache_dir=str(tmp_path / "c"))
    assert len(docs["2.txt"]) <= int(sum(map(len, docs.values())) * cfg.val_fraction)  # 2.txt is validation only
    corpus = data.load_corpus(cfg)
    tok = corpus.tokenizer
    assert val_word in tok.decode(corpus.val) and val_word not in tok.decode(corpus.train)
    assert len(tok.encode(train_word)) == 1  # it starts each line
    assert len(tok.encode(" " + val_word)) > 3
    everything = train_bpe(docs.values(), 2000)  # control: trained on both, the word is merged
    assert len(everything.encode(" " + val_word)) == 1


def test_a_second_load_reuses_the_cached_tokens(tmp_path, monkeypatch):
    folder = _folder(tmp_path / "docs", {"a.txt": UNICODE * 50, "b.py": _stdlib_docs(1)[0]})
    cfg = data.DataConfig(path=str(folder), tokenizer="bpe:500", cache_dir=str(tmp_path / "cache"))
    first = data.load_corpus(cfg)
    cache = tmp_path / "cache"
    assert sorted(f.suffix for f in cache.iterdir()) == [".json", ".tokens", ".tokens"]
    mtimes = {f.name: f.stat().st_mtime_ns for f in cache.iterdir()}

    def fail(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(HFTokenizer, "encode_batch", fail)
    monkeypatch.setattr(HFTokenizer, "encode", fail)
    monkeypatch.setattr(data, "train_bpe", fail)
    again = data.load_corpus(cfg)
    np.testing.assert_array_equal(again.train, first.train)
    np.testing.assert_array_equal(again.val, first.val)
    assert again.tokenizer.to_json() == first.tokenizer.to_json()
    # a resumed run passes the tokenizer saved with its checkpoint: same token files
    resumed = data.load_corpus(cfg, tokenizer=HFTokenizer.from_json(first.tokenizer.to_json()))
    np.testing.assert_array_equal(resumed.train, first.train)
    assert {f.name: f.stat().st_mtime_ns for f in cache.iterdir()} == mtimes

    for changed in (data.DataConfig(path=str(folder), tokenizer="bpe:500", cache_dir=cfg.cache_dir, val_fraction=0.1),
                    data.DataConfig(path=str(folder), tokenizer="bpe:501", cache_dir=cfg.cache_dir)):
        with pytest.raises(AssertionError, match="tokenized again"):
            data.load_corpus(changed)
    with pytest.raises(AssertionError, match="tokenized again"):  # the split is part of the key
        data.load_corpus(data.DataConfig(path=str(folder), cache_dir=cfg.cache_dir, val_fraction=0.1),
                         tokenizer=first.tokenizer)
    (folder / "a.txt").write_text(UNICODE * 51, encoding="utf-8")
    with pytest.raises(AssertionError, match="tokenized again"):
        data.load_corpus(cfg)


def test_long_documents_are_encoded_in_pieces_without_changing_the_ids(bpe, tmp_path, monkeypatch):
    text = "".join(_stdlib_docs(3)) + ODD * 20 + UNICODE * 20 + "an ASCII tail\n" * 300
    (tmp_path / "long.txt").write_text(text, encoding="utf-8")
    monkeypatch.setattr(data, "_PIECE", 64)  # cut every few lines
    monkeypatch.setattr(data, "_BATCH", 1000)
    pieces = list(data._pieces(tmp_path / "long.txt", 0, len(text.encode("utf-8"))))
    assert len(pieces) > 100 and "".join(pieces) == text
    corpus = data.load_corpus(data.DataConfig(path=str(tmp_path / "long.txt"), cache_dir=str(tmp_path / "c")),
                              tokenizer=bpe)
    raw = text.encode("utf-8")
    cut = len(raw) - int(len(raw) * 0.05)
    assert raw[cut] < 0x80  # an ASCII character at the split: the cut is there
    np.testing.assert_array_equal(corpus.train, bpe.encode(raw[:cut].decode("utf-8")))
    np.testing.assert_array_equal(corpus.val, bpe.encode(raw[cut:].decode("utf-8")))


def test_the_default_corpus_trains_bpe_on_utf8_sources(tmp_path):
    cfg = data.DataConfig(max_bytes=200_000, tokenizer="bpe:400", cache_dir=str(tmp_path))
    corpus = data.load_corpus(cfg)
    assert corpus.name == data.STDLIB and corpus.vocab_size == 400
    n = len(corpus.tokenizer.decode(corpus.train).encode()) + len(corpus.tokenizer.decode(corpus.val).encode())
    eots = int(np.sum(corpus.train == corpus.tokenizer.eot_id) + np.sum(corpus.val == corpus.tokenizer.eot_id))
    assert 200_000 - 3 <= n - eots * len(EOT) <= 200_000 and eots > 3  # capped at a character
    assert len(list(tmp_path.glob("*.tokens"))) == 2 and len(list(tmp_path.glob("bpe-*.json"))) == 1


def test_pre_tokenized_data_and_tokenizers(bpe, tmp_path):
    with TokenWriter(tmp_path / "c.tokens", bpe.vocab_size) as w:
        w.write(bpe.encode(UNICODE * 30))
    bpe.save(tmp_path)
    corpus = data.load_corpus(data.DataConfig(path=str(tmp_path / "c.tokens"), tokenizer=str(tmp_path)))
    assert corpus.vocab_size == bpe.vocab_size and corpus.tokenizer.to_json() == bpe.to_json()
    assert corpus.tokenizer.decode(np.concatenate([corpus.train, corpus.val])) == UNICODE * 30
    plain = data.load_corpus(data.DataConfig(path=str(tmp_path / "c.tokens")))
    assert plain.tokenizer is None and plain.vocab_size == bpe.vocab_size
    with pytest.raises(ConfigError, match="already tokenized"):
        data.load_corpus(data.DataConfig(path=str(tmp_path / "c.tokens"), tokenizer="bpe:300"))
    with pytest.raises(DataError, match="beyond the vocab of 256"):
        data.load_corpus(data.DataConfig(path=str(tmp_path / "c.tokens")), tokenizer=ByteTokenizer())


def test_a_folder_without_text_fails_clearly(tmp_path):
    _folder(tmp_path / "docs", {"a.txt": b"\xff\xfe not utf-8", "b.json": "{}"})
    with pytest.raises(DataError, match="holds no UTF-8 text"):
        data.load_corpus(data.DataConfig(path=str(tmp_path / "docs"), tokenizer="bpe:300", cache_dir=str(tmp_path)))
    (tmp_path / "none").mkdir()
    with pytest.raises(DataError, match="holds no .txt/.md/.py files"):
        data.load_corpus(data.DataConfig(path=str(tmp_path / "none")))
