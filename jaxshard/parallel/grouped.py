"""Dropless experts' MLPs on the rows routed to them, and only those: each row is a token's
choice of an expert; the rows come sorted by expert (``sizes`` per expert), each names its
token (``token``) and its gate (0 past the sizes' sum), and each expert's MLP runs on its
rows, the outputs scaled by their gates and summed into their tokens.

On GPUs and TPUs the three matmuls are ``jax.lax.ragged_dot``, which lowers to a grouped
matmul kernel. XLA:CPU has none: jax lowers ``ragged_dot`` there as every row times every
group's matrix, masked (G times the FLOPs; ``tests/test_grouped.py`` reads it from the
compiled program). On CPU the MLP runs in tiles instead (MegaBlocks' tiling): each
expert's rows in tiles of ``8m`` as many as fit, then at most one of ``4m`` and one of
``2m``, then tiles of ``m``, ``while`` loops over the tiles there are (a count known only at
run time; one loop a tile size). A tile reads its expert's weights and, backward, adds into
their gradients: a cost per tile whatever its rows, which the large tiles pay once for 8m
rows. One pass gathers each tile's rows from their tokens and makes the up (and gate)
projections, the pre-activations, the only ``[rows, F]`` buffers; a second applies the
activation, the down projection and the gated sum into the tokens. So no buffer of every
possible row's input or output passes through memory. The rows computed beyond the real ones
are at most ``G (m - 1)``, the padding of the tiles of m. Backward (custom VJPs) runs the
same tiles in two passes, for the tokens', gates' and weights' gradients. The first pass's
count of rows comes back with the result, so a caller can report the rows a step computed
from the program itself. The
pre-activations are named (``GROUPED``) so that the ``dots`` remat policies keep them as a
matmul's outputs (a custom VJP's own residuals no policy sees, so the forward would run
again).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxshard.errors import ConfigError

# The experts' outputs, which the ``dots`` remat policies keep as they keep a dot's.
GROUPED = "grouped_matmul"


_KERNEL = contextvars.ContextVar("grouped_kernel", default="auto")


@contextlib.contextmanager
def kernel(name: str) -> Iterator[None]:
    """Trace :func:`experts` with ``name``: "tiled" or "ragged" on any backend (the tests run
    the GPUs' ``ragged_dot`` path on CPU against the tiled one), "triton" on GPUs --
    ``ragged_dot`` lowered by JAX's Pallas Triton grouped matmul, a JAX option set for the
    process (it is read when the step is lowered, after this context), or "auto"."""
    if name not in ("tiled", "ragged", "triton", "auto"):
        raise ValueError(f"grouped kernel must be tiled, ragged, triton or auto, got {name!r}")
    if name == "triton":
        if jax.default_backend() != "gpu":
            raise ConfigError(f"--moe-kernel triton runs on GPUs only, not on {jax.default_backend()}")
        try:
            jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", True)
        except AttributeError:
            raise ConfigError(f"--moe-kernel triton: jax {jax.__version__} has no Pallas Triton "
                              "ragged_dot lowering") from None
        name = "ragged"
    token = _KERNEL.set(name)
    try:
        yield
    finally:
        _KERNEL.reset(token)


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


def experts(x_ND: jax.Array, token_R: jax.Array, gate_R: jax.Array, group_R: jax.Array, sizes_G: jax.Array,
            weights: dict[str, jax.Array], act: Callable, *, lead: jax.Array,
            tile: int) -> tuple[jax.Array, jax.Array]:
    """(``[N, D]`` the gated sum of each token's experts' outputs, the rows computed). The
    rows ``[R]`` are sorted by expert, ``sizes_G`` per expert, ``group_R`` each row's expert;
    ``weights``: ``w_in`` and ``w_out`` ``[G, D, F]`` / ``[G, F, D]``, optionally ``w_gate``
    (then ``act(up, gate)``, else ``act(up, None)``) and biases ``b_in`` ``[G, F]`` and
    ``b_out`` ``[G, D]`` (the latter times ``lead``). On CPU tiled, elsewhere by
    ``jax.lax.ragged_dot`` (or as :func:`kernel` says)."""
    name = _KERNEL.get()
    if name == "auto":
        name = "tiled" if jax.default_backend() == "cpu" else "ragged"
    if name == "ragged":
        out, rows = _ragged(x_ND, token_R, gate_R, group_R, sizes_G, weights, act, lead)
    else:
        names = tuple(sorted(weights))
        out, rows = _tiled(x_ND, token_R, gate_R, sizes_G.astype(jnp.int32), lead, tuple(weights[n] for n in names),
                           names, act, tile)
    return checkpoint_name(out, GROUPED), rows


def _ragged(x_ND, token_R, gate_R, group_R, sizes_G, w, act, lead):
    rows = x_ND[token_R]
    up = jax.lax.ragged_dot(rows, w["w_in"], sizes_G)
    if "b_in" in w:
        up = up + w["b_in"][group_R]
    up = checkpoint_name(up, GROUPED)
    gate = checkpoint_name(jax.lax.ragged_dot(rows, w["w_gate"], sizes_G), GROUPED) if "w_gate" in w else None
    y = jax.lax.ragged_dot(act(up, gate), w["w_out"], sizes_G)
    if "b_out" in w:  # (rows past the sizes' sum hold no output, as ragged_dot's)
        y = y + jnp.where(jnp.arange(y.shape[0]) < jnp.sum(sizes_G), lead, 0)[:, None] * w["b_out"][group_R]
    out = jnp.zeros_like(x_ND, dtype=y.dtype).at[token_R].add(y * gate_R[:, None].astype(y.dtype))
    return out, jnp.sum(sizes_G)


# ---- the tiled kernel (CPU) -----------------------------------------------------------------

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


def _summed(grad: jax.Array, primal: jax.Array) -> jax.Array:
    """``grad`` summed over the manual axes it varies over and ``primal`` does not (the
    transpose of the implicit broadcast of an operand the same on those devices), in float32
    (XLA:CPU cannot promote a 2-byte sum made in a shard_map), in ``primal``'s dtype."""
    extra = tuple(sorted(_varying(grad) - _varying(primal)))
    if extra:
        grad = jax.lax.psum(grad.astype(jnp.float32), extra)
    return grad.astype(primal.dtype)


# Tile sizes m, 2m, 4m and 8m: a group's rows go in as many tiles of 8m as fit, then at most
# one of 4m and one of 2m, then tiles of m (the last one padded). Each tile reads its expert's
# weights and adds into its weight gradients, a cost per tile whatever its rows, so fewer,
# larger tiles cost less; the padding stays that of tiles of m.
LEVELS = 4


def tile_sizes(m: int, n_rows: int | None = None) -> tuple[int, ...]:
    """The tile sizes of the kernel's loops, largest first (one loop each, the same matmuls
    per row): an iteration of every loop together computes ``sum(tile_sizes(m))`` rows. Sizes
    above ``n_rows`` (no group has that many rows) have no loop."""
    return tuple(m << j for j in reversed(range(LEVELS)) if j == 0 or n_rows is None or m << j <= n_rows)


class _Tiles:
    """Rows ``[start, start + size)`` of each group g in ceil(size / m) tiles of m, groups in
    order: each tile's group, first row and the end of its rows, for as many tiles as there
    can be; ``count`` the tiles there are."""

    def __init__(self, start_G: jax.Array, sizes_G: jax.Array, m: int, n_rows: int):
        G = sizes_G.shape[0]
        per_group = (sizes_G + m - 1) // m
        last = jnp.cumsum(per_group)
        t = jnp.arange(-(-n_rows // m) + G, dtype=jnp.int32)
        # (A count of the groups whose tiles end at or before t: jnp.searchsorted fails on a
        # shard_map's varying operands in jax 0.10.2.)
        self.group = jnp.minimum(jnp.sum(last[None, :] <= t[:, None], axis=1), G - 1).astype(jnp.int32)
        self.first = start_G[self.group] + (t - last[self.group] + per_group[self.group]) * m
        self.end = start_G[self.group] + sizes_G[self.group]
        self.count = last[-1]
        self.m = m

    def rows(self, t, *padded: jax.Array):
        """Tile t's slice of each row array (padded with m rows past the end), and its mask."""
        valid = self.first[t] + jnp.arange(self.m) < self.end[t]
        return [jax.lax.dynamic_slice_in_dim(a, self.first[t], self.m) for a in padded], valid


def _tilings(sizes_G: jax.Array, m: int, n_rows: int) -> list[_Tiles]:
    """The rows sorted by group (``sizes_G``) in tiles of :func:`tile_sizes`, one ``_Tiles``
    a size: every size but m takes whole tiles only, m the rest of each group."""
    start, left, out = jnp.cumsum(sizes_G) - sizes_G, sizes_G, []
    for size in tile_sizes(m, n_rows):
        take = left if size == m else left // size * size
        out.append(_Tiles(start, take, size, n_rows))
        start, left = start + take, left - take
    return out


def _loop(n: jax.Array, body, init):
    """``body(t, carry)`` for t < n; returns (the final carry, the count run)."""
    t, carry = jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, body(c[0], c[1])), (jnp.int32(0), init))
    return carry, t


def _loops(tilings: list[_Tiles], body, init):
    """``body(tiles, t, carry)`` for every tile of every tiling in turn; returns (the final
    carry, the rows the tiles computed: their padding included)."""
    carry, rows = init, jnp.int32(0)
    for tiles in tilings:
        carry, n = _loop(tiles.count, functools.partial(body, tiles), carry)
        rows = rows + n * tiles.m
    return carry, rows


def _pad(a: jax.Array, m: int) -> jax.Array:
    """``a`` with m rows after its last (a last tile's slice stays in place)."""
    return jnp.concatenate([a, jnp.zeros((m, *a.shape[1:]), a.dtype)])


def _dot(a, b, dtype=jnp.float32):
    return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dtype)


def _f32(a):
    return a.astype(jnp.float32)


# The up projection (and gate): rows gathered from their tokens, pre-activations out.

def _project(x_ND, token_R, sizes_G, ws, names, m):
    w = dict(zip(names, ws))
    R, F = token_R.shape[0], w["w_in"].shape[-1]
    tilings, token = _tilings(sizes_G, m, R), _pad(token_R, m)
    dtype = jnp.result_type(x_ND, w["w_in"])
    kinds = [k for k in ("w_in", "w_gate") if k in w]

    def body(tiles, t, pre):
        (tok,), valid = tiles.rows(t, token)
        e, xt, first = tiles.group[t], x_ND[tok], tiles.first[t]
        new = {k: _dot(xt, w[k][e], dtype) + (w["b_in"][e] if k == "w_in" and "b_in" in w else 0) for k in kinds}
        return {k: jax.lax.dynamic_update_slice_in_dim(
            pre[k], jnp.where(valid[:, None], new[k], jax.lax.dynamic_slice_in_dim(pre[k], first, tiles.m)),
            first, 0) for k in kinds}

    pre, rows = _loops(tilings, body, {k: _zeros((R + m, F), dtype, x_ND, *ws) for k in kinds})
    return tuple(pre[k] for k in kinds), rows  # (R + m rows: the padded layout stays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _projected(x_ND, token_R, sizes_G, ws, names, m):
    return _project(x_ND, token_R, sizes_G, ws, names, m)


def _projected_fwd(x_ND, token_R, sizes_G, ws, names, m):
    return _project(x_ND, token_R, sizes_G, ws, names, m), (x_ND, token_R, sizes_G, ws)


def _projected_bwd(names, m, res, cts):
    x_ND, token_R, sizes_G, ws = res
    w = dict(zip(names, ws))
    d_pre = dict(zip([k for k in ("w_in", "w_gate") if k in w], cts[0]))
    R = token_R.shape[0]
    tilings, token = _tilings(sizes_G, m, R), _pad(token_R, m)
    padded = d_pre  # (R + m rows)

    def body(tiles, t, carry):
        dx, dw = carry
        (tok,), valid = tiles.rows(t, token)
        e, xt = tiles.group[t], _f32(x_ND[tok])
        upd, dxt = {}, 0.0
        for k, d in padded.items():
            dt = jnp.where(valid[:, None], _f32(jax.lax.dynamic_slice_in_dim(d, tiles.first[t], tiles.m)), 0)
            upd[k] = xt.T @ dt
            dxt = dxt + dt @ _f32(w[k][e]).T
            if k == "w_in" and "b_in" in w:
                upd["b_in"] = jnp.sum(dt, axis=0)
        return dx.at[tok].add(jnp.where(valid[:, None], dxt, 0)), {k: dw[k].at[e].add(upd[k]) for k in dw}

    like = (x_ND, *ws, *d_pre.values())
    init = (_zeros(x_ND.shape, jnp.float32, *like),
            {k: _zeros(w[k].shape, jnp.float32, *like) for k in names if k in ("w_in", "w_gate", "b_in")})
    (dx, dw), _ = _loops(tilings, body, init)
    return _summed(dx, x_ND), None, None, tuple(_summed(dw[k], w[k]) if k in dw else jnp.zeros_like(w[k])
                                                for k in names)


_projected.defvjp(_projected_fwd, _projected_bwd)


# The activation, the down projection and the gated sum into the tokens.

def _combine(pre, token_R, gate_R, sizes_G, lead, ws, names, act, m, n_tokens):
    w = dict(zip(names, ws))
    R, D = token_R.shape[0], w["w_out"].shape[-1]
    tilings, token, gate = _tilings(sizes_G, m, R), _pad(token_R, m), _pad(gate_R, m)
    padded = pre  # (R + m rows)
    dtype = jnp.result_type(pre[0], w["w_out"])

    def body(tiles, t, out):
        (tok, g, *p), valid = tiles.rows(t, token, gate, *padded)
        e = tiles.group[t]
        y = _dot(act(p[0], p[1] if len(p) > 1 else None), w["w_out"][e], dtype)
        if "b_out" in w:
            y = y + lead * w["b_out"][e]
        return out.at[tok].add(jnp.where(valid[:, None], y * g[:, None].astype(dtype), 0))

    return _loops(tilings, body, _zeros((n_tokens, D), dtype, *pre, gate_R, lead, *ws))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _combined(pre, token_R, gate_R, sizes_G, lead, ws, names, act, m, n_tokens):
    return _combine(pre, token_R, gate_R, sizes_G, lead, ws, names, act, m, n_tokens)


def _combined_fwd(pre, token_R, gate_R, sizes_G, lead, ws, names, act, m, n_tokens):
    return (_combine(pre, token_R, gate_R, sizes_G, lead, ws, names, act, m, n_tokens),
            (pre, token_R, gate_R, sizes_G, lead, ws))


def _combined_bwd(names, act, m, n_tokens, res, d_out):
    pre, token_R, gate_R, sizes_G, lead, ws = res
    w = dict(zip(names, ws))
    R, F = token_R.shape[0], pre[0].shape[-1]
    tilings, token, gate = _tilings(sizes_G, m, R), _pad(token_R, m), _pad(gate_R, m)
    padded = pre  # (R + m rows)
    two = len(pre) > 1

    def body(tiles, t, carry):
        d_pre, d_gate, dw = carry
        (tok, g, *p), valid = tiles.rows(t, token, gate, *padded)
        e = tiles.group[t]
        g = jnp.where(valid, g, 0).astype(jnp.float32)
        dy = _f32(d_out[tok])  # the tokens' output gradient, before the gate
        h, act_vjp = jax.vjp(act, *p) if two else jax.vjp(lambda u: act(u, None), p[0])
        u = dy @ _f32(w["w_out"][e]).T  # dL/dh per unit gate
        d_g = jnp.sum(_f32(h) * u, axis=-1)  # <y, dy>, y = h w_out (+ lead b_out)
        dyg = dy * g[:, None]
        upd = {"w_out": _f32(h).T @ dyg}
        if "b_out" in w:
            d_g = d_g + _f32(lead) * (dy @ _f32(w["b_out"][e]))
            upd["b_out"] = jnp.sum(dyg, axis=0) * _f32(lead)
        grads = act_vjp((u * g[:, None]).astype(h.dtype))
        first = tiles.first[t]
        d_pre = [jax.lax.dynamic_update_slice_in_dim(
            d, jnp.where(valid[:, None], _f32(gr), jax.lax.dynamic_slice_in_dim(d, first, tiles.m)), first, 0)
            for d, gr in zip(d_pre, grads)]
        # (A padded tile's rows past its group's are another group's: kept as they are.)
        d_gate = jax.lax.dynamic_update_slice_in_dim(
            d_gate, jnp.where(valid, d_g, jax.lax.dynamic_slice_in_dim(d_gate, first, tiles.m)), first, 0)
        return d_pre, d_gate, {k: dw[k].at[e].add(upd[k]) for k in dw}

    like = (*pre, d_out, gate_R, *ws)
    init = ([_zeros((R + m, F), jnp.float32, *like) for _ in pre], _zeros((R + m,), jnp.float32, *like),
            {k: _zeros(w[k].shape, jnp.float32, *like) for k in names if k in ("w_out", "b_out")})
    (d_pre, d_gate, dw), _ = _loops(tilings, body, init)
    return (tuple(_summed(d, p) for d, p in zip(d_pre, pre)), None, _summed(d_gate[:R], gate_R), None, None,
            tuple(_summed(dw[k], w[k]) if k in dw else jnp.zeros_like(w[k]) for k in names))


_combined.defvjp(_combined_fwd, _combined_bwd)


def _tiled(x_ND, token_R, gate_R, sizes_G, lead, ws, names, act, m):
    """The tiled MLP: two loops forward (its pre-activations in between, named so that the
    ``dots`` policies keep them as a matmul's output), two backward."""
    ins = tuple(w for n, w in zip(names, ws) if n in ("w_in", "w_gate", "b_in"))
    in_names = tuple(n for n in names if n in ("w_in", "w_gate", "b_in"))
    pre, count = _projected(x_ND, token_R, sizes_G, ins, in_names, m)
    pre = tuple(checkpoint_name(p, GROUPED) for p in pre)
    outs = tuple(w for n, w in zip(names, ws) if n in ("w_out", "b_out"))
    out_names = tuple(n for n in names if n in ("w_out", "b_out"))
    return _combined(pre, token_R, gate_R, sizes_G, lead, outs, out_names, act, m, x_ND.shape[0]), count
