"""--eval-data: more validation sets, each evaluated whole-window by the same program as the
tail split, logged as val/NAME/loss and val/NAME/perplexity in the metrics, TensorBoard and the
report; bad sets are one line."""

import json
import math
import random

import numpy as np
import pytest

from jaxshard.data import corpus as corpus_lib
from jaxshard.data.corpus import DataConfig, load_corpus, write_bin
from jaxshard.train import main
from jaxshard.training.observe import read_scalars

COMMON = ["--model", "tiny", "--n-layers", "1", "--mesh", "data=4,tensor=2", "--cpu-devices", "8",
          "--platform", "cpu", "--steps", "3", "--batch-size", "8", "--seq-len", "16", "--eval-every", "2",
          "--eval-batches", "2", "--warmup-steps", "0", "--no-progress"]


def _text(rng: random.Random, n: int) -> str:
    words = "lorem ipsum dolor sit amet consectetur adipiscing élit sed do eiusmod tempor".split()
    return " ".join(rng.choice(words) for _ in range(n)) + "\n"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval-data")
    rng = random.Random(1)
    (root / "train.txt").write_text(_text(rng, 3000), encoding="utf-8")
    (root / "other").mkdir()
    for i in range(3):
        (root / "other" / f"{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 40)
    return root


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe:300"])
def test_a_copy_of_the_tail_split_scores_as_the_tail_split(data, tokenizer, tmp_path):
    """The tail split's own text (as JSONL) and ids (as a .bin), given as eval sets, score exactly
    as the tail split does; another set scores otherwise. Perplexity is the loss's exponential."""
    cfg = DataConfig(path=str(data / "train.txt"), tokenizer=tokenizer)  # the run's cache
    c = load_corpus(cfg)
    _, (tail,) = corpus_lib._split_documents(corpus_lib._source(cfg), cfg.val_fraction)
    f, a, b = tail
    text = f.read_bytes()[a:b].decode("utf-8")
    (tmp_path / "tail.jsonl").write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
    write_bin(tmp_path / "tail.bin", np.asarray(c.val))
    sets = f"text={tmp_path / 'tail.jsonl'},ids={tmp_path / 'tail.bin'},other={data / 'other'}"
    argv = [*COMMON, "--data", str(data / "train.txt"), "--tokenizer", tokenizer, "--eval-data", sets,
            "--metrics", str(tmp_path / "m.jsonl"), "--report", str(tmp_path / "r.json"),
            "--tensorboard", str(tmp_path / "tb"), "--eval-at-start"]
    assert main(argv) == 0
    evals = [r for r in map(json.loads, (tmp_path / "m.jsonl").read_text().splitlines()) if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 2, 3]
    for r in evals:
        assert r["val/text/loss"] == pytest.approx(r["val_loss"], rel=1e-6)
        assert r["val/ids/loss"] == pytest.approx(r["val_loss"], rel=1e-6)
        assert abs(r["val/other/loss"] - r["val_loss"]) > 1e-3
        for name in ("text", "ids", "other"):
            assert r[f"val/{name}/perplexity"] == pytest.approx(math.exp(r[f"val/{name}/loss"]), rel=1e-6)
    assert evals[-1]["val/other/loss"] < evals[0]["val/other/loss"]  # it learns (a shared alphabet)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["eval_sets"]["other"]["final_loss"] == evals[-1]["val/other/loss"]
    assert report["eval_sets"]["ids"]["tokens"] == len(c.val)
    scalars = read_scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["val/other/loss"]] == [0, 2, 3]
    assert scalars["val/text/perplexity"][-1][1] == pytest.approx(evals[-1]["val/text/perplexity"], rel=1e-6)


@pytest.mark.parametrize("spec, files, message", [
    ("x", {}, "--eval-data takes NAME=PATH,...; got 'x'"),
    ("a/b=t.txt", {}, "--eval-data: the name 'a/b' must be letters, digits, '_', '.' or '-' (it becomes the "
                      "metric val/NAME/loss)"),
    ("a=t.txt,a=t.txt", {}, "--eval-data names a twice"),
    ("a=missing.txt", {}, "--eval-data a: data file not found: missing.txt"),
    ("a=s.txt", {"s.txt": "short"}, "the --eval-data set a has 5 tokens, fewer than --seq-len + 1 = 17"),
    ("a=big.bin", {"big.bin": np.array([1, 300], "<u2")},
     "--eval-data a: big.bin holds ids up to 300, beyond the training data's vocabulary of 256"),
    ("a=t.txt", {"ids.bin": np.arange(200, dtype="<u2")},
     "--eval-data a: t.txt is text, but the training data came as token ids without a tokenizer to read "
     "it with (give --tokenizer)"),
])
def test_bad_eval_sets_are_one_line(data, tmp_path, monkeypatch, capsys, spec, files, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text(_text(random.Random(2), 50))
    for name, content in files.items():
        if isinstance(content, str):
            (tmp_path / name).write_text(content)
        else:
            content.tofile(tmp_path / name)
    train = "ids.bin" if "ids.bin" in files else str(data / "train.txt")
    with pytest.raises(SystemExit) as e:
        main([*COMMON, "--data", train, "--eval-data", spec])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"
