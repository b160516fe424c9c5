"""Record corpora (JSONL plain/gzip/zstd, Parquet, Arrow, a `datasets` folder from save_to_disk):
the same documents give the same tokens and the same losses as a folder of text files, in every
format; bad records are one line naming the file and row."""

import gzip
import json
import random
import shutil
from pathlib import Path

import numpy as np
import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from jaxshard.data import records
from jaxshard.data.corpus import TEXT_SUFFIXES, DataConfig, load_corpus, load_eval_sets
from jaxshard.errors import DataError
from jaxshard.train import main

ROOT = Path(__file__).resolve().parents[1]
WORDS = "alpha beta gamma délta ε 数据 def return class\tindent".split(" ")


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    """The same 40 random documents (non-ASCII, some empty) as a text folder and as records."""
    root = tmp_path_factory.mktemp("records")
    rng = random.Random(0)
    docs = ["" if i % 13 == 5 else " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 400))) + "\n"
            for i in range(40)]
    (root / "folder").mkdir()
    for i, d in enumerate(docs):
        (root / "folder" / f"{i:03d}.txt").write_text(d, encoding="utf-8")
    lines = "".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs))
    (root / "c.jsonl").write_text(lines, encoding="utf-8")
    with gzip.open(root / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(lines)
    (root / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode("utf-8")))
    (root / "pq").mkdir()
    for part, rows in enumerate((docs[:17], docs[17:])):  # two shards, a row group each
        pq.write_table(pa.table({"text": rows, "n": [len(r) for r in rows]}), root / "pq" / f"part-{part}.parquet")
    with pa.OSFile(str(root / "c.arrow"), "wb") as sink, pa.ipc.new_file(sink, pa.schema([("text", pa.string())])) as w:
        w.write_table(pa.table({"text": docs}))
    with pa.OSFile(str(root / "stream.arrow"), "wb") as sink, \
            pa.ipc.new_stream(sink, pa.schema([("text", pa.large_string())])) as w:
        w.write_table(pa.table({"text": pa.array(docs, pa.large_string())}))
    # Hugging Face datasets' own writer: a Dataset in three shards, and a DatasetDict whose
    # train split is the documents picked in order from a larger set (save_to_disk writes the
    # rows an indices mapping selects).
    datasets.disable_progress_bars()
    table = datasets.Dataset.from_dict({"text": docs, "id": list(range(len(docs)))})
    table.save_to_disk(str(root / "ds"), num_shards=3)
    bigger = datasets.Dataset.from_dict({"text": ["x"] * 5 + docs + ["y"] * 5})
    datasets.DatasetDict({"validation": bigger.select(range(3)), "train": bigger.select(range(5, 5 + len(docs)))}
                         ).save_to_disk(str(root / "dsdict"))
    return root


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe:300"])
def test_every_format_gives_the_folders_tokens(formats, tokenizer, tmp_path):
    def tokens(path):
        c = load_corpus(DataConfig(path=str(formats / path), tokenizer=tokenizer, cache_dir=str(tmp_path)))
        return np.asarray(c.train), np.asarray(c.val)

    want = tokens("folder")
    assert len(want[0]) > 1000 and len(want[1]) > 10
    for path in ["c.jsonl", "c.jsonl.gz", "c.jsonl.zst", "pq", "pq/*.parquet", "c.arrow", "stream.arrow", "ds",
                 "dsdict", "dsdict/train"]:
        got = tokens(path)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), path


def test_a_saved_dataset_is_read_in_its_state_files_order(formats, tmp_path):
    """Its shards as state.json lists them, not by name: reversed there, read reversed."""
    shutil.copytree(formats / "ds", tmp_path / "ds")
    state = json.loads((tmp_path / "ds" / "state.json").read_text())
    names = [f["filename"] for f in state["_data_files"]]
    assert len(names) == 3
    state["_data_files"].reverse()
    (tmp_path / "ds" / "state.json").write_text(json.dumps(state))
    assert [p.name for p in records.shards(str(tmp_path / "ds"), TEXT_SUFFIXES)] == names[::-1]


@pytest.mark.parametrize("edit, message", [
    (lambda d: (d / "dataset_dict.json").write_text('{"splits": ["test", "validation"]}'),
     "{d} is a datasets DatasetDict with splits test, validation and no 'train': give its split's folder, "
     "e.g. {d}/test"),
    (lambda d: (d / "train" / "data-00000-of-00001.arrow").unlink(),
     "{d}/train/state.json lists data-00000-of-00001.arrow, which is not in {d}/train"),
    (lambda d: (d / "train" / "state.json").write_text("{"), "cannot read {d}/train/state.json: "),
    (lambda d: (d / "train" / "state.json").write_text('{"_data_files": 3}'),
     "{d}/train/state.json: no list of _data_files with file names"),
])
def test_bad_saved_datasets_are_one_line(formats, tmp_path, edit, message):
    shutil.copytree(formats / "dsdict", tmp_path / "d")
    edit(tmp_path / "d")
    with pytest.raises(DataError) as e:
        load_corpus(DataConfig(path=str(tmp_path / "d"), cache_dir=str(tmp_path / "cache")))
    assert str(e.value).startswith(message.format(d=tmp_path / "d")), str(e.value)


def test_a_saved_dataset_dict_validates_on_its_validation_split(formats, tmp_path):
    """As --eval-data a DatasetDict gives its validation split (three "x" records), not train."""
    cfg = DataConfig(path=str(formats / "folder"), eval_data=f"v={formats / 'dsdict'}", cache_dir=str(tmp_path))
    (tokens,) = load_eval_sets(cfg, load_corpus(cfg)).values()
    assert bytes(np.asarray(tokens)) == b"x\0x\0x"


def test_the_text_field_names_the_records_field_of_every_record_source(formats, tmp_path):
    """--text-field applies to the sources that are records, in a mixture and among the
    validation sets; the text folder beside them is read as text."""
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"body": f"document {i} " * 9}) + "\n" for i in range(30)))
    cfg = DataConfig(path=f"{tmp_path / 'b.jsonl'}:0.5,{formats / 'folder'}:0.5", text_field="body",
                     eval_data=f"f={formats / 'folder'},b={tmp_path / 'b.jsonl'}", cache_dir=str(tmp_path / "c"))
    corpus = load_corpus(cfg)
    assert bytes(np.asarray(corpus.sources[0].train[:9])) == b"document "
    sets = load_eval_sets(cfg, corpus)
    assert bytes(np.asarray(sets["b"][:9])) == b"document " and len(sets["f"]) > 1000
    with pytest.raises(DataError, match="is not records"):
        load_corpus(DataConfig(path=f"{formats / 'folder'}:1", text_field="body", cache_dir=str(tmp_path / "c")))


def test_the_text_field_chooses_the_document(formats, tmp_path):
    by_text = load_corpus(DataConfig(path=str(formats / "c.jsonl"), cache_dir=str(tmp_path)))
    (tmp_path / "r.jsonl").write_text("".join(json.dumps({"body": "x" * 50, "text": "y" * 50}) + "\n"
                                              for _ in range(20)))
    body = load_corpus(DataConfig(path=str(tmp_path / "r.jsonl"), text_field="body", cache_dir=str(tmp_path)))
    assert set(np.unique(body.train)) <= {ord("x"), 0} and len(by_text.train) > 1000


BAD = [
    ("a.jsonl", '{"text": "a"}\n{"body": "b", "id": 3}\n',
     "a.jsonl:2: no field 'text' (it has 'body', 'id'; --text-field names the text's)"),
    ("a.jsonl", '{"text": "a"}\n\n{"text": 5}\n', "a.jsonl:3: field 'text' is int, not a string"),
    ("a.jsonl", '{"text": "a"}\n{oops\n', "a.jsonl:2: not a JSON record (Expecting property name enclosed in "
                                        "double quotes)"),
    ("a.jsonl", '["text"]\n', "a.jsonl:1: a JSON list, not an object with a 'text' field"),
    ("a.jsonl", '{"text": "\\ud800"}\n', "a.jsonl:1: field 'text' is not valid Unicode (a lone surrogate)"),
    ("a.jsonl", '{"text": ""}\n', "data {dir}/a.jsonl holds no text: 1 record(s), all empty"),
    ("a.jsonl", "", "data {dir}/a.jsonl holds no records"),
    ("a.parquet", b"PAR1 not a parquet file", "cannot read {dir}/a.parquet: Parquet magic bytes not found"),
    ("a.jsonl.gz", b"\x1f\x8b\x08 truncated", "cannot read {dir}/a.jsonl.gz: "),
    ("a.jsonl.zst", zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"text": f"document {i ** 3}"}) + "\n" for i in range(2000)).encode())[:2000],
     "cannot read {dir}/a.jsonl.zst: the zstd stream ends early (a truncated file?)"),
    ("a.jsonl.zst", b"\x28\xb5\x2f\xfd not zstd", "cannot read {dir}/a.jsonl.zst: zstd decompressor error"),
    ("a.parquet", pa.table({"text": [1, 2]}), "a.parquet: field 'text' is int64, not a string"),
    ("a.parquet", pa.table({"text": ["a", None]}), "a.parquet:2: field 'text' is null, not a string"),
    ("a.parquet", pa.table({"body": ["a"]}), "a.parquet: no field 'text' (it has 'body'; --text-field"),
]


@pytest.mark.parametrize("name, content, message", BAD)
def test_bad_records_are_one_line_naming_the_file_and_row(tmp_path, name, content, message):
    path = tmp_path / "data" / name
    path.parent.mkdir()
    if isinstance(content, pa.Table):
        pq.write_table(content, path)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(DataError) as e:
        load_corpus(DataConfig(path=str(path), tokenizer="bpe:300", cache_dir=str(tmp_path / "cache")))
    text = str(e.value)
    assert "\n" not in text and message.format(dir=path.parent) in text, text
    assert not list((tmp_path / "cache").glob("docs-*")), "a failed spool left a file"


@pytest.mark.parametrize("files, data, message", [
    ([], "*.jsonl", "--data {d}/*.jsonl matches no file"),
    (["x.jsonl", "x.csv"], "x.*", "--data {d}/x.* matches {d}/x.csv, which is not a "
                                  ".jsonl/.jsonl.gz/.jsonl.zst/.parquet/.arrow shard"),
    (["x.jsonl", "y.txt"], "", "data folder {d} holds both record shards (x.jsonl) and text files: give one kind"),
])
def test_paths_that_name_no_clear_corpus_are_one_line(tmp_path, files, data, message):
    for name in files:
        (tmp_path / name).write_text('{"text": "a"}\n')
    with pytest.raises(DataError) as e:
        load_corpus(DataConfig(path=str(tmp_path / data) if data else str(tmp_path), cache_dir=str(tmp_path / "c")))
    assert str(e.value) == message.format(d=tmp_path)


def test_a_spool_cut_short_is_written_again(formats, tmp_path):
    def load():
        return np.asarray(load_corpus(DataConfig(path=str(formats / "c.jsonl"), cache_dir=str(tmp_path))).train)

    want = load()
    (spool,) = tmp_path.glob("docs-*.txt")
    spool.write_bytes(spool.read_bytes()[:-100])  # (a crash after the rename, before the disk had it)
    assert np.array_equal(load(), want)


def test_the_text_field_of_data_that_is_not_records_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("some text " * 100)
    with pytest.raises(DataError, match=r"^--text-field names a field of JSONL/Parquet/Arrow records; "
                                        r"--data .*a\.txt is not records$"):
        load_corpus(DataConfig(path=str(tmp_path / "a.txt"), text_field="body", cache_dir=str(tmp_path)))


def test_a_shard_whose_name_has_glob_characters_is_read_as_it_is(tmp_path):
    path = tmp_path / "part[1].jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(10)))
    assert len(load_corpus(DataConfig(path=str(path), cache_dir=str(tmp_path))).train) > 1000


def test_every_format_trains_to_the_folders_losses_and_bad_records_exit_2(formats, tmp_path, capsys):
    common = ["--model", "tiny", "--mesh", "data=8", "--cpu-devices", "8", "--platform", "cpu", "--steps", "2",
              "--batch-size", "16", "--seq-len", "16", "--eval-batches", "1", "--no-progress", "--tokenizer", "bpe:300"]

    def losses(data: str) -> list[tuple[float, float | None]]:
        metrics = tmp_path / f"{data.replace('/', '_')}.jsonl"
        assert main([*common, "--data", str(formats / data), "--metrics", str(metrics)]) == 0
        return [(r["loss"], r.get("val_loss")) for r in map(json.loads, metrics.read_text().splitlines())]

    want = losses("folder")
    assert len(want) == 2 and want[-1][1] is not None
    for data in ["c.jsonl.zst", "pq", "ds"]:
        assert losses(data) == want, data
    (tmp_path / "bad.jsonl").write_text('{"text": 1}\n')
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([*common, "--data", str(tmp_path / "bad.jsonl")])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'bad.jsonl'}:1: field 'text' is int, not a string"


def test_the_shipped_samples_hold_the_same_documents_in_both_formats(tmp_path):
    samples = ROOT / "data" / "samples"
    lines = [json.loads(line) for line in (samples / "docstrings.jsonl").read_text(encoding="utf-8").splitlines()]
    table = pq.read_table(samples / "docstrings.parquet")
    assert len(lines) >= 500 and table.column("text").to_pylist() == [r["text"] for r in lines]
    assert all(r["source"].startswith("python3.") and len(r["text"]) >= 40 for r in lines)
    corpora = [load_corpus(DataConfig(path=str(samples / name), tokenizer="bpe:300", cache_dir=str(tmp_path)))
               for name in ("docstrings.jsonl", "docstrings.parquet")]
    assert np.array_equal(corpora[0].train, corpora[1].train) and len(corpora[0].train) > 50_000
