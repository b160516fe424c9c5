"""Mixtures (--data a:0.7,b:0.3): documents drawn by weight, whole, each source's in a per-epoch
permutation; the realised shares within 2% of the weights over 10,000 documents, read from the
batches themselves; the same stream on any split of rows; a resumed run continues it."""

import json
import random
import re

import numpy as np
import pytest

from jaxshard.data.corpus import DataConfig, load_corpus, split_batches
from jaxshard.data.mixture import MixedBatches, parse
from jaxshard.errors import DataError
from jaxshard.train import main


def _source(letter: int, n_docs: int, rng: np.random.Generator) -> np.ndarray:
    """Documents of 1 to 40 copies of ``letter`` then their number (1..n), end-of-text (0) between."""
    out = []
    for i in range(n_docs):
        out += [letter] * int(rng.integers(1, 40)) + [100 + i % 100, 0]
    return np.array(out[:-1], np.uint8)


def _documents(batches, steps: int, batch: int) -> list[np.ndarray]:
    """The stream's documents, rebuilt from the inputs of ``steps`` consecutive batches."""
    stream = np.concatenate([batches.batch_at(i * batch)["inputs"].reshape(-1) for i in range(steps)])
    return [d for d in np.split(stream, np.flatnonzero(stream == 0) + 1)[1:-1]]  # (whole ones only)


def test_the_realised_shares_are_the_weights_within_2_percent():
    rng = np.random.default_rng(0)
    sources = [_source(1, 500, rng), _source(2, 700, rng), _source(3, 90, rng)]
    weights = [0.5, 0.3, 0.2]
    batches = MixedBatches(sources, weights, eot=0, seq_len=32, global_batch=16, seed=7)
    docs = _documents(batches, 500, 16)
    assert len(docs) >= 10_000
    letters = np.array([d[0] for d in docs])
    shares = np.bincount(letters, minlength=4)[1:] / len(docs)
    assert np.abs(shares - weights).max() < 0.02, shares
    # each document whole: its letter repeated, then its number, then the end-of-text id
    assert all((d[:-2] == d[0]).all() and d[-2] >= 100 and d[-1] == 0 for d in docs)
    # a source's documents are drawn in a permutation: the first 90 of source 3 (its 90, each
    # numbered apart) are distinct but for one, where the stream's first, cut, document was its
    third = [tuple(d) for d in docs if d[0] == 3][:90]
    assert len(third) == 90 and len(set(third)) >= 89
    drawn = batches.drawn(500 * 16)
    assert sum(d["documents"] for d in drawn) >= len(docs)
    assert [round(d["share"], 2) for d in drawn] == pytest.approx(shares, abs=0.011)


def test_any_split_of_rows_and_columns_reads_the_same_stream():
    rng = np.random.default_rng(1)
    sources = [_source(1, 60, rng), _source(2, 60, rng)]
    whole = MixedBatches(sources, [0.6, 0.4], 0, 16, 8, seed=3)
    parts = [MixedBatches(sources, [0.6, 0.4], 0, 16, 8, seed=3, rows=slice(r, r + 4), cols=slice(c, c + 8))
             for r in (0, 4) for c in (0, 8)]
    for step in range(30):
        want = whole.batch_at(step * 8)
        got = [p.batch_at(step * 8) for p in parts]
        for k in ("inputs", "targets"):
            assert np.array_equal(np.block([[got[0][k], got[1][k]], [got[2][k], got[3][k]]]), want[k])
        assert np.array_equal(want["inputs"][:, 1:], want["targets"][:, :-1])
    other = MixedBatches(sources, [0.6, 0.4], 0, 16, 8, seed=4)
    assert not np.array_equal(other.batch_at(0)["inputs"], whole.batch_at(0)["inputs"])


def test_a_seeked_stream_continues_where_it_stood():
    rng = np.random.default_rng(2)
    sources = [_source(1, 40, rng), _source(2, 300, rng)]
    first = MixedBatches(sources, [0.3, 0.7], 0, 16, 4, seed=5)
    want = [first.batch_at(i * 4)["inputs"] for i in range(60)]
    position = json.loads(json.dumps(first.position(25 * 4)))  # (as a checkpoint's record keeps it)
    again = MixedBatches(sources, [0.3, 0.7], 0, 16, 4, seed=5)
    again.seek(position)
    assert all(np.array_equal(again.batch_at(i * 4)["inputs"], want[i]) for i in range(25, 60))
    assert position == again.position(25 * 4) and position["draw"] > 0 and sum(position["taken"]) == position["draw"]
    with pytest.raises(DataError, match=r"^the checkpoint's data mixture was 0:0.3,1:0.7; this run's is "
                                        r"0:0.5,1:0.5: resume with the same --data$"):
        MixedBatches(sources, [0.5, 0.5], 0, 16, 4, seed=5).seek(position)


@pytest.mark.parametrize("spec, message", [
    ("a.jsonl:0.7,b", "--data a.jsonl:0.7,b: a mixture gives each source a weight, PATH:WEIGHT; 'b' has none"),
    ("a:0.5,b:-1", "--data a:0.5,b:-1: the weight of b must be a positive number, got -1"),
    ("a:1,b:nan", "--data a:1,b:nan: the weight of b must be a positive number, got nan"),
    ("a:1,a:2", "--data a:1,a:2: a is given twice"),
])
def test_bad_mixtures_are_one_line(spec, message):
    with pytest.raises(DataError) as e:
        parse(spec)
    assert str(e.value) == message


def test_token_ids_in_a_mixture_need_their_tokenizer(tmp_path):
    ids = tmp_path / "ids.bin"
    np.arange(300, dtype="<u2").tofile(ids)
    (tmp_path / "t.txt").write_text("some text " * 50)
    with pytest.raises(DataError) as e:
        load_corpus(DataConfig(path=f"{ids}:0.5,{tmp_path / 't.txt'}:0.5", cache_dir=str(tmp_path)))
    assert str(e.value) == (f"a mixture reads its sources with one tokenizer, and {ids} is token ids: give the "
                            "--tokenizer they were made with (its tokenizer.json)")


def test_parsing_a_mixture():
    assert parse("web.jsonl:3,code/:1") == [("web.jsonl", 0.75), ("code/", 0.25)]
    assert parse("one.txt") is None and parse(None) is None and parse("host:dir/x") is None


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    (root / "web.jsonl").write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(
        rng.randint(5, 60)))}) + "\n" for _ in range(300)))
    (root / "code").mkdir()
    for i in range(30):
        (root / "code" / f"m{i}.py").write_text("".join(f"def f{j}(x):\n    return x + {j}\n" for j in range(i + 3)))
    return root


def _pieces(tokens, eot: int) -> list[tuple]:
    """``tokens`` cut at each end-of-text id (dropped)."""
    tokens = np.asarray(tokens)
    return [tuple(int(t) for t in p[p != eot]) for p in np.split(tokens, np.flatnonzero(tokens == eot) + 1)
            if (p != eot).any()]


def test_validation_draws_the_sources_tail_splits_in_order(corpora):
    """The validation batches hold only documents of the sources' validation (tail) splits,
    each source's in the order of its split (round again when done; a split's first may be the
    tail of a training document), drawn by the same weights."""
    corpus = load_corpus(DataConfig(path=f"{corpora / 'web.jsonl'}:0.7,{corpora / 'code'}:0.3", tokenizer="bpe:300"))
    eot = corpus.tokenizer.eot_id
    val = split_batches(corpus, "val", 32, 4, seed=0)
    stream = np.concatenate([val.batch_at(i * 4)["inputs"].reshape(-1) for i in range(40)])
    drawn = _pieces(stream, eot)[1:-1]  # (whole ones)
    splits = [_pieces(s.val, eot) for s in corpus.sources]
    assert all(sum(d in docs for docs in splits) == 1 for d in drawn)  # each is one split's
    of = [next(k for k, docs in enumerate(splits) if d in docs) for d in drawn]
    for k, docs in enumerate(splits):
        mine = [docs.index(d) for d, j in zip(drawn, of) if j == k]
        assert len(mine) > 3 and all(b == (a + 1) % len(docs) for a, b in zip(mine, mine[1:])), (k, mine)
    share = of.count(0) / len(of)
    assert abs(share - 0.7) < 0.15, share


def test_a_mixture_trains_and_resumes_to_the_same_losses(corpora, tmp_path, monkeypatch, capsys):
    data = f"{corpora / 'web.jsonl'}:0.7,{corpora / 'code'}:0.3"
    common = ["--model", "tiny", "--n-layers", "1", "--mesh", "data=8", "--cpu-devices", "8", "--platform", "cpu",
              "--batch-size", "8", "--seq-len", "32", "--eval-every", "0", "--eval-batches", "1", "--warmup-steps",
              "0", "--decay-steps", "6", "--no-progress", "--data", data, "--tokenizer", "bpe:300"]

    def run(name: str, *flags: str) -> list[float]:
        metrics = tmp_path / f"{name}.jsonl"
        assert main([*common, "--metrics", str(metrics), "--report", str(tmp_path / f"{name}.json"), *flags]) == 0
        return [r["loss"] for r in map(json.loads, metrics.read_text().splitlines())]

    whole = run("whole", "--steps", "6")
    run("cut", "--steps", "3", "--checkpoint-dir", str(tmp_path / "ck"))
    seeks = []  # the resumed run starts from the checkpoint's place in the stream, not by replaying it
    seek = MixedBatches.seek
    monkeypatch.setattr(MixedBatches, "seek", lambda self, p: (seeks.append(p), seek(self, p))[1])
    resumed = run("cut", "--steps", "6", "--checkpoint-dir", str(tmp_path / "ck"), "--resume")
    assert resumed == whole
    assert len(seeks) == 1 and seeks[0]["offset"] == 3 * 8 and seeks[0]["draw"] > 0
    # one of its sources alone would read other documents at the mixture's count of samples
    before = (tmp_path / "cut.jsonl").read_text()
    alone = [str(corpora / "web.jsonl") if f == data else f for f in common]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        main([*alone, "--metrics", str(tmp_path / "cut.jsonl"), "--steps", "7", "--checkpoint-dir",
              str(tmp_path / "ck"), "--resume"])
    error = capsys.readouterr().err.strip()
    assert exit.value.code == 2 and re.fullmatch(r"error: the checkpoint was trained on the mixture \S*web\.jsonl:0\.7,"
                                                 r"\S*code:0\.3: resume with the same --data", error), error
    assert (tmp_path / "cut.jsonl").read_text() == before
    report = json.loads((tmp_path / "whole.json").read_text())
    assert [d["source"] for d in report["mixture"]] == [str(corpora / "web.jsonl"), str(corpora / "code")]
    assert sum(d["documents"] for d in report["mixture"]) > 0
    assert json.loads((tmp_path / "cut.json").read_text())["mixture"] == report["mixture"]
    corpus = load_corpus(DataConfig(path=data, tokenizer="bpe:300"))  # (the run's tokenizer, cached)
    assert [s.weight for s in corpus.sources] == [0.7, 0.3] and corpus.tokenizer.eot_id is not None
