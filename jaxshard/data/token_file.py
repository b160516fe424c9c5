"""Token files: token ids on disk, mapped rather than read.

A token file (``.tokens``) is a 64-byte little-endian header -- magic bytes, format version, bytes
per id, vocab size, token count, and a 32-byte digest of what produced the ids -- then the ids,
little-endian uint16 (vocab <= 65,536) or uint32. It is written under a temporary name and renamed
when complete, so an error or a killed process leaves no file behind.
"""

from __future__ import annotations

import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxshard.errors import DataError

DEFAULT_TOKEN_CACHE = Path(os.environ.get("JAXSHARD_CACHE", Path.home() / ".cache" / "jaxshard")) / "tokens"

TOKEN_MAGIC = b"JXSHTOK\n"
TOKEN_VERSION = 1
# magic, version, bytes per id, vocab size, token count, digest of what produced the ids
_HEADER = struct.Struct("<8sIIQQ32s")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2" if vocab_size <= 1 << 16 else "<u4")


class TokenWriter:
    """Appends ids to a token file. ``close`` (or leaving the ``with`` block) fills in the count and
    moves the file to ``path``; an error inside the block removes it instead."""

    def __init__(self, path: str | os.PathLike, vocab_size: int, digest: bytes = bytes(32)):
        if not 0 < vocab_size <= 1 << 32:
            raise DataError(f"a token file's vocab size must be in [1, 2**32], got {vocab_size}")
        self.path, self.vocab_size, self.digest = Path(path), vocab_size, digest
        self.dtype, self.count = token_dtype(vocab_size), 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, self._tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.",
                                             suffix=".tmp")
        except OSError as e:
            raise DataError(f"cannot write token file {self.path}: {e.strerror}") from None
        self._file = os.fdopen(fd, "wb")
        self._file.write(self._header())  # the count is filled in by close()

    def _header(self) -> bytes:
        return _HEADER.pack(TOKEN_MAGIC, TOKEN_VERSION, self.dtype.itemsize, self.vocab_size, self.count,
                            self.digest)

    def write(self, ids) -> None:
        ids = np.asarray(ids).ravel()
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise DataError(f"token ids {ids.min()}..{ids.max()} do not fit a vocab of {self.vocab_size}")
        self._file.write(ids.astype(self.dtype).tobytes())
        self.count += ids.size

    def close(self) -> None:
        self._file.seek(0)
        self._file.write(self._header())
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._file.close()
        Path(self._tmp).unlink(missing_ok=True)

    def __enter__(self) -> TokenWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.abort() if exc_type is not None else self.close()


@dataclass(frozen=True)
class TokenFile:
    tokens: np.ndarray  # 1-D, memory-mapped read-only
    vocab_size: int
    digest: bytes


def read_tokens(path: str | os.PathLike) -> TokenFile:
    """Map a token file written by ``TokenWriter``; a bad header or size is a DataError."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(_HEADER.size)
    except OSError as e:
        raise DataError(f"cannot read token file {path}: {e.strerror}") from None

    def bad(why: str) -> DataError:
        return DataError(f"{path} is not a valid token file ({why}); delete or re-create it")

    if len(head) < _HEADER.size:
        raise bad(f"{size} bytes, shorter than the header")
    magic, version, width, vocab, count, digest = _HEADER.unpack(head)
    if magic != TOKEN_MAGIC:
        raise bad("wrong magic bytes")
    if version != TOKEN_VERSION:
        raise bad(f"format version {version}, this reads {TOKEN_VERSION}")
    if not 0 < vocab <= 1 << 32 or width != token_dtype(vocab).itemsize:
        raise bad(f"{width}-byte ids for a vocab of {vocab}")
    if size != _HEADER.size + count * width:
        raise bad(f"{size} bytes where the header says {count} tokens: truncated or corrupt")
    dtype = token_dtype(vocab)
    if not count:
        return TokenFile(np.zeros(0, dtype), vocab, digest)
    return TokenFile(np.memmap(path, dtype=dtype, mode="r", offset=_HEADER.size, shape=(count,)), vocab, digest)
