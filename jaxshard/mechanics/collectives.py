"""The ``torch.distributed`` collectives on named mesh axes, for use inside ``jax.shard_map``.

``axis`` is a mesh axis name or a tuple of names; the members of a tuple are numbered row-major
in the tuple's order (``lax.axis_index``'s numbering), so member ``i`` of ``("data", "tensor")``
on ``data=2,tensor=4`` is ``data * 4 + tensor``. ``root`` is such a member number. Every member
of the axis must make the same call (SPMD), and each device only ever holds its own block.

What each one compiles to on XLA:CPU, per device, for an ``n``-byte ``x`` on an axis of 8. The
collectives and their buffers are read from the compiled HLO (:func:`buffer_bytes`); the bytes
*sent* are the ring model's (:func:`jaxshard.analysis.hlo.ring_sent_bytes`) applied to them by
:func:`bytes_sent` -- modelled, since the HLO says what a collective moves, not how NCCL or gloo
route it -- and pinned by the tests:

=================  ======================================  =========================================
function           HLO                                     bytes sent per device
=================  ======================================  =========================================
broadcast          all-reduce (n)                          2*7/8 n
reduce             all-reduce (n)                          2*7/8 n
all_reduce         all-reduce (n)                          2*7/8 n
scatter            7 collective-permutes (n/8 each)        root 7/8 n, others 0
gather             7 collective-permutes (n each)          root 0, others n
all_gather         all-gather (8n result)                  7 n
reduce_scatter     reduce-scatter (n)                      7/8 n
all_to_all         all-to-all (n, in 8 pieces on CPU)      7/8 n
barrier            all-reduce (4 bytes)                    7
send_recv_ring     collective-permute (n)                  n
=================  ======================================  =========================================

reduce_scatter with max or min is an all-reduce and a slice (read by jaxshard.analysis.hlo as a
reduce-scatter, so counted at 7/8 n, though the all-reduce moves 2*7/8 n).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxshard.analysis import hlo
from jaxshard.errors import ConfigError

Axis = str | tuple[str, ...]
OPS = ("sum", "max", "min", "mean")


def _axes(axis: Axis) -> tuple[str, ...]:
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    if not axes or not all(isinstance(a, str) for a in axes) or len(set(axes)) < len(axes):
        raise ConfigError(f"axis must be a mesh axis name or a non-empty tuple of distinct ones, got {axis!r}")
    return tuple(str(a) for a in axes)


def _size(axes: tuple[str, ...]) -> int:
    try:
        return math.prod(lax.axis_size(a) for a in axes)
    except NameError:
        raise ConfigError(f"axis {axes} is not a manual axis here: call the collectives inside "
                          "jax.shard_map over a mesh with these axes") from None


def _root(root: int, axes: tuple[str, ...], n: int) -> int:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < n:
        raise ConfigError(f"root {root!r} is out of range for axis {_name(axes)} of size {n}")
    return int(root)


def _op(op: str, fn: str) -> str:
    if op not in OPS:
        raise ConfigError(f"unknown op {op!r} for {fn}; expected one of {', '.join(OPS)}")
    return op


def _chunks(x: jax.Array, axes: tuple[str, ...], n: int, fn: str) -> int:
    """Rows per chunk when dim 0 of ``x`` is split into one chunk per member."""
    if jnp.ndim(x) == 0 or x.shape[0] % n:
        dim0 = x.shape[0] if jnp.ndim(x) else "none, a scalar"
        raise ConfigError(f"{fn}: dim 0 of x ({dim0}) is not divisible by the size {n} of axis {_name(axes)}")
    return x.shape[0] // n


def _dim0(x: jax.Array, fn: str) -> None:
    if jnp.ndim(x) == 0:
        raise ConfigError(f"{fn} concatenates along dim 0: x must have one, got a scalar")


def _name(axes: tuple[str, ...]) -> str:
    return repr(axes[0]) if len(axes) == 1 else repr(axes)


def _reduce(x: jax.Array, axes: tuple[str, ...], op: str) -> jax.Array:
    if op == "sum":
        return lax.psum(x, axes)
    if op == "max":
        return lax.pmax(x, axes)
    if op == "min":
        return lax.pmin(x, axes)
    return lax.pmean(x, axes)


def _permute(x: jax.Array, axes: tuple[str, ...], pairs: list[tuple[int, int]]) -> jax.Array:
    """``lax.ppermute`` with member numbers in ``axes``' order. ppermute numbers the members of
    a tuple of axes in the mesh's order whatever the tuple's (jax 0.10), unlike axis_index and
    the other collectives; so it is called with the axes in mesh order and the numbers translated."""
    names = tuple(jax.sharding.get_abstract_mesh().axis_names)
    order = tuple(sorted(axes, key=names.index)) if set(axes) <= set(names) else axes
    if order != axes:
        sizes = {a: lax.axis_size(a) for a in axes}

        def renumber(i: int) -> int:
            coords = dict(zip(axes, np.unravel_index(i, [sizes[a] for a in axes])))
            return int(np.ravel_multi_index([coords[a] for a in order], [sizes[a] for a in order]))

        pairs = [(renumber(s), renumber(d)) for s, d in pairs]
    return lax.ppermute(x, order, pairs)


def broadcast(x: jax.Array, axis: Axis, root: int = 0) -> jax.Array:
    """Every member gets the root's ``x``.

    One all-reduce (sum) of ``x`` masked to zeros off the root: 2(m-1)/m of ``x`` sent per
    device on an m-member ring. Gathering every member's ``x`` and keeping the root's would send
    (m-1) times ``x``. (``lax.pbroadcast``, HLO collective-broadcast, lowers on GPU only.)"""
    axes = _axes(axis)
    root = _root(root, axes, _size(axes))
    return lax.psum(jnp.where(lax.axis_index(axes) == root, x, jnp.zeros_like(x)), axes)


def reduce(x: jax.Array, axis: Axis, root: int = 0, op: str = "sum") -> jax.Array:
    """The root gets ``op`` over every member's ``x``; the other members get zeros (torch leaves
    them unspecified). ``mean`` of integers is a float, as ``jnp.mean``.

    One all-reduce: XLA has no reduce-to-one collective, so every member computes the result and
    all but the root drop it (2(m-1)/m of ``x`` sent per device)."""
    axes = _axes(axis)
    root = _root(root, axes, _size(axes))
    out = _reduce(x, axes, _op(op, "reduce"))
    return jnp.where(lax.axis_index(axes) == root, out, jnp.zeros_like(out))


def all_reduce(x: jax.Array, axis: Axis, op: str = "sum") -> jax.Array:
    """Every member gets ``op`` (sum, max, min, mean) over every member's ``x``: one all-reduce.
    ``mean`` of integers is a float, as ``jnp.mean``."""
    axes = _axes(axis)
    _size(axes)
    return _reduce(x, axes, _op(op, "all_reduce"))


def scatter(x: jax.Array, axis: Axis, root: int = 0) -> jax.Array:
    """The root's ``x`` split along dim 0 into one chunk per member; member i gets chunk i.
    Only the root's ``x`` is read (the others' only give the shape).

    m-1 collective-permutes, one from the root to each other member, as torch's point-to-point
    scatter: the root sends (m-1)/m of ``x`` and the others nothing. (A reduce-scatter of ``x``
    masked to zeros off the root is one collective, but every member sends (m-1)/m of ``x``.)"""
    axes = _axes(axis)
    n = _size(axes)
    root = _root(root, axes, n)
    rows = _chunks(x, axes, n, "scatter")
    chunks = x.reshape(n, rows, *x.shape[1:])
    me = lax.axis_index(axes)
    out = chunks[root]
    for i in range(n):
        if i != root:
            out = jnp.where(me == i, _permute(chunks[i], axes, [(root, i)]), out)
    return out


def gather(x: jax.Array, axis: Axis, root: int = 0) -> jax.Array:
    """The root gets every member's ``x`` concatenated along dim 0 (member order); the other
    members get zeros of that shape.

    m-1 collective-permutes, one from each other member to the root, as torch's gather: each
    member sends its ``x`` once and the root nothing. (An all-gather would send (m-1) times
    ``x`` from every device, for a result that only the root keeps.)"""
    axes = _axes(axis)
    n = _size(axes)
    root = _root(root, axes, n)
    _dim0(x, "gather")
    is_root = lax.axis_index(axes) == root
    parts = [jnp.where(is_root, x, jnp.zeros_like(x)) if i == root else _permute(x, axes, [(i, root)])
             for i in range(n)]
    return jnp.concatenate(parts, axis=0)


def all_gather(x: jax.Array, axis: Axis) -> jax.Array:
    """Every member gets every member's ``x`` concatenated along dim 0: one all-gather, (m-1)
    times ``x`` sent per device. The result is varying under ``check_vma`` (see
    ``lax.all_gather(..., to='invarying')`` for a replicated one)."""
    axes = _axes(axis)
    _size(axes)
    _dim0(x, "all_gather")
    return lax.all_gather(x, axes, axis=0, tiled=True)


def reduce_scatter(x: jax.Array, axis: Axis, op: str = "sum") -> jax.Array:
    """``op`` over every member's ``x``, then member i keeps chunk i of dim 0.

    sum and mean: one reduce-scatter, (m-1)/m of ``x`` sent per device. max and min (which XLA's
    reduce-scatter does not take from jax): an all-reduce and a slice, which jaxshard.analysis.hlo reads as
    a reduce-scatter; the all-reduce itself moves 2(m-1)/m of ``x``."""
    axes = _axes(axis)
    n = _size(axes)
    op = _op(op, "reduce_scatter")
    rows = _chunks(x, axes, n, "reduce_scatter")
    if op in ("sum", "mean"):
        out = lax.psum_scatter(x, axes, scatter_dimension=0, tiled=True)
        return out / n if op == "mean" else out
    return lax.dynamic_slice_in_dim(_reduce(x, axes, op), lax.axis_index(axes) * rows, rows, axis=0)


def all_to_all(x: jax.Array, axis: Axis) -> jax.Array:
    """Member i sends chunk j of its ``x`` (dim 0, one chunk per member) to member j, which
    stacks what it receives in member order: one all-to-all, (m-1)/m of ``x`` sent per device.
    XLA:CPU spells it as one all-to-all of m pieces."""
    axes = _axes(axis)
    n = _size(axes)
    _chunks(x, axes, n, "all_to_all")
    return lax.all_to_all(x, axes, 0, 0, tiled=True)


def barrier(axis: Axis) -> jax.Array:
    """An int32 scalar all-reduce that every member of ``axis`` contributes to: its value is the
    member count, available only once every member has reached it.

    In SPMD every device runs the same program, and XLA schedules by data dependencies: a barrier
    orders nothing by itself, and one whose result nothing uses is deleted. Make the work that
    must wait depend on it, e.g. ``token, x = lax.optimization_barrier((barrier(axis), x))``.
    What it is good for: timing (``block_until_ready`` on a result that depends on it returns
    once every member has arrived), checking that every process of a job is up and talking,
    and fencing effects (callbacks, I/O) that XLA would otherwise not order across devices."""
    axes = _axes(axis)
    _size(axes)
    # Ones XLA cannot prove replicated, so the all-reduce is not folded into a multiply.
    ones = (lax.axis_index(axes) >= 0).astype(jnp.int32)
    return lax.psum(ones, axes)


def send_recv_ring(x: jax.Array, axis: Axis, shift: int = 1) -> jax.Array:
    """Member i sends ``x`` to member (i + shift) mod m and receives from (i - shift) mod m: one
    collective-permute, ``x`` sent by every device. A shift of 0 mod m is no transfer at all."""
    axes = _axes(axis)
    n = _size(axes)
    if isinstance(shift, bool) or not isinstance(shift, (int, np.integer)):
        raise ConfigError(f"shift must be an integer, got {shift!r}")
    if shift % n == 0:
        return x
    return _permute(x, axes, [(i, (i + shift) % n) for i in range(n)])


def each_device(f: Callable[[jax.Array], Any], mesh: jax.sharding.Mesh) -> Callable[[jax.Array], Any]:
    """``f`` run on every device of ``mesh`` on its own row of a ``[devices, ...]`` array; row d
    lives on ``mesh.devices.flat[d]`` (the mesh's row-major order), and so do the rows of each
    output (a scalar output becomes one element per device)."""
    spec = P(tuple(mesh.axis_names))

    def per_device(x):
        return jax.tree.map(lambda y: y[None], f(x[0]))

    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec))


def collectives_of(fn: Callable | jax.stages.Compiled, *args) -> list[hlo.Collective]:
    """The collectives of a compiled program, or of ``fn`` compiled for ``args`` (arrays or
    ``jax.ShapeDtypeStruct``s)."""
    compiled = fn if isinstance(fn, jax.stages.Compiled) else jax.jit(fn).lower(*args).compile()
    return hlo.parse(compiled.as_text())


def sent_by_partition(found: list[hlo.Collective]) -> dict[int, float]:
    """Bytes each partition sends: the ring model's share for every member of a group, and for a
    collective-permute the buffer from each source of a pair (a member that is no source sends
    nothing)."""
    sent: dict[int, float] = defaultdict(float)
    for c in found:
        if c.kind == "collective-permute":
            for src, dst in c.groups:
                if src != dst:
                    sent[src] += c.bytes * c.executions
            continue
        for group in c.groups:
            for p in group:
                sent[p] += hlo.ring_sent_bytes(c.kind, c.bytes, len(group)) * c.executions
    return dict(sent)


def buffer_bytes(fn: Callable | jax.stages.Compiled, mesh: jax.sharding.Mesh, *args) -> dict[int, int]:
    """``{device id: bytes}`` of the collective buffers each device of ``mesh`` takes part in,
    read from the compiled HLO (an all-reduce's buffer, an all-gather's result, a reduce-scatter's
    input, a permute's buffer at its source and its target): measured, no model."""
    held: dict[int, float] = defaultdict(float)
    for c in collectives_of(fn, *args):
        members = {p for pair in c.groups for p in pair if len(set(pair)) > 1} \
            if c.kind == "collective-permute" else {p for g in c.groups for p in g}
        for p in members:
            held[p] += c.bytes * c.executions
    return {d.id: round(held.get(p, 0.0)) for p, d in enumerate(mesh.devices.flat)}


def bytes_sent(fn: Callable | jax.stages.Compiled, mesh: jax.sharding.Mesh, *args) -> dict[int, int]:
    """``{device id: bytes}`` that each device of ``mesh`` sends when the program runs, under the
    ring model (a model: see the module's docstring): a compiled program, or ``fn`` compiled for
    ``args`` (``fn`` built on ``mesh``, e.g. with :func:`each_device`). The collectives are read
    from the compiled HLO; partition p of the program is ``mesh.devices.flat[p]``, as jit places
    a mesh's devices."""
    sent = sent_by_partition(collectives_of(fn, *args))
    return {d.id: round(sent.get(p, 0.0)) for p, d in enumerate(mesh.devices.flat)}
