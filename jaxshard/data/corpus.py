"""Token corpora, the token files that cache them, and per-process batching.

The default corpus needs no download: the Python standard library's source files, which every
machine with Python has. ``--data PATH`` takes a text file (one document), a folder (its ``*.txt``,
``*.md`` and ``*.py`` files, recursively and sorted, are the documents), records (JSONL, Parquet
or Arrow shards, or a ``datasets`` folder: one document per record, its ``--text-field``;
``jaxshard.data.records``), a
token file (``.tokens``, see ``jaxshard.data.token_file``) or a ``.bin`` of little-endian uint16
ids (nanoGPT's format). Records are read once into a spool file in the cache (their texts with NUL
between them), whose byte ranges are then documents like a folder's files.
Documents are joined with the tokenizer's end-of-text id between them; the validation split is the
corpus's tail.

``--tokenizer bytes`` (the default) reads bytes as tokens, in memory. A text tokenizer (``bpe:N``,
trained on the training split only, or a ``tokenizer.json``) tokenizes the corpus once, streaming,
into two token files under ``cache_dir`` named by a hash of the source files (path, size, mtime),
the tokenizer and the split; later runs map them from disk. Text tokenizers skip files that are
not valid UTF-8; the byte tokenizer reads every file as it is.

Sample ``g`` of the run (a global offset: step * batch + row) is a window of ``seq_len + 1``
tokens picked by a per-epoch permutation of the corpus's windows, so the data order depends
only on the seed -- not on the mesh or the number of processes. Each process materialises only
the rows its devices hold (the DistributedSampler idea) and
``jax.make_array_from_process_local_data`` assembles the global batch.
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import hashlib
import io
import os
import queue
import re
import sys
import sysconfig
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from jaxshard.data import mixture, records
from jaxshard.data.token_file import DEFAULT_TOKEN_CACHE, TOKEN_VERSION, TokenWriter, read_tokens
from jaxshard.errors import ConfigError, DataError
from jaxshard.options import flag, option, parse_bool
from jaxshard.data.tokenizer import (ByteTokenizer, Tokenizer, load_tokenizer, parse_spec, tokenizer_from_spec,
                                train_bpe)

STDLIB = "stdlib"  # name of the default corpus
TEXT_SUFFIXES = (".txt", ".md", ".py")  # the documents of a --data folder
_PIECE = 1 << 20  # bytes of text encoded in one call at most (about; see _pieces)
_BATCH = 4 << 20  # bytes of text per parallel encode_batch call


@dataclass(frozen=True, slots=True)
class DataConfig:
    path: str | None = option(
        None, "a text file, a folder of .txt/.md/.py files (one document each), JSONL/Parquet/Arrow "
              "shards (a file, a folder or a glob; a record each), a datasets save_to_disk folder, "
              "a .tokens file or a uint16 .bin; or a mixture of them, PATH:WEIGHT,... (documents "
              "drawn by weight)", flag="--data", default_text="the Python standard library's source",
        run_only=True)
    text_field: str = option("text", "the field of a JSONL/Parquet/Arrow record that holds its document",
                             run_only=True)
    val_fraction: float = option(0.05, "the share of the data held out for validation", run_only=True)
    eval_data: str | None = option(
        None, "more validation sets, each read whole (as --data reads its path), evaluated at "
              "--eval-every and logged as val/NAME/loss and val/NAME/perplexity",
        metavar="NAME=PATH,...", run_only=True)
    max_bytes: int = 16 << 20  # cap on the default corpus (the stdlib holds ~30-60 MB)
    # 'bytes', 'bpe:N' or a tokenizer.json (or a folder holding one); None: bytes (a run
    # starting from a Hugging Face folder takes the folder's tokenizer.json instead).
    tokenizer: str | None = option(
        None, "bytes (ids are UTF-8 bytes), bpe:N (a byte-level BPE of N tokens trained on the "
              "training split), or a tokenizer.json (or a folder holding one)",
        metavar="bytes|bpe:N|PATH", run_only=True,
        default_text="the --init-from folder's tokenizer.json if it has one, else bytes")
    cache_dir: str | None = None  # token files of text tokenizers; None: DEFAULT_TOKEN_CACHE
    evaluation: bool = False  # a validation set's: a datasets DatasetDict gives its validation split
    # None: on where the data have an end-of-text id and attention takes segment ids
    packing: bool | None = option(
        None, "attention within each document of a window (segment ids from the end-of-text ids), "
              "positions from 0 in each, and no loss on the token after an end-of-text",
        parse=parse_bool, metavar="true|false",
        default_text="true where attention takes segment ids: the data have an end-of-text id, "
                     "not cuDNN's fused kernel on GPUs")

    def __post_init__(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise DataError(f"{flag(DataConfig, 'val_fraction')} must be in (0, 1), got {self.val_fraction}")
        parse_spec(self.spec)
        _ = self.eval_sets

    @property
    def eval_sets(self) -> tuple[tuple[str, str], ...]:
        """``--eval-data``'s (name, path) pairs, in the order given."""
        if self.eval_data is None:
            return ()
        pairs, what = [], flag(DataConfig, "eval_data")
        for item in self.eval_data.split(","):
            name, eq, path = item.strip().partition("=")
            if not eq or not path.strip():
                raise DataError(f"{what} takes NAME=PATH,...; got {item.strip()!r}")
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                raise DataError(f"{what}: the name {name!r} must be letters, digits, '_', '.' or '-' "
                                "(it becomes the metric val/NAME/loss)")
            if name in dict(pairs):
                raise DataError(f"{what} names {name} twice")
            pairs.append((name, path.strip()))
        return tuple(pairs)

    @property
    def spec(self) -> str:
        """The tokenizer's spec (``bytes`` when none is given)."""
        return self.tokenizer or "bytes"


@dataclass(frozen=True)
class Corpus:
    name: str
    train: np.ndarray  # 1-D token ids (a memmap for token files)
    val: np.ndarray
    vocab_size: int  # ids are < vocab_size
    tokenizer: Tokenizer | None = None  # None: pre-tokenized data whose tokenizer was not given
    sources: tuple[mixture.Source, ...] = ()  # a mixture's (its train and val are then empty)


def load_corpus(cfg: DataConfig, tokenizer: Tokenizer | None = None) -> Corpus:
    """The corpus ``cfg`` names, tokenized by ``tokenizer`` if given (a resumed run passes its
    checkpoint's), else by the one ``cfg.tokenizer`` names or trains."""
    parts = mixture.parse(cfg.path)
    if parts is not None:
        return _mixture_corpus(cfg, parts, tokenizer)
    if cfg.path is not None and Path(cfg.path).suffix in (".bin", ".tokens"):
        _no_text_field(cfg)
        return _pretokenized(Path(cfg.path), cfg, tokenizer)
    source = _source(cfg)
    spec = parse_spec(cfg.spec)
    if tokenizer is None and spec.kind != "bpe":
        tokenizer = tokenizer_from_spec(spec)
    if isinstance(tokenizer, ByteTokenizer):
        train, val = _split(source.name, _byte_tokens(source), cfg.val_fraction)
        return Corpus(source.name, train, val, tokenizer.vocab_size, tokenizer)
    return _text_corpus(source, cfg, tokenizer)


def _mixture_corpus(cfg: DataConfig, parts: list[tuple[str, float]], tokenizer: Tokenizer | None) -> Corpus:
    """Each source's corpus, by one tokenizer: the one given, or ``cfg``'s (a BPE trained on all
    the sources' training splits)."""
    ids = [p for p, _ in parts if Path(p).suffix in (".bin", ".tokens")]
    if tokenizer is None and ids and cfg.tokenizer is None:
        raise DataError(f"a mixture reads its sources with one tokenizer, and {ids[0]} is token ids: give the "
                        "--tokenizer they were made with (its tokenizer.json)")
    if tokenizer is None:
        spec = parse_spec(cfg.spec)
        if spec.kind == "bpe":
            if ids:
                raise ConfigError(f"--tokenizer {cfg.spec} trains on text, but {ids[0]} is already tokenized")
            tokenizer = _trained_bpe([_source(_part(cfg, p)) for p, _ in parts], cfg)
        else:
            tokenizer = tokenizer_from_spec(spec)
    if tokenizer.eot_id is None:
        raise DataError(f"a mixture finds its sources' documents by the end-of-text id; tokenizer "
                        f"{tokenizer.spec} has none")
    if cfg.text_field != "text" and not any(_is_records(p) for p, _ in parts):
        _no_text_field(cfg)
    sources = []
    for path, weight in parts:
        c = load_corpus(_part(cfg, path), tokenizer)
        sources.append(mixture.Source(path, weight, c.train, c.val))
    empty = np.zeros(0, np.int32)
    return Corpus(cfg.path, empty, empty, tokenizer.vocab_size, tokenizer, tuple(sources))


def _is_records(path: str) -> bool:
    return Path(path).suffix not in (".bin", ".tokens") and records.shards(path, TEXT_SUFFIXES) is not None


def _part(cfg: DataConfig, path: str, evaluation: bool = False) -> DataConfig:
    """``cfg`` for one source of a mixture or one validation set: ``--text-field`` applies to
    those that are records."""
    return dataclasses.replace(cfg, path=path, text_field=cfg.text_field if _is_records(path) else "text",
                               evaluation=evaluation)


def _split(name: str, tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    n_val = max(1, int(len(tokens) * val_fraction))
    if len(tokens) - n_val < 2:
        raise DataError(f"data {name} has only {len(tokens)} tokens; too few to train on")
    return tokens[:-n_val], tokens[-n_val:]


@dataclass(frozen=True)
class _Source:
    name: str
    identity: str  # changes when the documents do; part of the token files' names
    files: Callable[[], list[Path]]  # the documents, in order
    max_bytes: int | None = None  # cap on the bytes read from them
    ranges: Callable[[], list[tuple[Path, int, int]]] | None = None  # documents as byte ranges instead


def _source(cfg: DataConfig) -> _Source:
    if cfg.path is None:
        _no_text_field(cfg)
        identity = f"{STDLIB}:{_stdlib_root()}:{sys.version}:{cfg.max_bytes}"
        return _Source(STDLIB, identity, _stdlib_files, cfg.max_bytes)
    shards = records.shards(cfg.path, TEXT_SUFFIXES, records.EVAL_SPLITS if cfg.evaluation else ("train",))
    if shards is not None:
        return _record_source(cfg, shards)
    _no_text_field(cfg)
    path = Path(cfg.path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
        if not files:
            raise DataError(f"data folder {path} holds no {'/'.join(TEXT_SUFFIXES)} files")
        return _Source(str(path), "\n".join(map(_file_id, files)), lambda: files)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    return _Source(str(path), _file_id(path), lambda: [path])


def _no_text_field(cfg: DataConfig) -> None:
    if cfg.text_field != "text":
        raise DataError(f"{flag(DataConfig, 'text_field')} names a field of JSONL/Parquet/Arrow records; "
                        f"{'--data ' + cfg.path if cfg.path else 'the default corpus'} is not records")


def _record_source(cfg: DataConfig, shards: list[Path]) -> _Source:
    """Records as documents: their texts spooled once into the cache, NUL between them (what
    the byte tokenizer reads, as it reads a folder's files joined), each a byte range of it."""
    identity = "\n".join([f"records:{cfg.text_field}", *map(_file_id, shards)])
    cache = Path(cfg.cache_dir) if cfg.cache_dir else DEFAULT_TOKEN_CACHE
    spool = cache / f"docs-{_digest(identity).hex()[:24]}.txt"
    index = spool.with_suffix(".npy")

    def build() -> np.ndarray:
        if spool.is_file() and index.is_file():
            bounds = np.load(index)
            if len(bounds) and bounds[-1, 1] == spool.stat().st_size:  # a pair that belongs together
                return bounds
        _spool(cfg.path, shards, cfg.text_field, spool, index)
        return np.load(index)

    def ranges() -> list[_Range]:
        return [(spool, int(a), int(b)) for a, b in build()]

    def files() -> list[Path]:
        build()
        return [spool]

    return _Source(cfg.path, identity, files, ranges=ranges)


def _spool(name: str, shards: list[Path], field: str, spool: Path, index: Path) -> None:
    """Write the records' non-empty texts to ``spool`` (NUL between them) and their byte ranges to
    ``index``, streaming; each file appears whole or not at all."""
    spool.parent.mkdir(parents=True, exist_ok=True)
    bounds, at, rows = [], 0, 0
    fd, tmp = tempfile.mkstemp(dir=spool.parent, prefix=spool.name + ".")
    try:
        with os.fdopen(fd, "wb") as out:
            for _, _, text in records.documents(shards, field):
                rows += 1
                data = text.encode("utf-8")
                if not data:
                    continue
                if bounds:
                    out.write(b"\0")
                    at += 1
                out.write(data)
                bounds.append((at, at + len(data)))
                at += len(data)
            out.flush()
            os.fsync(out.fileno())  # on disk before the name says it is complete
        if not bounds:
            raise DataError(f"data {name} holds no text: {rows} record(s), all empty" if rows
                            else f"data {name} holds no records")
        _write_atomic(index, _npy(np.asarray(bounds, dtype=np.int64)))
        os.replace(tmp, spool)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def _file_id(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=1)
def _stdlib_files() -> list[Path]:
    root = _stdlib_root()
    files = []
    for folder, subfolders, names in os.walk(root):  # (not into installed packages: 10x faster than rglob)
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "dist-packages")]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    files.sort()
    if not files:
        raise DataError(f"found no Python sources under {root} for the default corpus; pass --data")
    return files


# ---- bytes: in memory


def _byte_tokens(source: _Source) -> np.ndarray:
    if source.name == STDLIB:
        return _stdlib_tokens(source.max_bytes)
    files = source.files()
    if len(files) == 1:  # mapped, not read: a large text file stays on disk
        size = files[0].stat().st_size
        return np.memmap(files[0], dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    return _joined_bytes(tuple(files), None)


@functools.lru_cache(maxsize=2)
def _stdlib_tokens(max_bytes: int) -> np.ndarray:
    return _joined_bytes(tuple(_stdlib_files()), max_bytes)


def _joined_bytes(files: tuple[Path, ...], max_bytes: int | None) -> np.ndarray:
    """The files' bytes (``max_bytes`` of them at most, separators aside) with NUL, the byte
    tokenizer's end-of-text id, between files. Unreadable files are skipped."""
    chunks, total = [], 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError:
            continue
        if max_bytes is not None:
            data = data[:max_bytes - total]
        if data:
            chunks.append(data)
            total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    return np.frombuffer(b"\0".join(chunks), dtype=np.uint8)


# ---- text tokenizers: token files in the cache


def _text_corpus(source: _Source, cfg: DataConfig, tokenizer: Tokenizer | None) -> Corpus:
    cache = Path(cfg.cache_dir) if cfg.cache_dir else DEFAULT_TOKEN_CACHE
    split = repr(cfg.val_fraction)
    docs = None  # (train, val) byte ranges of the documents: read only on a cache miss
    if tokenizer is None:  # bpe:N, trained on the training split once and cached
        memo: dict[int, tuple[list[_Range], list[_Range]]] = {}
        tokenizer = _trained_bpe([source], cfg, memo)
        docs = memo.get(0)
    digest = _digest(source.identity, _tokenizer_id(tokenizer), split)
    parts = []
    for i, part in enumerate(("train", "val")):
        def documents(i=i) -> list[_Range]:
            nonlocal docs
            docs = docs or _split_documents(source, cfg.val_fraction)
            return docs[i]
        parts.append(_token_file(cache / f"{digest.hex()[:24]}.{part}.tokens", digest, tokenizer, documents))
    if len(parts[0]) < 2:
        raise DataError(f"data {source.name} has only {len(parts[0])} training tokens; too few to train on")
    return Corpus(source.name, parts[0], parts[1], tokenizer.vocab_size, tokenizer)


def _trained_bpe(sources: list[_Source], cfg: DataConfig, memo: dict | None = None) -> Tokenizer:
    """``cfg``'s ``bpe:N`` trained on the training splits of ``sources`` (cached by what they
    are); ``memo[i]`` gets source ``i``'s split documents where they were read."""
    cache = Path(cfg.cache_dir) if cfg.cache_dir else DEFAULT_TOKEN_CACHE
    name = _digest(*(s.identity for s in sources), cfg.spec, repr(cfg.val_fraction)).hex()[:24]
    bpe_file = cache / f"bpe-{name}.json"
    if bpe_file.is_file():
        tokenizer = load_tokenizer(bpe_file)
        tokenizer.spec = cfg.spec
        return tokenizer
    memo = {} if memo is None else memo

    def texts() -> Iterator[str]:
        for i, source in enumerate(sources):
            memo[i] = _split_documents(source, cfg.val_fraction)
            for r in memo[i][0]:
                yield from _pieces(*r)

    tokenizer = train_bpe(texts(), parse_spec(cfg.spec).vocab_size)
    _write_atomic(bpe_file, tokenizer.to_json().encode("utf-8"))
    return tokenizer


def _token_file(file: Path, digest: bytes, tokenizer: Tokenizer,
                documents: Callable[[], list[_Range]]) -> np.ndarray:
    """The ids in token file ``file``, written first (from ``documents()``) if it is not there."""
    if not file.is_file():
        with TokenWriter(file, tokenizer.vocab_size, digest) as w:
            for ids in _encode(tokenizer, documents()):
                w.write(ids)
    tf = read_tokens(file)
    if tf.digest != digest or tf.vocab_size != tokenizer.vocab_size:
        raise DataError(f"token file {file} was written for other data or another tokenizer; delete it")
    return tf.tokens


def _digest(*parts: str) -> bytes:
    return hashlib.sha256("\0".join((str(TOKEN_VERSION), *parts)).encode("utf-8")).digest()


def _tokenizer_id(tokenizer: Tokenizer) -> str:
    text = tokenizer.to_json()
    return tokenizer.spec if text is None else hashlib.sha256(text.encode("utf-8")).hexdigest()


_Range = tuple[Path, int, int]  # bytes [start, stop) of a file


def _split_documents(source: _Source, val_fraction: float) -> tuple[list[_Range], list[_Range]]:
    """The UTF-8 documents of ``source`` (files that are not valid UTF-8 are skipped), split so the
    validation split is their last ``val_fraction`` of bytes (cut at a character boundary)."""
    docs, total = _documents(source)
    cut = total - max(1, int(total * val_fraction))
    train, val, seen = [], [], 0
    for f, a, b in docs:
        k = a if seen >= cut else b if seen + b - a <= cut else _char_start(f, a + cut - seen)
        train += [(f, a, k)] if k > a else []
        val += [(f, k, b)] if b > k else []
        seen += b - a
    return train, val


def _documents(source: _Source) -> tuple[list[_Range], int]:
    """The UTF-8 documents of ``source`` as byte ranges, and their total size."""
    docs, total = [], 0
    if source.ranges is not None:  # records: UTF-8 by construction
        docs = source.ranges()
        total = sum(b - a for _, a, b in docs)
    for f in source.files() if source.ranges is None else []:
        n = _utf8_size(f)
        full = source.max_bytes is not None and total + (n or 0) >= source.max_bytes
        if n and full:
            n = _char_start(f, source.max_bytes - total)
        if n:
            docs.append((f, 0, n))
            total += n
        if full:
            break
    if not docs:
        raise DataError(f"data {source.name} holds no UTF-8 text to tokenize (files that are not UTF-8 "
                        "are skipped)")
    return docs, total


def _utf8_size(path: Path) -> int | None:
    """The size of ``path`` if it is readable UTF-8 text, else None."""
    decoder, n = codecs.getincrementaldecoder("utf-8")(), 0
    try:
        with open(path, "rb") as fh:
            while block := fh.read(_PIECE):
                decoder.decode(block)
                n += len(block)
        decoder.decode(b"", final=True)
    except (OSError, UnicodeDecodeError):
        return None
    return n


def _char_start(path: Path, k: int) -> int:
    """The largest offset <= ``k`` at which a UTF-8 character of ``path`` starts."""
    lo = max(0, k - 3)
    with open(path, "rb") as fh:
        fh.seek(lo)
        window = fh.read(k - lo + 1)
    while k > lo and k - lo < len(window) and window[k - lo] & 0xC0 == 0x80:
        k -= 1
    return k


def _pieces(path: Path, start: int, stop: int) -> Iterator[str]:
    """The text of bytes [start, stop) of ``path``, in pieces of about ``_PIECE`` bytes cut after a
    line break between two printable ASCII characters. A byte-level BPE gives the same ids as for
    the whole text (its pre-tokens never cross such a cut); a tokenizer that treats the start of
    its input specially (a sentencepiece prefix space) may differ at the cuts."""
    with open(path, "rb") as fh:
        fh.seek(start)
        pending, left = [], stop - start  # the bytes read since the last cut
        while left > 0:
            block = fh.read(min(_PIECE, left))
            if not block:
                raise DataError(f"{path} changed while it was tokenized; run again")
            left -= len(block)
            edge = pending[-1][-1:] if pending else b""  # the byte before the block
            cut = _last_cut(edge + block) - len(edge) if left > 0 else len(block)
            if cut <= 0:
                pending.append(block)
                continue
            try:
                yield b"".join([*pending, block[:cut]]).decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{path} changed while it was tokenized; run again") from None
            pending = [block[cut:]]


def _last_cut(buf: bytes) -> int:
    """The offset just after the last "\\n" of ``buf`` with a printable ASCII byte on both sides; 0
    if none."""
    i = buf.rfind(b"\n")
    while i > 0 and not (i + 1 < len(buf) and 32 < buf[i - 1] < 127 and 32 < buf[i + 1] < 127):
        i = buf.rfind(b"\n", 0, i)
    return i + 1 if i > 0 else 0


def _encode(tokenizer: Tokenizer, docs: list[_Range]) -> Iterator[np.ndarray]:
    """The ids of ``docs`` with the end-of-text id between documents, a few MB of text at a time."""
    eot = None if tokenizer.eot_id is None else np.array([tokenizer.eot_id])
    items, size = [], 0  # text pieces, and None where an end-of-text id goes
    for i, r in enumerate(docs):
        if i and eot is not None:
            items.append(None)
        for text in _pieces(*r):
            items.append(text)
            size += len(text)
            if size >= _BATCH:
                yield from _encode_items(tokenizer, items, eot)
                items, size = [], 0
    yield from _encode_items(tokenizer, items, eot)


def _encode_items(tokenizer: Tokenizer, items: list[str | None],
                  eot: np.ndarray | None) -> Iterator[np.ndarray]:
    encoded = iter(tokenizer.encode_batch([t for t in items if t is not None]))
    for t in items:
        yield eot if t is None else next(encoded)


def _write_atomic(path: Path, content: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            fh.write(content)
        os.replace(tmp, path)
    except OSError as e:
        raise DataError(f"cannot write {path}: {e.strerror}") from None


def _pretokenized(path: Path, cfg: DataConfig, tokenizer: Tokenizer | None) -> Corpus:
    """A ``.bin`` or ``.tokens`` file. Its tokenizer is the one given or a ``--tokenizer`` path;
    the default ``bytes`` does not claim pre-tokenized ids (the corpus then has no tokenizer)."""
    tokens, vocab = _ids(path)
    if tokenizer is None:
        spec = parse_spec(cfg.spec)
        if spec.kind == "bpe":
            raise ConfigError(f"--tokenizer {cfg.spec} trains on text, but {path} is already tokenized")
        tokenizer = tokenizer_from_spec(spec) if spec.kind == "file" else None
    if tokenizer is not None:
        if vocab > tokenizer.vocab_size:
            raise DataError(f"{path} holds ids up to {vocab - 1}, beyond the vocab of {tokenizer.vocab_size} "
                            f"of tokenizer {tokenizer.spec}")
        vocab = tokenizer.vocab_size
    train, val = _split(str(path), tokens, cfg.val_fraction)
    return Corpus(str(path), train, val, vocab, tokenizer)


def _ids(path: Path) -> tuple[np.ndarray, int]:
    """The ids of a ``.bin`` or ``.tokens`` file, mapped, and the size of the vocabulary they
    need."""
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    if path.suffix == ".tokens":
        tf = read_tokens(path)
        return tf.tokens, tf.vocab_size
    if path.stat().st_size % 2:
        raise DataError(f"{path} has an odd size; a .bin must hold little-endian uint16 tokens")
    tokens = np.memmap(path, dtype="<u2", mode="r") if path.stat().st_size else np.zeros(0, "<u2")
    return tokens, int(tokens.max()) + 1 if len(tokens) else 0


def load_eval_sets(cfg: DataConfig, corpus: Corpus) -> dict[str, np.ndarray]:
    """The token ids of each ``--eval-data`` set, whole, by ``corpus``'s tokenizer (text) or as
    they are (a ``.bin`` or ``.tokens`` file, whose ids must fit ``corpus``'s vocabulary)."""
    sets = {}
    for name, path in cfg.eval_sets:
        try:
            sets[name] = _eval_tokens(path, cfg, corpus)
        except DataError as e:
            raise DataError(f"{flag(DataConfig, 'eval_data')} {name}: {e}") from None
    return sets


def _eval_tokens(path: str, cfg: DataConfig, corpus: Corpus) -> np.ndarray:
    if Path(path).suffix in (".bin", ".tokens"):
        tokens, vocab = _ids(Path(path))
        if vocab > corpus.vocab_size:
            raise DataError(f"{path} holds ids up to {vocab - 1}, beyond the training data's vocabulary "
                            f"of {corpus.vocab_size}")
        return tokens
    tokenizer = corpus.tokenizer
    if tokenizer is None:
        raise DataError(f"{path} is text, but the training data came as token ids without a tokenizer "
                        "to read it with (give --tokenizer)")
    source = _source(_part(cfg, path, evaluation=True))
    if isinstance(tokenizer, ByteTokenizer):
        return _byte_tokens(source)
    cache = Path(cfg.cache_dir) if cfg.cache_dir else DEFAULT_TOKEN_CACHE
    digest = _digest(source.identity, _tokenizer_id(tokenizer), "all")
    return _token_file(cache / f"{digest.hex()[:24]}.all.tokens", digest, tokenizer,
                       lambda: _documents(source)[0])


class Batches:
    """Batches of inputs and next-token targets: this process's block ``[rows, cols]`` of each
    global ``[global_batch, seq_len]`` batch."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int,
                 rows: slice | None = None, shuffle: bool = True, cols: slice | None = None,
                 what: str = "corpus"):
        self.tokens, self.seq_len, self.global_batch = tokens, seq_len, global_batch
        self.seed, self.shuffle = seed, shuffle
        self.rows = rows or slice(0, global_batch)
        self.cols = cols or slice(0, seq_len)
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise DataError(f"the {what} has {len(tokens)} tokens, fewer than --seq-len + 1 = "
                            f"{seq_len + 1}" + ("; raise --val-fraction or use more data"
                                                if what == "validation split" else ""))
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n_windows)
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)}
        return self._orders[epoch]

    def window_starts(self, samples: np.ndarray) -> np.ndarray:
        epoch, index = np.divmod(samples, self.n_windows)
        return np.array([self._order(int(e))[i] for e, i in zip(epoch, index)]) * self.seq_len

    def batch_at(self, offset: int) -> dict[str, np.ndarray]:
        """This process's block of the global batch whose first sample is ``offset`` (the run's
        global sample offset: step x global batch, checkpointed for an exact resume)."""
        rows = np.arange(self.rows.start, self.rows.stop)
        starts = self.window_starts(offset + rows)
        win = np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts]).astype(np.int32)
        return {"inputs": win[:, :-1][:, self.cols], "targets": win[:, 1:][:, self.cols]}


def split_batches(corpus: Corpus, split: str, seq_len: int, global_batch: int, seed: int,
                  rows: slice | None = None, cols: slice | None = None) -> Batches | mixture.MixedBatches:
    """The batches of ``corpus``'s ``"train"`` split (shuffled) or ``"val"`` split (in order):
    :class:`Batches`, or a mixture's :class:`~jaxshard.data.mixture.MixedBatches`."""
    train = split == "train"
    what = "training split" if train else "validation split"
    if corpus.sources:
        return mixture.MixedBatches([getattr(s, split) for s in corpus.sources], [s.weight for s in corpus.sources],
                                    corpus.tokenizer.eot_id, seq_len, global_batch, seed, rows, cols,
                                    shuffle=train, names=[s.name for s in corpus.sources], what=f"mixture's {what}")
    return Batches(getattr(corpus, split), seq_len, global_batch, seed, rows, shuffle=train, cols=cols, what=what)


def process_block(sharding, global_batch: int, seq_len: int) -> tuple[slice, slice]:
    """The contiguous rows and columns of the global batch that this process's devices hold."""
    index_map = sharding.addressable_devices_indices_map((global_batch, seq_len))
    return tuple(_span([idx[d] for idx in index_map.values()], n)
                 for d, n in ((0, global_batch), (1, seq_len)))


def _span(slices, n: int) -> slice:
    bounds = {(s.start or 0, n if s.stop is None else s.stop) for s in slices}
    span = slice(min(a for a, _ in bounds), max(b for _, b in bounds))
    if sum(b - a for a, b in bounds) != span.stop - span.start:
        raise DataError("this process's part of the batch is not contiguous; put the batch and "
                        "sequence axes outermost in --mesh when they cross processes")
    return span


def to_global(batch: dict[str, np.ndarray], sharding, global_shape: tuple[int, int]) -> dict:
    """Global ``[batch, seq_len]`` arrays from this process's block of them."""
    import jax

    return {k: jax.make_array_from_process_local_data(sharding, v, global_shape) for k, v in batch.items()}


def splits_for(program, corpus, batch_size: int, seq_len: int, seed: int, eval_batches: int):
    """(the training split's :class:`Batches`, ``eval_batches`` global validation batches) of
    ``corpus`` laid out for ``program``'s batch sharding: what the benchmark scripts that
    train a model read."""
    rows, cols = process_block(program.batch_sharding, batch_size, seq_len)
    train = split_batches(corpus, "train", seq_len, batch_size, seed, rows, cols)
    val = split_batches(corpus, "val", seq_len, batch_size, seed, rows, cols)
    shape = (batch_size, seq_len)
    return train, [to_global(val.batch_at(i * batch_size), program.batch_sharding, shape) for i in range(eval_batches)]


def write_bin(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Save token ids as the uint16 ``.bin`` format that ``--data`` reads."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 1 << 16):
        raise DataError("token ids must fit in uint16 for a .bin file")
    tokens.astype("<u2").tofile(path)


class Prefetch:
    """``make(i)`` for ``i`` in ``steps``, built ``depth`` ahead on a background thread, so the
    host prepares (and puts on the devices) the next batches while the devices run this one.
    An error in ``make`` is raised where its item would have been taken."""

    def __init__(self, make: Callable[[int], Any], steps: range, depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(make, steps), daemon=True,
                                        name="jaxshard-prefetch")
        self._thread.start()

    def _run(self, make, steps) -> None:
        for i in steps:
            try:
                item = (i, make(i), None)
            except BaseException as e:  # noqa: BLE001 -- handed to the consumer
                item = (i, None, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set() or item[2] is not None:
                return

    def get(self, i: int) -> Any:
        """The item of step ``i`` (steps are taken in order)."""
        j, item, error = self._queue.get()
        if error is not None:
            raise error
        if j != i:
            raise RuntimeError(f"prefetched step {j}, wanted {i}: steps must be taken in order")
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def __enter__(self) -> Prefetch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
