"""Corpora of records: JSONL (plain, gzip or zstd), Parquet and Arrow shards, one text field each.

``--data`` names one shard, a folder of shards, a glob of them (``'shards/*.parquet'``), or a
Hugging Face ``datasets`` folder written by ``save_to_disk`` (its Arrow shards in the order its
``state.json`` lists them; a ``DatasetDict``'s ``train`` split, or the split folder named);
``--text-field`` (default ``text``) says which field of a record is its document. Shards are read
in sorted order, a record at a time or a batch of rows at a time (pyarrow), never whole; a bad
record is one line naming the file and the row (counted from 1, as a line number is).
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import json
from pathlib import Path
from typing import Iterator

from jaxshard.errors import DataError

JSONL = (".jsonl", ".jsonl.gz", ".jsonl.zst")
EVAL_SPLITS = ("validation", "valid", "val", "test")  # a DatasetDict's splits a validation set reads, in order
SHARD_SUFFIXES = (*JSONL, ".parquet", ".arrow")
_ROWS = 1024  # Parquet/Arrow rows read at once


def _kind(path: Path) -> str | None:
    name = path.name
    for suffix in SHARD_SUFFIXES:
        if name.endswith(suffix):
            return "jsonl" if suffix in JSONL else suffix[1:]
    return None


def shards(path: str, text_suffixes: tuple[str, ...], splits: tuple[str, ...] = ("train",)) -> list[Path] | None:
    """The shards of the record corpus at ``path``, in order; None where ``path`` is not one
    (a text file or a folder of text files). ``splits``: those of a ``datasets`` DatasetDict
    to read, the first it has."""
    if any(c in path for c in "*?[") and not Path(path).exists():
        files = sorted(Path(p) for p in glob.glob(path, recursive=True))
        if not files:
            raise DataError(f"--data {path} matches no file")
        odd = [f for f in files if not _kind(f)]
        if odd:
            raise DataError(f"--data {path} matches {odd[0]}, which is not a "
                            f"{'/'.join(SHARD_SUFFIXES)} shard")
        return files
    p = Path(path)
    if p.is_file():
        return [p] if _kind(p) else None
    if p.is_dir():
        saved = _saved_dataset(p, splits)
        if saved is not None:
            return saved
        found = sorted(f for f in p.rglob("*") if f.is_file() and _kind(f))
        if found and any(f.suffix in text_suffixes for f in p.rglob("*") if f.is_file()):
            raise DataError(f"data folder {p} holds both record shards ({found[0].name}) and text files: "
                            "give one kind")
        return found or None
    return None


def _saved_dataset(folder: Path, wanted: tuple[str, ...] = ("train",)) -> list[Path] | None:
    """The shards of a ``datasets`` folder saved with ``save_to_disk``, in its order: a
    ``Dataset`` (``state.json`` lists its Arrow files) or a ``DatasetDict`` (``dataset_dict.json``
    lists its splits, each a ``Dataset`` folder; the first of ``wanted`` it has is read). None
    where ``folder`` is neither."""
    if (folder / "dataset_dict.json").is_file():
        splits = _json(folder / "dataset_dict.json", "a datasets DatasetDict file").get("splits")
        if not isinstance(splits, list) or not splits:
            raise DataError(f"{folder / 'dataset_dict.json'}: lists no splits")
        split = next((s for s in wanted if s in splits), None)
        if split is None:
            raise DataError(f"{folder} is a datasets DatasetDict with splits {', '.join(map(str, splits))} and "
                            f"no {' or '.join(repr(s) for s in wanted)}: give its split's folder, e.g. "
                            f"{folder / str(splits[0])}")
        folder = folder / split
        if not (folder / "state.json").is_file():
            raise DataError(f"{folder}: the DatasetDict's {split} split has no state.json")
    if not (folder / "state.json").is_file():
        return None
    state = _json(folder / "state.json", "a datasets state file")
    try:
        files = [folder / f["filename"] for f in state["_data_files"]]
    except (KeyError, TypeError):
        raise DataError(f"{folder / 'state.json'}: no list of _data_files with file names") from None
    if state.get("_indices_data_files"):
        raise DataError(f"{folder}: the dataset has an indices mapping; save it again after "
                        "flatten_indices(), which writes the selected rows")
    if not files:
        raise DataError(f"{folder / 'state.json'}: lists no data files")
    for f in files:
        if not f.is_file():
            raise DataError(f"{folder / 'state.json'} lists {f.name}, which is not in {folder}")
    return files


def _json(path: Path, what: str) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DataError(f"cannot read {path}: {_first_line(e)}") from None
    if not isinstance(value, dict):
        raise DataError(f"{path}: not {what} (a JSON {type(value).__name__})")
    return value


def documents(files: list[Path], field: str) -> Iterator[tuple[Path, int, str]]:
    """(shard, row, text) of every record, in order."""
    for f in files:
        kind = _kind(f)
        try:
            if kind == "jsonl":
                yield from _jsonl(f, field)
            else:
                yield from _columnar(f, field, kind)
        except DataError:
            raise
        except (OSError, EOFError, ValueError) as e:  # unreadable, truncated or corrupt
            raise DataError(f"cannot read {f}: {_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def _zstd_lines(path: Path) -> Iterator[str]:
    """The lines of a zstd-compressed text file (its frames one after another), streaming. Unlike
    zstandard's stream reader, a file cut short is an error, not a quiet end."""
    import zstandard

    try:
        decoder, rest = zstandard.ZstdDecompressor().decompressobj(), b""
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                while chunk:
                    if decoder.eof:  # the next frame
                        decoder = zstandard.ZstdDecompressor().decompressobj()
                    rest += decoder.decompress(chunk)
                    chunk = decoder.unused_data if decoder.eof else b""
                *lines, rest = rest.split(b"\n")
                for line in lines:
                    yield line.decode("utf-8") + "\n"
        if not decoder.eof:
            raise DataError(f"cannot read {path}: the zstd stream ends early (a truncated file?)")
    except zstandard.ZstdError as e:
        raise DataError(f"cannot read {path}: {_first_line(e)}") from None
    if rest:
        yield rest.decode("utf-8")


def _lines(path: Path) -> Iterator[str]:
    if path.name.endswith(".zst"):
        yield from _zstd_lines(path)
        return
    with (gzip.open(path, "rt", encoding="utf-8") if path.name.endswith(".gz")
          else open(path, encoding="utf-8")) as fh:
        yield from fh


def _jsonl(path: Path, field: str) -> Iterator[tuple[Path, int, str]]:
    for row, line in enumerate(_lines(path), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{row}: not a JSON record ({e.msg})") from None
        if not isinstance(record, dict):
            raise DataError(f"{path}:{row}: a JSON {type(record).__name__}, not an object with a "
                            f"'{field}' field")
        if field not in record:
            raise DataError(f"{path}:{row}: no field '{field}' (it has {_names(record)}; "
                            "--text-field names the text's)")
        yield path, row, _text(record[field], path, row, field)


def _names(record) -> str:
    names = list(record)
    return ", ".join(f"'{n}'" for n in names[:8]) + (", ..." if len(names) > 8 else "") if names else "none"


def _text(value, path: Path, row: int, field: str) -> str:
    if not isinstance(value, str):
        kind = "null" if value is None else type(value).__name__
        raise DataError(f"{path}:{row}: field '{field}' is {kind}, not a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise DataError(f"{path}:{row}: field '{field}' is not valid Unicode (a lone surrogate)") from None
    return value


def _columnar(path: Path, field: str, kind: str) -> Iterator[tuple[Path, int, str]]:
    import pyarrow as pa

    with contextlib.ExitStack() as stack:
        if kind == "parquet":
            import pyarrow.parquet as pq

            reader = pq.ParquetFile(path)
            stack.callback(reader.close)
            schema = reader.schema_arrow
            batches = reader.iter_batches(batch_size=_ROWS, columns=[field]) if field in schema.names else ()
        else:  # an Arrow IPC file, or a stream (what `datasets` writes)
            with open(path, "rb") as fh:
                magic = fh.read(6)
            source = stack.enter_context(pa.memory_map(str(path)))
            if magic == b"ARROW1":
                ipc = pa.ipc.open_file(source)
                batches = (ipc.get_batch(i) for i in range(ipc.num_record_batches))
            else:
                ipc = pa.ipc.open_stream(source)
                batches = iter(ipc)
            schema = ipc.schema
        if field not in schema.names:
            raise DataError(f"{path}: no field '{field}' (it has {_names(schema.names)}; --text-field names "
                            "the text's)")
        kind_of = schema.field(field).type
        if not (pa.types.is_string(kind_of) or pa.types.is_large_string(kind_of)):
            raise DataError(f"{path}: field '{field}' is {kind_of}, not a string")
        row = 0
        for batch in batches:
            column = batch.column(batch.schema.get_field_index(field))
            for start in range(0, len(column), _ROWS):  # (a writer's batch may be the whole file)
                for value in column.slice(start, _ROWS).to_pylist():
                    row += 1
                    yield path, row, _text(value, path, row, field)
