"""Which rows of the step's whole batch a computation holds, so that per-row randomness (the
dropout masks) is drawn for the whole batch and comes out the same however the batch is split.

Three things split a batch: gradient accumulation and pipelines cut it into ``M`` microbatches
(microbatch ``i`` is rows ``i, i + M, ...``, so each stays spread over the batch shards), and a
region manual over batch axes (``--strategy explicit``, a pipeline's replicas) leaves each device
its own contiguous block of a microbatch's rows. :func:`microbatch_rows` says which, around the
code that runs on such a part; :func:`bernoulli` then draws the whole batch's mask -- with
partitionable threefry each element's bits depend only on its flat index, so
``[B / (M n), n, M, ...]`` laid out as ``[B, ...]`` is the mask the unsplit batch draws -- and
keeps this part's rows. Outside any such context it is ``jax.random.bernoulli`` at the given
shape, which the partitioner shards without changing a bit.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, NamedTuple

import jax


class Rows(NamedTuple):
    index: jax.Array | int  # the microbatch: rows index, index + count, ... of the batch
    count: int  # microbatches the batch is cut into
    shards: tuple[str, ...]  # manual batch axes: each device holds its block of the microbatch
    n_shards: int  # devices along ``shards``


_ROWS: contextvars.ContextVar[Rows | None] = contextvars.ContextVar("rows", default=None)


@contextlib.contextmanager
def microbatch_rows(index: jax.Array | int = 0, count: int = 1, shards: tuple[str, ...] = (),
                    n_shards: int = 1) -> Iterator[None]:
    """Code inside runs on microbatch ``index`` of ``count`` (inside a region manual over
    ``shards``, of ``n_shards`` devices: this device's block of that microbatch's rows)."""
    token = _ROWS.set(Rows(index, count, tuple(shards), n_shards))
    try:
        yield
    finally:
        _ROWS.reset(token)


def current() -> Rows | None:
    return _ROWS.get()


def bernoulli(key: jax.Array, p: float, shape: tuple[int, ...]) -> jax.Array:
    """A boolean mask of ``shape`` (rows first) that is true with probability ``p``: these
    rows' part of the mask the whole batch draws from ``key``."""
    rows = _ROWS.get()
    if rows is None or (rows.count == 1 and not rows.shards):
        return jax.random.bernoulli(key, p, shape)
    n, local = rows.n_shards, shape[0]
    # The whole batch as [microbatch rows, microbatches, ...]: microbatch i is [:, i].
    every = jax.random.bernoulli(key, p, (n * local, rows.count, *shape[1:]))
    if rows.shards:  # this device's block of the microbatch's rows
        every = jax.lax.dynamic_slice_in_dim(every, jax.lax.axis_index(rows.shards) * local, local)
    return jax.lax.dynamic_index_in_dim(every, rows.index, axis=1, keepdims=False)
