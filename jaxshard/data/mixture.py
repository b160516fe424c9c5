"""Weighted mixtures of corpora: ``--data web.jsonl:0.7,code/:0.3``.

Each source is a corpus as ``--data`` takes one (its own tail split for validation), tokenized by
one shared tokenizer. Training windows are cut from a stream of whole documents: draw ``k`` picks
source ``s`` with probability ``weight[s]`` (a generator seeded by the run's seed and ``k``'s block
of :data:`BLOCK` draws), and a source's ``j``-th pick is its next document in a per-epoch
permutation of its documents. Documents are followed by the end-of-text id; sample ``g`` is the
stream's tokens ``[g * seq_len, (g + 1) * seq_len + 1)``, so, as for one corpus, the data depend
only on the seed, not on the mesh or the number of processes (each process walks the same draws
and reads only its rows).

The stream is read forward. Its position -- the draw at a sample offset, the documents taken
from each source before it, and where that draw starts in the stream -- is what a checkpoint
keeps (:meth:`MixedBatches.position`); a resumed run seeks there instead of replaying the draws.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from dataclasses import dataclass, field

import numpy as np

from jaxshard.errors import DataError

BLOCK = 4096  # draws made at a time from one generator
_CHUNK = 1 << 26  # tokens scanned at a time for end-of-text ids
_MIX = 0x6D6978  # "mix": keeps the draws' generators apart from the window permutation's


def parse(spec: str | None) -> list[tuple[str, float]] | None:
    """``PATH:WEIGHT,...`` as (path, weight) pairs, the weights summing to 1; None where ``spec``
    is one path without a weight (not a mixture)."""
    if spec is None or Path(spec).exists():  # (a path that happens to end in ":<number>")
        return None
    items = spec.split(",")
    pairs = []
    for item in items:
        path, colon, weight = item.strip().rpartition(":")
        try:
            value = float(weight) if colon and path else None
        except ValueError:
            value = None
        if value is None:
            if len(items) == 1:
                return None
            raise DataError(f"--data {spec}: a mixture gives each source a weight, PATH:WEIGHT; "
                            f"{item.strip()!r} has none")
        if not (math.isfinite(value) and value > 0):
            raise DataError(f"--data {spec}: the weight of {path} must be a positive number, got {weight}")
        if path in (p for p, _ in pairs):
            raise DataError(f"--data {spec}: {path} is given twice")
        pairs.append((path, value))
    total = sum(w for _, w in pairs)
    return [(p, w / total) for p, w in pairs]


@dataclass(frozen=True)
class Source:
    """One source of a mixture: its path, normalised weight and token splits."""

    name: str
    weight: float
    train: np.ndarray
    val: np.ndarray


def documents(tokens: np.ndarray, eot: int) -> tuple[np.ndarray, np.ndarray]:
    """The (start, stop) token offsets of the documents of ``tokens`` (end-of-text ids between
    them, not in them); empty documents are dropped."""
    cuts = np.concatenate([np.flatnonzero(np.asarray(tokens[i:i + _CHUNK]) == eot) + i
                           for i in range(0, len(tokens), _CHUNK)] or [np.zeros(0, np.int64)])
    starts = np.concatenate([[0], cuts + 1])
    stops = np.concatenate([cuts, [len(tokens)]])
    keep = stops > starts
    return starts[keep], stops[keep]


@dataclass
class _Cursor:
    draw: int  # the first draw not yet behind the stream's read position
    token: int  # where that draw's document starts in the stream
    taken: np.ndarray  # documents taken from each source before that draw
    # the draws from ``draw`` on made so far: (source, document, length with its end-of-text),
    # where they end in the stream, and the documents taken from each source with them
    ahead: list[tuple[int, int, int]] = field(default_factory=list)
    end: int | None = None
    taken_ahead: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.end is None:
            self.end = self.token + sum(n for _, _, n in self.ahead)
            self.taken_ahead = self.taken + np.bincount([s for s, _, _ in self.ahead],
                                                        minlength=len(self.taken)).astype(self.taken.dtype)


class MixedBatches:
    """This process's block ``[rows, cols]`` of each global ``[global_batch, seq_len]`` batch of
    inputs and next-token targets, cut from the weighted stream of the sources' documents.
    ``shuffle=False`` takes each source's documents in order (validation)."""

    def __init__(self, sources: list[np.ndarray], weights: list[float], eot: int, seq_len: int,
                 global_batch: int, seed: int, rows: slice | None = None, cols: slice | None = None,
                 shuffle: bool = True, names: list[str] | None = None, what: str = "mixture"):
        self.tokens, self.eot, self.seq_len, self.global_batch = sources, eot, seq_len, global_batch
        self.weights = np.asarray(weights, dtype=np.float64)
        self.seed, self.shuffle = seed, shuffle
        self.names = names or [str(i) for i in range(len(sources))]
        self.rows = rows or slice(0, global_batch)
        self.cols = cols or slice(0, seq_len)
        self.docs = [documents(t, eot) for t in sources]
        for name, (starts, _) in zip(self.names, self.docs):
            if not len(starts):
                raise DataError(f"the {what}'s source {name} holds no document")
        self._orders: dict[tuple[int, int], np.ndarray] = {}
        self._block: tuple[int, np.ndarray] | None = None
        self._cursor = self._start()
        self._seen: dict[int, tuple[int, int, np.ndarray]] = {}  # offset -> (draw, token, taken) there
        self._lock = threading.Lock()  # batches are made on a thread while the loop saves positions

    def _start(self) -> _Cursor:
        return _Cursor(0, 0, np.zeros(len(self.tokens), np.int64))

    # ---- the draws

    def _sources(self, block: int) -> np.ndarray:
        if self._block is None or self._block[0] != block:
            rng = np.random.default_rng([self.seed, _MIX, block])
            self._block = (block, rng.choice(len(self.tokens), BLOCK, p=self.weights))
        return self._block[1]

    def _document(self, source: int, j: int) -> int:
        """The index of source ``source``'s ``j``-th document taken."""
        n = len(self.docs[source][0])
        epoch, i = divmod(j, n)
        if not self.shuffle:
            return i
        key = (source, epoch)
        if key not in self._orders:  # (each source keeps its latest two epochs' orders)
            self._orders = {k: v for k, v in self._orders.items() if k[0] != source or k[1] >= epoch - 1}
            self._orders[key] = np.random.default_rng([self.seed, source, epoch]).permutation(n)
        return int(self._orders[key][i])

    def _extend(self, c: _Cursor, stop: int) -> None:
        """Draw until ``c``'s draws reach stream token ``stop``."""
        k = c.draw + len(c.ahead)
        while c.end < stop:
            s = int(self._sources(k // BLOCK)[k % BLOCK])
            d = self._document(s, int(c.taken_ahead[s]))
            starts, stops = self.docs[s]
            n = int(stops[d] - starts[d]) + 1
            c.ahead.append((s, d, n))
            c.taken_ahead[s] += 1
            c.end += n
            k += 1

    def _advance(self, c: _Cursor, token: int) -> None:
        """Move ``c`` to the draw whose document holds stream token ``token``."""
        self._extend(c, token + 1)
        ends = c.token + np.cumsum([n for _, _, n in c.ahead])
        behind = int(np.searchsorted(ends, token, side="right"))  # the draws that end at or before it
        if behind:
            c.taken = c.taken + np.bincount([s for s, _, _ in c.ahead[:behind]], minlength=len(c.taken))
            c.draw, c.token = c.draw + behind, int(ends[behind - 1])
            del c.ahead[:behind]

    def _read(self, c: _Cursor, begins: np.ndarray, start: int, stop: int) -> np.ndarray:
        """Stream tokens [start, stop) from ``c``'s draws, which start at ``begins``."""
        out = []
        for i in range(int(np.searchsorted(begins, start, side="right")) - 1, len(c.ahead)):
            at = int(begins[i])
            if at >= stop:
                break
            s, d, n = c.ahead[i]
            a, b = self.docs[s][0][d], self.docs[s][1][d]
            doc = np.concatenate([np.asarray(self.tokens[s][a:b]), [self.eot]])
            out.append(doc[max(0, start - at):stop - at])
        return np.concatenate(out)

    # ---- batches

    def batch_at(self, offset: int) -> dict[str, np.ndarray]:
        """This process's block of the global batch whose first sample is ``offset``. Offsets
        are read forward; an earlier one starts the stream again (validation's batches)."""
        with self._lock:
            return self._batch_at(offset)

    def _batch_at(self, offset: int) -> dict[str, np.ndarray]:
        first = offset * self.seq_len
        if first < self._cursor.token:
            self._cursor = self._start()
        self._advance(self._cursor, first)
        self._seen[offset] = (self._cursor.draw, self._cursor.token, self._cursor.taken.copy())
        if len(self._seen) > 16:
            self._seen.pop(min(self._seen))
        c = self._cursor
        self._extend(c, (offset + self.rows.stop) * self.seq_len + 1)
        begins = c.token + np.concatenate([[0], np.cumsum([n for _, _, n in c.ahead])[:-1]])
        win = np.stack([self._read(c, begins, g * self.seq_len, (g + 1) * self.seq_len + 1)
                        for g in range(offset + self.rows.start, offset + self.rows.stop)]).astype(np.int32)
        return {"inputs": win[:, :-1][:, self.cols], "targets": win[:, 1:][:, self.cols]}

    def position(self, offset: int) -> dict:
        """Where the stream stands at sample ``offset``: what a checkpoint keeps, for
        :meth:`seek`. Read from the batches made so far, or drawn forward from the nearest."""
        with self._lock:
            return self._position(offset)

    def _position(self, offset: int) -> dict:
        if offset in self._seen:
            draw, token, taken = self._seen[offset]
        else:
            before = [o for o in self._seen if o <= offset]
            c = (_Cursor(*self._seen[max(before)][:2], self._seen[max(before)][2].copy()) if before
                 else self._start())
            self._advance(c, offset * self.seq_len)
            draw, token, taken = c.draw, c.token, c.taken
        return {"offset": offset, "draw": draw, "token": token, "taken": [int(t) for t in taken],
                "sources": self.names, "weights": [float(w) for w in self.weights]}

    def seek(self, position: dict) -> None:
        """Start from a :meth:`position` (a checkpoint's), instead of drawing from the start."""
        weights = list(position.get("weights") or [])
        if position.get("sources") != self.names or len(weights) != len(self.weights) \
                or not np.allclose(weights, self.weights):
            raise DataError(f"the checkpoint's data mixture was {describe(position)}; this run's is "
                            f"{describe({'sources': self.names, 'weights': list(self.weights)})}: resume with "
                            "the same --data")
        self._cursor = _Cursor(int(position["draw"]), int(position["token"]),
                               np.asarray(position["taken"], np.int64))
        self._seen = {int(position["offset"]): (self._cursor.draw, self._cursor.token, self._cursor.taken.copy())}

    def drawn(self, offset: int) -> list[dict]:
        """Per source: its weight, and the documents drawn before sample ``offset`` and their share."""
        taken = np.asarray(self.position(offset)["taken"])
        total = max(1, int(taken.sum()))
        return [{"source": name, "weight": float(w), "documents": int(t), "share": int(t) / total}
                for name, w, t in zip(self.names, self.weights, taken)]


def describe(position: dict) -> str:
    """A mixture's sources and weights as ``--data`` gives them, from a :meth:`MixedBatches.position`."""
    return ",".join(f"{s}:{w:.4g}" for s, w in zip(position.get("sources") or [], position.get("weights") or []))
