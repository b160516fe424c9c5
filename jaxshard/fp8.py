"""Float8 matmuls: the scaling recipes and a scaled matmul whose backward pass runs in float8 too.

A float8 matmul multiplies operands cast to 8-bit floats after each is multiplied by a scale
that maps its largest magnitude (its *amax*) onto the format's largest finite value, and
divides the float32 product by the scales again. Forward operands are ``float8_e4m3fn`` (3
mantissa bits, largest 448); the output gradient is ``float8_e5m2`` (2 mantissa bits, largest
57,344: gradients span more range than they need precision). The recipes differ in where an
amax is taken:

* **tensorwise** -- one scale per operand, from the whole tensor's amax (torchtitan's default
  Float8 recipe);
* **rowwise** -- one scale per row of the operand along the dimension the matmul contracts, so an
  outlier costs only its own row precision (torchao's rowwise recipe: each of the three matmuls
  of a linear layer, forward, input gradient and weight gradient, quantises its operands along
  its own contraction; the output gradient in e4m3 too, since a row's own scale gives it the
  range, and every scale rounded down to a power of two, so scaling is exact);
* **delayed** -- a tensorwise scale from the largest amax of the last ``H`` steps (Transformer
  Engine's and Megatron's delayed scaling), so the step needs no reduction before its matmul;
  the history is state that the step updates and a checkpoint keeps.

Casting saturates: a value beyond the format's range becomes its largest finite value (a plain
cast would give NaN in e4m3fn, which has no infinity). A scale is never taken from an amax of
0 or a non-finite one: the scale falls back to 1 (dynamic) or keeps its last value (delayed),
so a step that overflows recovers once the history has seen the large amax.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
RECIPES = ("tensorwise", "rowwise", "delayed")


def gathers_as_float8(recipe: str | None, layer_axes: tuple) -> bool:
    """Whether FSDP gathers a layer's param of these logical dims (the layer stack's left out)
    as float8: a matrix (two dims or more: a dense block's linear layers) under tensorwise
    scaling, whose one scale serves the forward matmul and the input gradient's alike."""
    return recipe == "tensorwise" and len(layer_axes) >= 2


def fp8_max(dtype: Any) -> float:
    """The largest finite value of a float8 format (448 for e4m3fn, 57,344 for e5m2)."""
    return float(jnp.finfo(dtype).max)


def scale_from_amax(amax: jax.Array, dtype: Any, fallback: jax.Array | float = 1.0) -> jax.Array:
    """``fp8_max / amax`` in float32, or ``fallback`` where ``amax`` is 0 or not finite."""
    amax = jnp.asarray(amax, jnp.float32)
    ok = jnp.isfinite(amax) & (amax > 0)
    return jnp.where(ok, fp8_max(dtype) / jnp.where(ok, amax, 1.0), jnp.asarray(fallback, jnp.float32))


def amax(x: jax.Array, axis: int | None = None) -> jax.Array:
    """The largest magnitude of ``x`` in float32: of the whole tensor, or along ``axis`` (kept
    as a dimension of 1, so it broadcasts against ``x``)."""
    a = jnp.abs(x.astype(jnp.float32))
    return jnp.max(a) if axis is None else jnp.max(a, axis=axis, keepdims=True)


def quantize(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """``x * scale`` cast to the float8 ``dtype``, saturating at its largest finite value."""
    big = fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) * scale, -big, big).astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    return (q.astype(jnp.float32) / scale).astype(dtype)


# ---- delayed scaling --------------------------------------------------------------------------

def update_history(history: jax.Array, new_amax: jax.Array) -> jax.Array:
    """The amax history with ``new_amax`` in front and the oldest entry dropped."""
    return jnp.concatenate([jnp.asarray(new_amax, jnp.float32).reshape(1), history[:-1]])


def delayed_scale(history: jax.Array, previous: jax.Array, dtype: Any) -> jax.Array:
    """The scale for this step: from the largest finite amax of the history, or ``previous``
    where the history holds none (all 0, or a step that overflowed to inf/NaN alone)."""
    finite = jnp.where(jnp.isfinite(history), history, 0.0)
    return scale_from_amax(jnp.max(finite), dtype, fallback=previous)


# ---- the scaled matmul ------------------------------------------------------------------------

SCALE = "fp8_scale"  # a tensorwise scale or delayed amax the forward pass takes: kept by every remat policy


def keep_scale(x: jax.Array) -> jax.Array:
    """``x`` (a scalar the forward pass reduced over the devices), named so that every remat
    policy keeps it for the backward pass (``jaxshard.remat``) rather than take it again."""
    return checkpoint_name(x, SCALE)


def power_of_two(scale: jax.Array) -> jax.Array:
    """``scale`` rounded down to a power of two (no value then scales past the format's
    largest), as torchao's rowwise recipe does: multiplying by it is exact."""
    return jnp.exp2(jnp.floor(jnp.log2(scale)))


def _operand_scale(x: jax.Array, dtype: Any, contract: int, rowwise: bool, split: tuple[str, ...] = ()) -> jax.Array:
    """The scale of a 2-D operand: one for the tensor, or one per row along ``contract``
    (rounded down to a power of two). ``split``: the manual mesh axes over which the amax's
    reduction is split (the tensor's pieces, or the rows' pieces along ``contract``) -- their
    maximum is taken over them, so the scale is the whole tensor's on every device."""
    a = amax(x, axis=contract if rowwise else None)
    scale = scale_from_amax(jax.lax.pmax(a, split) if split else a, dtype)
    return power_of_two(scale) if rowwise else scale


def scaled_matmul(a: jax.Array, b: jax.Array, a_dtype: Any, b_dtype: Any, rowwise: bool,
                  a_scale: jax.Array | None = None, b_scale: jax.Array | None = None,
                  a_split: tuple[str, ...] = (), b_split: tuple[str, ...] = ()) -> jax.Array:
    """``a [M, K] @ b [K, N]`` in float8, float32 out: each operand scaled (its own amax along K
    where ``rowwise``, else the tensor's; or the scales given), cast, multiplied with float32
    accumulation, and the product divided by the scales. ``a_split``/``b_split``: the manual
    mesh axes an operand's amax is split over (see :func:`_operand_scale`)."""
    sa = _operand_scale(a, a_dtype, 1, rowwise, a_split) if a_scale is None else a_scale
    sb = _operand_scale(b, b_dtype, 0, rowwise, b_split) if b_scale is None else b_scale
    product = jax.lax.dot_general(quantize(a, sa, a_dtype), quantize(b, sb, b_dtype), (((1,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)
    return product / (sa * sb)


def weight_grad(x: jax.Array, g: jax.Array, n_in: int, x_dtype: Any, g_dtype: Any, rowwise: bool,
                split: tuple[str, ...] = (), x_scale: jax.Array | None = None,
                g_scale: jax.Array | None = None) -> jax.Array:
    """A linear layer's weight gradient ``x^T g`` in float8, float32 out: ``x [..., K1..Kn]``
    (its leading dims the tokens M) with ``g [M, N]``, contracted over M, as
    :func:`scaled_matmul` computes ``x2^T @ g`` -- but with the weight's own K dims kept in the
    product ``[K1..Kn, N]``. A weight split along an inner K dim (the attention output's
    ``head_dim`` under FSDP) then has its gradient's partial sums reduce-scattered along that
    dim, as without float8; a 2-D product reshaped to the weight afterwards was summed whole
    and its strided rows sliced. ``split``: the manual axes both amaxes are split over."""
    xk = x.reshape(-1, *x.shape[x.ndim - n_in:])
    sx = _operand_scale(xk, x_dtype, 0, rowwise, split) if x_scale is None else x_scale
    sg = _operand_scale(g, g_dtype, 0, rowwise, split) if g_scale is None else g_scale
    product = jax.lax.dot_general(quantize(xk, sx, x_dtype), quantize(g, sg, g_dtype), (((0,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)
    if rowwise:  # [1, K1..Kn] and [1, N] against the product's [K1..Kn, N]
        sx, sg = sx[0][..., None], sg[0]
    return product / (sx * sg)


def fp8_matmul(x: jax.Array, w: jax.Array, recipe: str = "tensorwise", columns: tuple[str, ...] = (),
               rows: tuple[str, ...] = ()) -> jax.Array:
    """``x [..., K] @ w [K, N]`` with the forward operands in e4m3 and, in the backward pass,
    the output gradient in e5m2 (rowwise: e4m3): the input gradient ``g w^T`` and the weight
    gradient ``x^T g`` are float8 matmuls too. ``recipe``: ``tensorwise`` or ``rowwise`` (dynamic
    scales from this step's amaxes). The result in ``x``'s dtype.

    Inside a region manual over some mesh axes each device holds a piece, and an amax the
    split cuts is maxed over the axes that cut it, so every device quantises with the whole
    tensor's scale (as one device would):

    * ``columns``: ``w``'s columns (N) are split over these and ``x`` is whole on each device
      (a column-parallel projection): ``w``'s and the output gradient's whole-tensor amaxes,
      and in the input gradient (which contracts over N) the rowwise amaxes along N;
    * ``rows``: the tokens (``x``'s and the output gradient's leading dims, M) are split over
      these, ``w`` whole on each device (a pipeline's data-parallel replicas, a hand-written
      gradient reduction): ``x``'s and the output gradient's whole-tensor amaxes, and in the
      weight gradient (which contracts over M) the rowwise amaxes along M.

    Elsewhere the partitioner sees the whole tensors and reduces the amaxes itself."""
    if recipe not in ("tensorwise", "rowwise"):
        raise ValueError(f"fp8_matmul takes a dynamic recipe, tensorwise or rowwise, not {recipe!r}")
    return _fp8_matmul(x, w, recipe == "rowwise", tuple(columns), 1, tuple(rows))


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _fp8_matmul(x: jax.Array, w: jax.Array, rowwise: bool, columns: tuple[str, ...], n_in: int,
                rows: tuple[str, ...]) -> jax.Array:
    return _forward(x, w, rowwise, columns, n_in, rows)[0]


def _as_2d(x, w, n_in):
    """``x [..., K1..Kn]`` as ``[M, K]``, ``w [K1..Kn, N1..]`` as ``[K, N]``. (Reshaped here, not
    by the caller, so the saved residuals are the arrays given: a weight gathered by the
    caller is then re-gathered in the backward pass, not kept, as its policy says.)"""
    k = math.prod(w.shape[:n_in])
    return x.reshape(-1, k), w.reshape(k, -1)


def _forward(x, w, rowwise, columns, n_in, rows):
    x2, w2 = _as_2d(x, w, n_in)
    if rowwise:  # contracting K, whole here: a rowwise amax along it needs no maximum over devices
        return _out(scaled_matmul(x2, w2, E4M3, E4M3, True), x, w, n_in), (x, w, None)
    # Tensorwise: the weight's scale is kept for the input gradient's matmul, which would
    # otherwise take the same amax again (a reduction over the devices a split weight lies
    # on). ``x`` is whole on each device of ``columns``: only ``rows`` cut its amax. (Its scale
    # is taken again for the weight gradient: the kept one made XLA:CPU's compiled temp 10-17%
    # larger on the test meshes, for a reason not found; tests/test_fp8_training.py.)
    sx = keep_scale(_operand_scale(x2, E4M3, 1, False, rows))
    sw = keep_scale(_operand_scale(w2, E4M3, 0, False, columns))
    return _out(scaled_matmul(x2, w2, E4M3, E4M3, False, sx, sw), x, w, n_in), (x, w, sw)


def _out(y, x, w, n_in):
    return y.reshape(*x.shape[:x.ndim - n_in], *w.shape[n_in:]).astype(x.dtype)


def _backward(rowwise, columns, n_in, rows, saved, g):
    x, w, sw = saved
    x2, w2 = _as_2d(x, w, n_in)
    g2 = g.reshape(x2.shape[0], w2.shape[1])
    if rowwise:
        # g w^T contracts over N, which ``columns`` split: g's and w's amaxes along it.
        dx = scaled_matmul(g2, w2.T, E4M3, E4M3, True, a_split=columns, b_split=columns)
        # x^T g contracts over the tokens M, which ``rows`` split: x's and g's amaxes along it.
        dw = weight_grad(x, g2, n_in, E4M3, E4M3, True, rows)
    else:  # the output gradient's one scale (N split over ``columns``, M over ``rows``) serves both
        sg = _operand_scale(g2, E5M2, 0, False, columns + rows)
        dx = scaled_matmul(g2, w2.T, E5M2, E4M3, False, sg, sw)
        dw = weight_grad(x, g2, n_in, E4M3, E5M2, False, rows, g_scale=sg)
    return dx.reshape(x.shape).astype(x.dtype), dw.reshape(w.shape).astype(w.dtype)


_fp8_matmul.defvjp(_forward, _backward)


def dense(x: jax.Array, w: jax.Array, n_in: int, recipe: str, columns: tuple[str, ...] = (),
          rows: tuple[str, ...] = ()) -> jax.Array:
    """A linear layer's product in float8: ``x [..., K1..Kn]`` contracted with ``w [K1..Kn,
    N1..]`` over its ``n_in`` leading dims (``bld,dnh->blnh`` is 1, ``blnh,nhd->bld`` 2), as
    one 2-D :func:`fp8_matmul` (``columns``, ``rows``: its manual split), so a tensorwise or
    rowwise amax covers what the layer's matmul contracts (all of a head group's outputs, say,
    not one head's)."""
    if tuple(w.shape[:n_in]) != tuple(x.shape[x.ndim - n_in:]):
        raise ValueError(f"fp8 dense: x {x.shape} and w {w.shape} do not share {n_in} contracted dim(s)")
    if recipe not in ("tensorwise", "rowwise"):
        raise ValueError(f"fp8 dense takes a dynamic recipe, tensorwise or rowwise, not {recipe!r}")
    return _fp8_matmul(x, w, recipe == "rowwise", tuple(columns), n_in, tuple(rows))


# ---- the delayed recipe -----------------------------------------------------------------------

META_SUFFIX = "_fp8"  # a delayed linear layer's state sits beside its weight: "wq" -> "wq_fp8"
HISTORY = 16  # amaxes kept per operand (Transformer Engine's default amax_history_len is 1024; 16 here)


def delayed_init(history: int = HISTORY) -> jax.Array:
    """A delayed float8 linear layer's state as one ``[3, history + 1]`` float32 array: a row
    each for the input, the weight and the output gradient, holding its amax history (newest
    first) and, last, the scale its next step quantises with (1 before any history)."""
    if history < 1:
        raise ValueError(f"an amax history needs at least 1 entry, got {history}")
    return jnp.concatenate([jnp.zeros((3, history), jnp.float32), jnp.ones((3, 1), jnp.float32)], axis=1)


def delayed_dense(x: jax.Array, w: jax.Array, meta: jax.Array, n_in: int, columns: tuple[str, ...] = ()) -> jax.Array:
    """:func:`dense` with delayed tensorwise scales from ``meta`` (:func:`delayed_init`'s
    layout): the input and weight quantised with the scales earlier steps set, the output
    gradient likewise in the backward pass, and this step's amaxes (each the whole tensor's:
    maxed over ``columns`` in a column-parallel region) rolled into the histories. The next
    meta comes back as ``meta``'s cotangent: the gradient with respect to ``meta`` *is* the
    next step's meta, which a step stores instead of applying an update (flax's and
    Transformer Engine's convention). Used once per step, that is exact; a sum over uses
    (microbatches accumulated) is not an amax, so accumulating needs a maximum instead."""
    if tuple(w.shape[:n_in]) != tuple(x.shape[x.ndim - n_in:]):
        raise ValueError(f"fp8 dense: x {x.shape} and w {w.shape} do not share {n_in} contracted dim(s)")
    return _delayed_dense(x, w, meta, n_in, tuple(columns))


def _whole_amax(a: jax.Array, columns: tuple[str, ...]) -> jax.Array:
    a = amax(a)
    return jax.lax.pmax(a, columns) if columns else a


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _delayed_dense(x, w, meta, n_in, columns):
    return _delayed_dense_fwd(x, w, meta, n_in, columns)[0]


def _delayed_dense_fwd(x, w, meta, n_in, columns):
    x2, w2 = _as_2d(x, w, n_in)
    y = scaled_matmul(x2, w2, E4M3, E4M3, False, meta[0, -1], meta[1, -1])
    out = y.reshape(*x.shape[:x.ndim - n_in], *w.shape[n_in:]).astype(x.dtype)
    # (``x`` is whole on each device of ``columns``; its maximum over them makes the next meta
    # the same on each by its type, as the region's output needs.)
    return out, (x, w, meta, keep_scale(_whole_amax(x2, columns)), keep_scale(_whole_amax(w2, columns)))


def _delayed_dense_bwd(n_in, columns, saved, g):
    x, w, meta, x_amax, w_amax = saved
    x2, w2 = _as_2d(x, w, n_in)
    g2 = g.reshape(x2.shape[0], w2.shape[1])
    dx = scaled_matmul(g2, w2.T, E5M2, E4M3, False, meta[2, -1], meta[1, -1])
    dw = weight_grad(x, g2, n_in, E4M3, E5M2, False, (), meta[0, -1], meta[2, -1])
    rows = []
    for row, seen, dtype in ((0, x_amax, E4M3), (1, w_amax, E4M3), (2, _whole_amax(g2, columns), E5M2)):
        history = update_history(meta[row, :-1], seen)
        rows.append(jnp.concatenate([history, delayed_scale(history, meta[row, -1], dtype).reshape(1)]))
    new = jnp.stack(rows).astype(meta.dtype)  # the same on every device of ``columns``
    return dx.reshape(x.shape).astype(x.dtype), dw.reshape(w.shape).astype(w.dtype), new


_delayed_dense.defvjp(_delayed_dense_fwd, _delayed_dense_bwd)
