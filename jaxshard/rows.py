"""Which rows of the step's whole batch a computation holds, so that per-row randomness (the
dropout masks) is drawn for the whole batch and comes out the same however the batch is split.

Three things split a batch: gradient accumulation and pipelines cut it into ``M`` microbatches
(microbatch ``i`` is rows ``i, i + M, ...``, so each stays spread over the batch shards), and a
region manual over batch axes (``--strategy explicit``, a pipeline's replicas) leaves each device
its own contiguous block of a microbatch's rows. :func:`microbatch_rows` says which, around the
code that runs on such a part; :func:`bernoulli` then draws each of the part's rows from the key
folded with that row's index in the whole batch: the mask the unsplit batch draws, computed for
these rows only. Outside any such context the rows are the batch's own, and the partitioner
splits the draws with the rows (partitionable threefry: the same bits on any mesh).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, NamedTuple

import jax
import jax.numpy as jnp


class Rows(NamedTuple):
    index: jax.Array | int  # the microbatch: rows index, index + count, ... of the batch
    count: int  # microbatches the batch is cut into
    shards: tuple[str, ...]  # manual batch axes: each device holds its block of the microbatch


_ROWS: contextvars.ContextVar[Rows | None] = contextvars.ContextVar("rows", default=None)


@contextlib.contextmanager
def microbatch_rows(index: jax.Array | int = 0, count: int = 1, shards: tuple[str, ...] = ()) -> Iterator[None]:
    """Code inside runs on microbatch ``index`` of ``count`` (inside a region manual over
    ``shards``: this device's block of that microbatch's rows)."""
    token = _ROWS.set(Rows(index, count, tuple(shards)))
    try:
        yield
    finally:
        _ROWS.reset(token)


def manual_shards() -> tuple[str, ...]:
    """The manual batch axes over which the code running now holds its block of the rows (none
    outside a :func:`microbatch_rows` context that names some)."""
    part = _ROWS.get()
    return () if part is None else part.shards


def bernoulli(key: jax.Array, p: float, shape: tuple[int, ...]) -> jax.Array:
    """A boolean mask of ``shape`` (rows first) that is true with probability ``p``: these
    rows' part of the mask the whole batch draws from ``key``. Each row is drawn from ``key``
    folded with the row's index in the whole batch, so a part draws its own rows only (no
    device or microbatch computes bits it then drops) and any split gives the same bits."""
    rows = _ROWS.get()
    local = jnp.arange(shape[0])
    if rows is None:
        whole = local
    else:  # row r of this part: row (block * n + r) of the microbatch, row m * count + index of the batch
        block = jax.lax.axis_index(rows.shards) if rows.shards else 0
        whole = (block * shape[0] + local) * rows.count + rows.index
    keys = jax.vmap(lambda g: jax.random.fold_in(key, g))(whole)
    return jax.vmap(lambda k: jax.random.bernoulli(k, p, shape[1:]))(keys)
