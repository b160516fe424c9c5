"""Vocab-parallel embedding lookup and cross-entropy (Megatron's scheme).

The table ``[vocab, embed]`` and the logits ``[batch, length, vocab]`` stay sharded on vocab
over ``tensor``. Left to itself the partitioner would gather the table for the lookup's gather
and the logits for the target pick; here each shard handles the ids in its own vocab range
and only per-token values cross devices: the lookup sums ``[B, L, D]`` partial embeddings
(reduce-scatters them under sequence parallelism), the loss reduces ``[B, L]`` maxima, sums
of exponentials and target logits.

The kernels are manual over the batch and sequence axes too: left automatic, the partitioner
may gather the whole batch's embedding gradient to scatter-add it into the table, where each
device scattering its own rows and summing the (much smaller) table gradient is right.

A tied table serves both the lookup and the vocabulary projection (:func:`project`); given as
one copy per batch shard (:func:`table_copies`), its two gradient shares are summed on each
device and reduced once.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxshard.axes import Dim
from jaxshard.parallel.tensor import gather_sequence
from jaxshard.parallel.vectors import two_stage
from jaxshard.rules import StateKind, active, spec_axes

_NEG = float(jnp.finfo(jnp.float32).min)  # logit of a padding column: exp() of it is 0


def _local_range(axes: tuple[str, ...], local_size: int, ids: jax.Array):
    """``ids`` relative to this shard's vocab range, and whether they fall in it."""
    local = ids - jax.lax.axis_index(axes) * local_size
    in_range = (local >= 0) & (local < local_size)
    return jnp.where(in_range, local, 0), in_range


def table_copies(table_VD: jax.Array, tied: bool) -> jax.Array | None:
    """The token table as one copy per batch shard, ``[n, V, D]`` sharded over the batch axes,
    for :func:`embed_lookup` and (tied) :func:`project`: each region then leaves its part of
    the table gradient unreduced, and :func:`_copies_bwd` reduces the sum once, in HSDP's two
    stages where those apply. A tied table's two parts are summed on the device first --
    reducing each use's separately costs one table more per step; an untied table is given
    copies under HSDP only, where the lookup's own reduction would otherwise be one all-reduce
    over every batch axis. None (use the table itself) without batch axes, or under context
    parallelism, whose sequence split the projection's region does not handle."""
    rules = active()
    if not reduces_tied_once(rules) or not (tied or two_stage(rules)):
        return None
    batch = tuple(rules.batch_axes)
    return _copies(table_VD, _Copies(
        rules.mesh, batch, tuple(rules.sizes[a] for a in batch), _table_spec(rules),
        rules.param_spec((Dim.VOCAB, Dim.EMBED), tuple(table_VD.shape), StateKind.GRADS)))


def reduces_tied_once(rules) -> bool:
    """Whether :func:`table_copies` applies: batch axes, and no sequence split."""
    return rules is not None and bool(rules.batch_axes) and not rules.activation_mesh_axes(Dim.LENGTH)


def _table_spec(rules) -> tuple:
    axes = rules.param_mesh_axes(Dim.VOCAB)
    return (axes or None, None)


class _Copies(NamedTuple):
    """Where the copies live (static: the backward pass may run outside the rules' context)."""

    mesh: jax.sharding.Mesh
    batch: tuple[str, ...]
    sizes: tuple[int, ...]
    table: tuple  # the table's spec within a copy
    stored: P  # the table gradient's at-rest spec


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _copies(w: jax.Array, c: _Copies) -> jax.Array:
    """``[n, *w.shape]`` copies of ``w``, one per batch shard; backward, their gradients summed
    (the one reduction)."""
    return jax.lax.with_sharding_constraint(jnp.broadcast_to(w[None], (math.prod(c.sizes), *w.shape)),
                                           NamedSharding(c.mesh, P(c.batch, *c.table)))


def _copies_bwd(c: _Copies, _, g: jax.Array) -> tuple[jax.Array]:
    """The copies' gradients summed. Where the table gradient is stored split over some batch
    axes but not all (HSDP), first over those -- a reduce-scatter -- then the shard over the rest
    (an all-reduce of 1/N of the bytes), as the textbook does, not all of it over every axis."""
    first = tuple(i for i, a in enumerate(c.batch) if a in spec_axes(c.stored))
    if len(c.batch) < 2 or not first or len(first) == len(c.batch):
        return (g.sum(0),)
    g = g.reshape(*c.sizes, *g.shape[1:])
    g = jax.lax.with_sharding_constraint(g, NamedSharding(c.mesh, P(*c.batch, *c.table)))
    rest = tuple(a for i, a in enumerate(c.batch) if i not in first)
    g = jax.lax.with_sharding_constraint(g.sum(first), NamedSharding(c.mesh, P(*rest, *c.stored)))
    return (g.sum(tuple(range(len(rest)))),)


_copies.defvjp(lambda w, c: (_copies(w, c), None), _copies_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def logits_dot(a: jax.Array, b: jax.Array, dims) -> jax.Array:
    """``dot_general(a, b, dims)`` with a float32 result, whose backward pass multiplies in the
    operands' dtype: the float32 cotangent is rounded to it first. (JAX's own transpose of a dot
    with ``preferred_element_type=float32`` multiplies the float32 cotangent by the bf16
    operand in float32: the vocabulary projection's two backward matmuls ran as TF32 on an H100,
    a third of a Llama 3 8B layer-cut step. Megatron and MaxText run them in bf16 too.)"""
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _logits_dot_fwd(a, b, dims):
    return logits_dot(a, b, dims), (a, b)


def _logits_dot_bwd(dims, residuals, g):
    a, b = residuals
    g = g.astype(jnp.result_type(a, b))
    da, = jax.linear_transpose(lambda a: jax.lax.dot_general(a, b, dims), a)(g)
    db, = jax.linear_transpose(lambda b: jax.lax.dot_general(a, b, dims), b)(g)
    return da, db


logits_dot.defvjp(_logits_dot_fwd, _logits_dot_bwd)


def project(x_BLD: jax.Array, table: jax.Array) -> jax.Array:
    """Float32 logits ``x @ table.T`` over the (padded) vocab, from a tied table or its
    :func:`table_copies`; the backward pass's matmuls in the compute dtype (:func:`logits_dot`)."""
    if table.ndim == 2:
        dtype = jnp.result_type(x_BLD, table)
        return logits_dot(x_BLD.astype(dtype), table.astype(dtype), (((2,), (1,)), ((), ())))
    rules = active()
    axes = rules.param_mesh_axes(Dim.VOCAB)
    batch = (tuple(rules.batch_axes),)
    # Under sequence parallelism the sequence is gathered first (backward: the region's one
    # all-reduce and the slice back into the split make a reduce-scatter).
    x_BLD = gather_sequence(x_BLD)
    dtype = x_BLD.dtype
    if axes and jax.default_backend() == "cpu" and dtype != jnp.float32:
        # As in embed_lookup: XLA:CPU cannot promote this region's 2-byte input-gradient sum.
        x_BLD = x_BLD.astype(jnp.float32)

    def local(x, copies):
        if axes:  # backward, the input gradient is summed over the vocab shards once
            x = jax.lax.pcast(x, axes, to="varying")
        # The copy as it is (a slice of it would be one more table kept for the backward pass).
        both = jnp.result_type(dtype, copies.dtype)
        logits = logits_dot(x.astype(both), copies.astype(both), (((2,), (2,)), ((), ())))
        return logits.reshape(*logits.shape[:2], logits.shape[-1])

    return jax.shard_map(local, mesh=rules.context_mesh, in_specs=(P(*batch), P(*batch, *_table_spec(rules))),
                         out_specs=P(*batch, None, axes or None),
                         axis_names=set(rules.batch_axes) | set(axes))(x_BLD, table)


def embed_lookup(table_VD: jax.Array, tokens_BL: jax.Array) -> jax.Array:
    """``table[tokens]``; with vocab sharded, a masked local lookup and one sum over the shards.

    Also manual when only the batch is sharded: each device scatter-adds its own rows'
    gradient into its copy of the table and the copies are summed (reduce-scattered under
    ZeRO-2/3), whatever the sizes. Left to the partitioner, a small table's gradient may
    instead move the activation gradients with an all-to-all.
    """
    rules = active()
    if rules is None:
        return jnp.take(table_VD, tokens_BL, axis=0)
    axes = rules.param_mesh_axes(Dim.VOCAB)
    tokens_spec = rules.activation_spec((Dim.BATCH, Dim.LENGTH), tokens_BL.shape)
    manual = spec_axes(tokens_spec) | set(axes)
    if not manual:
        return jnp.take(table_VD, tokens_BL, axis=0)
    # Under sequence parallelism the residual stream is split along the sequence over the
    # vocab axes: reduce-scatter straight into that layout instead of all-reducing.
    scatter = bool(axes) and set(axes) <= set(rules.activation_mesh_axes(Dim.RESIDUAL_LENGTH))
    out_spec = rules.activation_spec(
        (Dim.BATCH, Dim.RESIDUAL_LENGTH if scatter else Dim.LENGTH, None), (*tokens_BL.shape, None))

    dtype = table_VD.dtype
    if jax.default_backend() == "cpu" and dtype != jnp.float32:
        # XLA:CPU cannot promote this bf16 reduction of the table gradient (AllReducePromotion
        # fails on the region Shardy leaves): on CPU the lookup runs in float32.
        table_VD = table_VD.astype(jnp.float32)

    copies = table_VD.ndim == 3  # table_copies: this shard's own copy, gradient unreduced

    def local(table_vD, tokens):
        if copies:
            table_vD = table_vD[0]
        if not axes:
            return jnp.take(table_vD, tokens, axis=0)
        ids, in_range = _local_range(axes, table_vD.shape[0], tokens)
        x = jnp.where(in_range[..., None], jnp.take(table_vD, ids, axis=0), 0)
        if scatter:
            return jax.lax.psum_scatter(x, axes, scatter_dimension=1, tiled=True)
        return jax.lax.psum(x, axes)

    table_spec = P(tuple(rules.batch_axes), axes or None, None) if copies else P(axes or None, None)
    return jax.shard_map(local, mesh=rules.context_mesh, in_specs=(table_spec, tokens_spec),
                         out_specs=out_spec, axis_names=manual)(table_VD, tokens_BL).astype(dtype)


def cross_entropy(logits_BLV: jax.Array, targets_BL: jax.Array, vocab_size: int) -> jax.Array:
    """Per-token ``-log softmax(logits)[target]``, ignoring logit columns >= ``vocab_size``
    (the padding of a vocab rounded up to a multiple)."""
    rules = active()
    axes = rules.activation_mesh_axes(Dim.ACT_VOCAB) if rules is not None else ()
    padded = logits_BLV.shape[-1]
    if not axes:
        if padded > vocab_size:
            logits_BLV = jnp.where(jnp.arange(padded) < vocab_size, logits_BLV, _NEG)
        return optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL)
    token_spec = rules.activation_spec((Dim.BATCH, Dim.LENGTH), targets_BL.shape)

    def local(logits, targets):
        v = logits.shape[-1]
        column = jax.lax.axis_index(axes) * v + jnp.arange(v)
        logits = jnp.where(column < vocab_size, logits, _NEG)
        # The max only steadies exp(); its gradient cancels, so it is not differentiated.
        m = jax.lax.pmax(jax.lax.stop_gradient(logits.max(-1)), axes)
        sum_exp = jax.lax.psum(jnp.exp(logits - m[..., None]).sum(-1), axes)
        ids, in_range = _local_range(axes, v, targets)
        picked = jnp.take_along_axis(logits, ids[..., None], -1)[..., 0]
        picked = jax.lax.psum(jnp.where(in_range, picked, 0.0), axes)
        return m + jnp.log(sum_exp) - picked

    return jax.shard_map(local, mesh=rules.context_mesh, in_specs=(P(*token_spec, axes), token_spec),
                         out_specs=token_spec, axis_names=spec_axes(token_spec) | set(axes)
                         )(logits_BLV, targets_BL)
