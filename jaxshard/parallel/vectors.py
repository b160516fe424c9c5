"""Elementwise uses of vector params (norm scales, biases, the used position rows) whose
gradients reduce in the textbook's two stages.

A gradient summed over several mesh axes and stored split over some of them -- HSDP's
(``data`` x ``fsdp`` batch, params split over ``fsdp``), or FSDP's under sequence
parallelism (the sequence split over ``tensor`` too) -- is reduce-scattered over the split axes
first, then the shard is all-reduced over the rest. The partitioner does so for a matmul's
weight gradient, a ``dot_general``. A scale's or a bias's gradient is a ``reduce`` over the
batch and sequence dims instead, which it partitions by all-reducing the whole vector over
every summed axis and slicing the shard out afterwards (on 2 x 4 devices 1.75x the bytes a
ring sends, and the whole vector over the slower axis).

:func:`scale` and :func:`shift` compute ``x * w`` and ``x + b`` as usual and, where
:func:`two_stage` holds, write the weight gradient as a ``dot_general`` contracting the
leading dims, which the partitioner reduces in the two stages. Elsewhere they are the plain
operations. :func:`take_rows` looks up packed documents' position rows token by token, and
:func:`whole_rows` gathers the used position rows' gradient once where the sequence is split.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxshard.axes import RESIDUAL_BLD, Dim
from jaxshard.rules import StateKind, active, entry_axes, spec_axes


def two_stage(rules) -> bool:
    """Whether a gradient summed over several mesh axes (the batch's, and the sequence split of
    sequence or context parallelism) is stored split over some of them but not all, so that the
    textbook reduces it in two stages: over the split ones first (a reduce-scatter), then the
    shard over the rest (an all-reduce)."""
    if rules is None:
        return False
    split = set(rules.state_axes(StateKind.GRADS))
    summed = (set(rules.batch_axes) | set(rules.activation_mesh_axes(Dim.LENGTH))
              | set(rules.activation_mesh_axes(Dim.RESIDUAL_LENGTH)))
    return bool(split & summed) and bool(summed - split)


def scale(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x * w``, ``w`` over the trailing dims of ``x``."""
    if not two_stage(active()) or x.dtype != w.dtype:
        return x * w
    return _scale(x, w)


def shift(x: jax.Array, b: jax.Array) -> jax.Array:
    """``x + b``, ``b`` over the trailing dims of ``x``."""
    if not two_stage(active()) or x.dtype != b.dtype:
        return x + b
    return _shift(x, b, b.ndim)


@jax.custom_vjp
def _scale(x, w):
    return x * w


def _scale_bwd(res, g):
    x, w = res
    lead, trail = tuple(range(x.ndim - w.ndim)), tuple(range(x.ndim - w.ndim, x.ndim))
    return g * w, jax.lax.dot_general(x, g, ((lead, lead), (trail, trail)))


_scale.defvjp(lambda x, w: (x * w, (x, w)), _scale_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _shift(x, b, rank):
    return x + b


def _shift_bwd(rank, _, g):
    lead = tuple(range(g.ndim - rank))
    ones = jnp.ones(g.shape[:len(lead)], g.dtype)
    return g, jax.lax.dot_general(g, ones, ((lead, lead), ((), ())))


_shift.defvjp(lambda x, b, rank: (x + b, None), _shift_bwd)


def gathers_rows(rules, table_shape: tuple[int, ...]) -> bool:
    """Whether the gradient of a learned position table's used rows, each sequence shard's
    rows made on it, is gathered whole in one all-gather (:func:`whole_rows`): where the tokens
    are split over the sequence (context parallelism, or sequence parallelism's tensor) and
    the table's gradient is reduced into a layout that does not split its model dim. (Where
    it does, under FSDP or ZeRO, the partitioner sends more with that layout asked of it, and
    it is left alone; so it is in a pipeline, whose stages would gather them for every
    microbatch where the partitioner moves their sum once a step.)"""
    if rules is None or rules.param_mesh_axes(Dim.LAYERS):
        return False
    split = rules.activation_mesh_axes(Dim.LENGTH) or rules.activation_mesh_axes(Dim.RESIDUAL_LENGTH)
    spec = rules.param_spec((Dim.POSITION, Dim.EMBED), table_shape, rules.reduced_into)
    return bool(split) and not spec_axes(spec)


def whole_rows(rows_LD: jax.Array, table_shape: tuple[int, ...]) -> jax.Array:
    """The used rows ``[L, D]`` of a learned position table (``table_shape``), as the tokens
    take them: where :func:`gathers_rows`, their gradient is made whole along the rows, one
    all-gather of the shards' rows. Left to the partitioner, it all-reduced them over the
    sequence under context parallelism (twice the bytes) and, under sequence parallelism, sent
    them on with collective-permutes and all-gathered them too."""
    rules = active()
    if not gathers_rows(rules, table_shape):
        return rows_LD
    return _whole_rows(rows_LD, rules.named(jax.sharding.PartitionSpec()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _whole_rows(x, whole):
    return jax.lax.with_sharding_constraint(x, whole)


_whole_rows.defvjp(lambda x, whole: (_whole_rows(x, whole), None),
                   lambda whole, _, g: (jax.lax.with_sharding_constraint(g, whole),))


def take_rows(table_PD: jax.Array, positions_BL: jax.Array) -> jax.Array:
    """``table[positions]``, ``[B, L, D]``: each token's row of a position table (packed
    documents' places). The table is gathered whole for the lookup, as an FSDP weight is for
    its matmul, and each device scatters its own tokens' gradient into a whole table, reduced
    then to where the gradient rests: where that is split over the summed batch axes, in the
    textbook's two stages (:func:`_rows_reduction`). (Left to itself, the partitioner laid the
    rows out as the table, split over its model dim, and moved the activation's gradient into
    that layout to scatter it: an involuntary full rematerialisation, which it warns of; and
    given the whole table, it all-reduced it over every summed axis and sliced the shard.)"""
    rules = active()
    if rules is None:
        return jnp.take(table_PD, positions_BL, axis=0)
    return _take_rows(table_PD, positions_BL, rules.named(jax.sharding.PartitionSpec()), table_PD.shape[0],
                      _rows_reduction(rules, table_PD.shape, positions_BL.shape))


def _rows_reduction(rules, table_shape, positions_shape):
    """How a device's scattered table gradient is reduced in two stages: ``(mesh, positions'
    spec, the activation gradient's spec, the gradient's at-rest spec, the axes it is
    reduce-scattered over (along the model dim), the axes its shard is then all-reduced
    over)``, the specs as the rules lay them out; None where the gradient does not rest split
    over summed axes alone along the model dim (it is then reduced whole)."""
    if not two_stage(rules):
        return None
    g_spec = rules.activation_spec(RESIDUAL_BLD, (*positions_shape, table_shape[1]))
    at_rest = rules.param_spec((Dim.POSITION, Dim.EMBED), table_shape, StateKind.GRADS)
    rows_axes = tuple(g_spec)[:2]
    summed = spec_axes(jax.sharding.PartitionSpec(*rows_axes))
    split = entry_axes(at_rest[1]) if len(at_rest) > 1 else ()
    if (len(tuple(g_spec)) > 2 and tuple(g_spec)[2] is not None) or (len(at_rest) and at_rest[0] is not None) \
            or not split or not set(split) <= summed:
        return None
    rest = tuple(a for a in rules.mesh.axis_names if a in summed and a not in split)
    P = jax.sharding.PartitionSpec
    return rules.context_mesh, P(*rows_axes), P(*rows_axes, None), P(None, split), split, rest


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _take_rows(table_PD, positions_BL, whole, rows, reduction):
    return jnp.take(jax.lax.with_sharding_constraint(table_PD, whole), positions_BL, axis=0)


def _take_rows_fwd(table_PD, positions_BL, whole, rows, reduction):
    return _take_rows(table_PD, positions_BL, whole, rows, reduction), positions_BL


def _take_rows_bwd(whole, rows, reduction, positions_BL, g_BLD):
    zero = np.zeros(positions_BL.shape, jax.dtypes.float0)
    if reduction is None:
        d_PD = jax.lax.with_sharding_constraint(jnp.zeros((rows, g_BLD.shape[-1]), g_BLD.dtype), whole)
        return d_PD.at[positions_BL].add(g_BLD), zero
    mesh, positions_spec, g_spec, at_rest, split, rest = reduction

    # The device's tokens are summed into its rows in float32. XLA:CPU aborts compiling a
    # bfloat16 reduce-scatter here ("Invalid binary instruction opcode copy") and widens bfloat16
    # collectives to float32 anyway, so there they reduce in float32 (the same bytes).
    wire = jnp.float32 if jax.default_backend() == "cpu" else g_BLD.dtype

    def local(positions_BL, g_BLD):  # this device's tokens scattered, then reduced in two stages
        d_PD = jnp.zeros((rows, g_BLD.shape[-1]), jnp.float32).at[positions_BL].add(g_BLD.astype(jnp.float32))
        d_PD = jax.lax.psum_scatter(d_PD.astype(wire), split, scatter_dimension=1, tiled=True)
        return (jax.lax.psum(d_PD, rest) if rest else d_PD).astype(g_BLD.dtype)

    manual = frozenset(spec_axes(g_spec))
    return jax.shard_map(local, mesh=mesh, in_specs=(positions_spec, g_spec), out_specs=at_rest,
                         axis_names=manual)(positions_BL, g_BLD), zero


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)
