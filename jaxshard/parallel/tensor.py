"""The column-parallel projections of one sublayer's input, with one input-gradient reduction.

A sublayer's input ``x`` feeds several column-parallel projections (q, k and v; SwiGLU's gate
and up). In the backward pass each projection's input gradient is a partial sum over
``tensor``; Megatron sums them on the device and reduces once (its ``f`` operator: an
all-reduce, or under sequence parallelism a reduce-scatter). Left to the partitioner, each
projection's partial gradient is reduced separately -- 3x (attention) or 2x (SwiGLU) the bytes.

Here the projections run in a ``shard_map`` manual over the tensor axes (the batch axes stay
with the partitioner, which reduces the weights' gradients into their ZeRO/FSDP layout as
before): ``x`` is marked varying over ``tensor`` once, so its transpose is the one all-reduce of
the summed gradients; weights come in their column split. A weight that ``tensor`` does not
split (grouped-query kv heads fewer than ``tensor``) is applied to the replicated ``x``.

Under sequence parallelism ``x`` is all-gathered before the region; backward, the region's
all-reduce and the slice back into the sequence split compile to one reduce-scatter. Where the
remat policy keeps activations, ``x`` is kept in its sequence split and gathered again in the
backward pass for the weights' gradients (Korthikanti et al. 2022, Sec. 4.2.2), not kept
gathered (t times the bytes): the region's forward products are dead there. Not yet
under context parallelism, nor under SP with kv heads that ``tensor`` does not split: those
keep the partitioner's per-projection reductions.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxshard import remat
from jaxshard.axes import INPUT_BLD, RESIDUAL_BLD, Dim
from jaxshard.rules import active, constrain, relayout


def gather_sequence(x_BLD: jax.Array) -> jax.Array:
    """A sublayer's input from the residual stream's layout: under sequence parallelism the
    sequence is all-gathered here (Megatron-SP's g), and backward its gradient reduce-scattered
    back; otherwise nothing moves."""
    return relayout(x_BLD, RESIDUAL_BLD, INPUT_BLD)


def column_parallel(x_BLD: jax.Array, weights: Sequence[jax.Array], specs: Sequence[tuple],
                    fn: Callable[..., jax.Array], out_axes: Sequence[tuple],
                    extras: Sequence[jax.Array] | None = None) -> list[jax.Array]:
    """``[fn(x, w, columns, extra) for w in weights]`` for a sublayer input ``x`` in the
    residual stream's layout. ``specs``: each weight's logical dims; ``out_axes``: each output's
    logical dims (a dim the tensor axes split is split in the output too). ``columns``: the
    mesh axes ``fn`` runs manual over, which split ``w``'s output columns (``()`` under the
    partitioner): a float8 projection takes its amaxes' maximum over them. ``extras``: one
    replicated array per weight that ``fn`` takes too (a delayed float8 layer's state), else
    None."""
    extras = list(extras) if extras is not None else [None] * len(weights)
    rules = active()
    if rules is None:
        return [fn(x_BLD, w, (), e) for w, e in zip(weights, extras)]
    tensor = rules.activation_mesh_axes(Dim.ACT_HEADS)
    sp = bool(set(tensor) & set(rules.activation_mesh_axes(Dim.RESIDUAL_LENGTH)))
    if not (sp and remat.keeps_activations()):
        return _projections(rules, tensor, sp, x_BLD, weights, specs, fn, out_axes, extras)

    def kept(x, ws, es):
        # Pinned to the sequence split on both sides of the forward/backward boundary (or the
        # partitioner may keep the gathered layout after all).
        return _projections(rules, tensor, sp, constrain(x, RESIDUAL_BLD), ws, specs, fn, out_axes, es)

    return remat.from_inputs(kept)(constrain(x_BLD, RESIDUAL_BLD), list(weights), extras)


def _projections(rules, tensor, sp: bool, x_BLD: jax.Array, weights: Sequence[jax.Array],
                 specs: Sequence[tuple], fn: Callable, out_axes: Sequence[tuple],
                 extras: Sequence[jax.Array | None]) -> list[jax.Array]:
    x_BLD = gather_sequence(x_BLD)
    # A weight's compute spec holds the model-parallel (tensor) axes only.
    w_specs = [rules.compute_param_spec(ax, tuple(w.shape)) for ax, w in zip(specs, weights)]
    split = [any(e is not None for e in s) for s in w_specs]
    if not tensor or rules.activation_mesh_axes(Dim.LENGTH) or (sp and not all(split)):
        # No tensor parallelism; or context parallelism too; or under SP a weight tensor does
        # not split (kv heads fewer than tensor), whose input gradient the partitioner then
        # reduces better alone: the partitioner's way.
        return [fn(x_BLD, w, (), e) for w, e in zip(weights, extras)]
    manual = frozenset(tensor)  # the batch axes stay with the partitioner

    def only_tensor(spec: P) -> P:
        return P(*(e if e is not None and set((e,) if isinstance(e, str) else e) <= manual else None
                   for e in spec))

    out_specs = [only_tensor(rules.activation_spec(ax)) if s else P() for ax, s in zip(out_axes, split)]
    dtype = x_BLD.dtype
    if jax.default_backend() == "cpu" and dtype != jnp.float32:
        # XLA:CPU cannot promote a 2-byte reduction inside this region (it computes them in
        # float32 anyway): on CPU the input crosses it, and its gradient is reduced, in float32.
        x_BLD = x_BLD.astype(jnp.float32)

    def local(x, ws, es):
        # Backward, the projections' input gradients are summed here and all-reduced once.
        replicated, x = x.astype(dtype), jax.lax.pcast(x, tuple(tensor), to="varying").astype(dtype)
        return [fn(x if s else replicated, w, tuple(sorted(manual)), e) for w, s, e in zip(ws, split, es)]

    e_specs = [None if e is None else P() for e in extras]
    return jax.shard_map(local, mesh=rules.context_mesh, in_specs=(P(), list(w_specs), e_specs),
                         out_specs=out_specs, axis_names=manual)(x_BLD, list(weights), extras)
