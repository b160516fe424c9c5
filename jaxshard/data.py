"""Token corpora and per-process batching.

The default corpus needs no download: the byte-level tokens of the Python standard
library's source text, which every machine with Python has. ``--data PATH`` takes a text file
(bytes are tokens) or a pre-tokenized ``.bin`` of little-endian uint16 ids (nanoGPT's format).

Sample ``g`` of the run (a global offset: step * batch + row) is a window of ``seq_len + 1``
tokens picked by a per-epoch permutation of the corpus's windows, so the data order depends
only on the seed -- not on the mesh or the number of processes. Each process materialises only
the rows its devices hold (the DistributedSampler idea) and
``jax.make_array_from_process_local_data`` assembles the global batch.
"""

from __future__ import annotations

import functools
import os
import queue
import sysconfig
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from jaxshard.errors import DataError

STDLIB = "stdlib"  # name of the default corpus


@dataclass(frozen=True, slots=True)
class DataConfig:
    path: str | None = None  # None: the Python standard library's source
    val_fraction: float = 0.05
    max_bytes: int = 16 << 20  # cap on the default corpus (the stdlib holds ~30-60 MB)

    def __post_init__(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise DataError(f"--val-fraction must be in (0, 1), got {self.val_fraction}")


@dataclass(frozen=True)
class Corpus:
    name: str
    train: np.ndarray  # 1-D token ids
    val: np.ndarray
    vocab_size: int  # ids are < vocab_size


def load_corpus(cfg: DataConfig) -> Corpus:
    if cfg.path is None:
        tokens, name, vocab = _stdlib_tokens(cfg.max_bytes), STDLIB, 256
    else:
        tokens, name, vocab = _file_tokens(Path(cfg.path))
    n_val = max(1, int(len(tokens) * cfg.val_fraction))
    if len(tokens) - n_val < 2:
        raise DataError(f"data {name} has only {len(tokens)} tokens; too few to train on")
    return Corpus(name, tokens[:-n_val], tokens[-n_val:], vocab)


@functools.lru_cache(maxsize=2)
def _stdlib_tokens(max_bytes: int) -> np.ndarray:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    chunks, total = [], 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise DataError(f"found no Python sources under {root} for the default corpus; pass --data")
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def _file_tokens(path: Path) -> tuple[np.ndarray, str, int]:
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    if path.suffix == ".bin":
        if path.stat().st_size % 2:
            raise DataError(f"{path} has an odd size; a .bin must hold little-endian uint16 tokens")
        tokens = np.memmap(path, dtype="<u2", mode="r")
        vocab = int(tokens.max()) + 1 if len(tokens) else 0
        return tokens, str(path), vocab
    return np.fromfile(path, dtype=np.uint8), str(path), 256


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
