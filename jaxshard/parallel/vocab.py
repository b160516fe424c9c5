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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxshard.axes import Dim
from jaxshard.rules import active, spec_axes

_NEG = float(jnp.finfo(jnp.float32).min)  # logit of a padding column: exp() of it is 0


def _local_range(axes: tuple[str, ...], local_size: int, ids: jax.Array):
    """``ids`` relative to this shard's vocab range, and whether they fall in it."""
    local = ids - jax.lax.axis_index(axes) * local_size
    in_range = (local >= 0) & (local < local_size)
    return jnp.where(in_range, local, 0), in_range


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

    def local(table_vD, tokens):
        if not axes:
            return jnp.take(table_vD, tokens, axis=0)
        ids, in_range = _local_range(axes, table_vD.shape[0], tokens)
        x = jnp.where(in_range[..., None], jnp.take(table_vD, ids, axis=0), 0)
        if scatter:
            return jax.lax.psum_scatter(x, axes, scatter_dimension=1, tiled=True)
        return jax.lax.psum(x, axes)

    return jax.shard_map(local, mesh=rules.mesh, in_specs=(P(axes or None, None), tokens_spec),
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

    return jax.shard_map(local, mesh=rules.mesh, in_specs=(P(*token_spec, axes), token_spec),
                         out_specs=token_spec, axis_names=spec_axes(token_spec) | set(axes)
                         )(logits_BLV, targets_BL)
