"""The grouped matmul of dropless experts: rows sorted by group, each group's rows times its
group's matrix, with ``jax.lax.ragged_dot``'s contract -- ``x [R, D]``, ``w [G, D, F]``,
``sizes [G]`` (summing to at most R; rows past the sum give zeros) -- computing only the
rows that are there.

On GPUs and TPUs ``jax.lax.ragged_dot`` lowers to a grouped-matmul kernel. XLA:CPU has none:
jax lowers it there as a dense matmul of every row with every group's matrix, masked (G times
the FLOPs; read from the compiled program in ``tests/test_grouped.py``). On CPU this module
runs the rows in tiles instead (MegaBlocks' tiling): each group's rows in tiles of ``m``, a
``while`` loop over the tiles there are (a count known only at run time), one ``[m, D] x
[D, F]`` matmul each, its rows past the group's end not written. The rows computed beyond
the real ones are at most ``G (m - 1)``, the tiles' padding. Backward runs the same tiles
twice, for the input's gradient (the matrices transposed) and the matrices' (each tile's
``x^T dy`` added to its group's). The loop's count comes back with the result, so a caller
can report the rows a step computed from the program itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# The grouped matmuls' outputs, which the ``dots`` remat policies keep as they keep a dot's.
GROUPED = "grouped_matmul"


def tile_rows(rows_per_group: float) -> int:
    """The tile for groups of about ``rows_per_group`` rows: the largest power of two at most
    a sixteenth of it, from 2 to 128 -- padding at most 1/16 of the rows where the groups are
    even (about half that on average), and tiles as large as that allows, so that the loop's
    per-tile cost stays small. (A tile of one row would make the weights' gradient an outer
    product, which XLA computes as a multiply, not a matmul.)"""
    m = 2
    while m < 128 and 2 * m <= rows_per_group / 16:
        m *= 2
    return m


def matmul(x_RD: jax.Array, w_GDF: jax.Array, sizes_G: jax.Array, *, tile: int) -> tuple[jax.Array, jax.Array]:
    """(``[R, F]`` each group's rows times its matrix, the rows computed): on CPU in tiles of
    ``tile`` rows (the rows computed: tiles run x ``tile``), elsewhere ``jax.lax.ragged_dot``
    (the rows computed: the rows there are)."""
    if jax.default_backend() != "cpu":
        return checkpoint_name(jax.lax.ragged_dot(x_RD, w_GDF, sizes_G), GROUPED), jnp.sum(sizes_G)
    y, tiles = _tiled(x_RD, w_GDF, sizes_G.astype(jnp.int32), tile)
    return checkpoint_name(y, GROUPED), tiles * tile


def _varying(*xs: jax.Array) -> frozenset:
    """The manual axes over which any of ``xs`` varies, inside a ``shard_map`` (else none)."""
    axes = set()
    for x in xs:
        t = jax.typeof(x)
        vma = getattr(t, "vma", None)
        if vma is None:
            vma = getattr(getattr(t, "manual_axis_type", None), "varying", frozenset())
        axes |= set(vma)
    return frozenset(axes)


def _zeros(shape, dtype, *like: jax.Array) -> jax.Array:
    """Zeros varying where ``like`` does (a loop's carry must keep its type)."""
    z = jnp.zeros(shape, dtype)
    axes = tuple(sorted(_varying(*like)))
    return jax.lax.pcast(z, axes, to="varying") if axes else z


def _tiles(sizes_G: jax.Array, m: int, n_rows: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(each tile's group, first row, and its group's end row, for as many tiles as there can
    be; the tiles there are): group g's rows in ceil(size / m) tiles, groups in order."""
    G = sizes_G.shape[0]
    per_group = (sizes_G + m - 1) // m
    last = jnp.cumsum(per_group)
    ends = jnp.cumsum(sizes_G)
    starts = ends - sizes_G
    t = jnp.arange(-(-n_rows // m) + G, dtype=jnp.int32)
    # (A count of the groups whose tiles end at or before t: jnp.searchsorted fails on a
    # shard_map's varying operands in jax 0.10.2.)
    group = jnp.minimum(jnp.sum(last[None, :] <= t[:, None], axis=1), G - 1).astype(jnp.int32)
    first = starts[group] + (t - (last[group] - per_group[group])) * m
    return group, first, ends[group], last[-1]


def _loop(n: jax.Array, body, init):
    """``body(t, carry)`` for t < n; returns (the final carry, the count run)."""
    t, carry = jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, body(c[0], c[1])), (jnp.int32(0), init))
    return carry, t


def _forward(x_RD, w_GDF, sizes_G, m):
    R, D = x_RD.shape
    F = w_GDF.shape[-1]
    group, first, end, n = _tiles(sizes_G, m, R)
    x = jnp.concatenate([x_RD, jnp.zeros((m, D), x_RD.dtype)])  # a last tile's slice stays in place
    rows = jnp.arange(m)

    def body(t, out):
        xt = jax.lax.dynamic_slice_in_dim(x, first[t], m)
        yt = jnp.dot(xt, w_GDF[group[t]], preferred_element_type=jnp.float32).astype(out.dtype)
        old = jax.lax.dynamic_slice_in_dim(out, first[t], m)
        new = jnp.where((first[t] + rows < end[t])[:, None], yt, old)
        return jax.lax.dynamic_update_slice_in_dim(out, new, first[t], 0)

    out, count = _loop(n, body, _zeros((R + m, F), jnp.result_type(x_RD, w_GDF), x_RD, w_GDF))
    return out[:R], count


def _weight_grad(x_RD, dy_RF, sizes_G, G, m):
    R, D = x_RD.shape
    F = dy_RF.shape[-1]
    group, first, end, n = _tiles(sizes_G, m, R)
    x = jnp.concatenate([x_RD, jnp.zeros((m, D), x_RD.dtype)])
    dy = jnp.concatenate([dy_RF, jnp.zeros((m, F), dy_RF.dtype)])
    rows = jnp.arange(m)

    def body(t, dw):
        xt = jax.lax.dynamic_slice_in_dim(x, first[t], m)
        dyt = jnp.where((first[t] + rows < end[t])[:, None], jax.lax.dynamic_slice_in_dim(dy, first[t], m), 0)
        g = group[t]
        return dw.at[g].add(jnp.dot(xt.T, dyt, preferred_element_type=jnp.float32))

    dw, _ = _loop(n, body, _zeros((G, D, F), jnp.float32, x_RD, dy_RF))
    return dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled(x_RD, w_GDF, sizes_G, m):
    return _forward(x_RD, w_GDF, sizes_G, m)


def _tiled_fwd(x_RD, w_GDF, sizes_G, m):
    return _forward(x_RD, w_GDF, sizes_G, m), (x_RD, w_GDF, sizes_G)


def _tiled_bwd(m, res, cts):
    x_RD, w_GDF, sizes_G = res
    dy_RF = cts[0]
    dx, _ = _forward(dy_RF.astype(x_RD.dtype), jnp.swapaxes(w_GDF, 1, 2), sizes_G, m)
    dw = _weight_grad(x_RD, dy_RF.astype(x_RD.dtype), sizes_G, w_GDF.shape[0], m)
    return _summed(dx, x_RD), _summed(dw, w_GDF), None


def _summed(grad: jax.Array, primal: jax.Array) -> jax.Array:
    """``grad`` summed over the manual axes it varies over and ``primal`` does not (the
    transpose of the implicit broadcast of an operand the same on those devices), in float32
    (XLA:CPU cannot promote a 2-byte sum made in a shard_map), in ``primal``'s dtype."""
    extra = tuple(sorted(_varying(grad) - _varying(primal)))
    if extra:
        grad = jax.lax.psum(grad.astype(jnp.float32), extra)
    return grad.astype(primal.dtype)


_tiled.defvjp(_tiled_fwd, _tiled_bwd)
