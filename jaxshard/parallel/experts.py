"""Expert parallelism: each device holds E / n of an MoE layer's experts (``expert`` axis of
size n) and the tokens go to their experts' devices and back with two all-to-alls.

The dispatch buffers ``[B, E, C, D]`` (each sequence's C slots per expert, built where the
sequence lies) enter a ``shard_map`` manual over the batch axes (``expert`` among them), each
device's rows as they lie, and over ``tensor``, which splits each expert's MLP by hand as
Megatron splits the dense one. (Manual over ``expert`` alone, the partitioner gathered the
buffer over the other batch axes around the all-to-all, and the weights' tensor split
inside.) The expert weights come in at
rest and are gathered inside over their ZeRO-3/FSDP axes: backward, that gather's transpose
reduce-scatters their gradients into their shards, and a weight replicated over ``data`` has
its gradient all-reduced there, as DDP does.

Inside, a device's ``[b, E, C, D]`` is split into n blocks of E / n experts; the all-to-all
sends block j to device j, which receives ``[b, n, E/n, C, D]``: the slots of its own experts
from every device's rows. The experts run on those, and a second all-to-all returns each
block to the device its rows came from. Backward, the two transpose into two more: four per
MoE layer per step, each of the buffer's bytes once (six under ``--remat full``, which
recomputes the forward pair; every other policy keeps their results). (GShard's einsum
dispatch, left to the partitioner, inserted all-gathers of the dispatch tensor instead.)
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxshard.axes import Dim
from jaxshard.rules import GATHERED, active


# The all-to-alls' results: every remat policy but ``full`` keeps them (``jaxshard.remat``), so
# the backward pass does not send them again.
EXCHANGED = "moe_exchanged"


def batch_mean(x: jax.Array, axis=None) -> jax.Array:
    """``jnp.mean(x, axis)`` over the step's tokens (``axis`` covering the batch dim): inside a
    region manual over batch axes (a pipeline's replicas) the devices' means are averaged too,
    so routing statistics are those of all the rows, as without the region."""
    mean = jax.numpy.mean(x, axis=axis)
    rules = active()
    axes = () if rules is None else tuple(a for a in rules.manual_axes if a in rules.all_batch_axes)
    return jax.lax.pmean(mean, axes) if axes else mean


def expert_axes() -> tuple[str, ...]:
    """The mesh axes splitting the experts in the step being traced (none outside one)."""
    rules = active()
    return () if rules is None else rules.param_mesh_axes(Dim.EXPERTS)


def run_experts(fn: Callable[..., jax.Array], buf_BECD: jax.Array, weights: Sequence[jax.Array],
                axes: Sequence[tuple]) -> jax.Array:
    """``fn(buf, *weights, reduce=...)`` -- every expert applied to its slots, for a buffer
    ``[..., E, C, D]`` and weights whose first dim is the experts' (logical dims ``axes``),
    calling ``reduce`` on the down projection's output before its bias -- with the experts
    split over the ``expert`` axis as above (on one device, or without that axis, simply
    ``fn``). There the weights come in their at-rest layout and are gathered here over their
    ZeRO-3/FSDP axes (so the gradients' transpose is a reduce-scatter into it), as
    :func:`jaxshard.rules.for_compute` does elsewhere; under ``tensor`` each device runs its
    column and row split of every expert's MLP (Megatron's, by hand: ``reduce`` sums the
    partial outputs over ``tensor``, and the input's gradient is summed over it once)."""
    experts = expert_axes()
    if not experts:
        return fn(buf_BECD, *weights, reduce=lambda y: y)
    rules = active()
    n = rules.size(experts)
    tensor = rules.param_mesh_axes(Dim.MLP)
    # The batch's axes (expert among them: each device's rows as they lie) and tensor. (With
    # tensor left to the partitioner, it gathered the weights' tensor split inside.)
    manual = frozenset(rules.batch_axes) | frozenset(tensor)
    at_rest = [rules.param_spec(ax, tuple(w.shape)) for ax, w in zip(axes, weights)]
    compute = [rules.compute_param_spec(ax, tuple(w.shape)) for ax, w in zip(axes, weights)]

    def exchange(x):  # [b, n, E/n, C, D]: block j of dim 1 to device j; back again the same way
        return jax.lax.all_to_all(x, experts, 1, 1, tiled=True)

    # XLA:CPU aborts promoting a bf16 all-reduce or reduce-scatter made in this shard_map (the
    # reduction region Shardy leaves has a copy at its root, which its AllReducePromotion
    # cannot rebuild). It runs 2-byte collectives in float32 anyway, so on CPU the gather (whose
    # transpose is a reduce-scatter) and tensor's sums are made in float32; elsewhere as is.
    def wide(collective, x):
        if jax.default_backend() != "cpu" or x.dtype == jnp.float32:
            return collective(x)
        return collective(x.astype(jnp.float32)).astype(x.dtype)

    def gather(w, rest, used):
        for dim, (r, u) in enumerate(zip(rest, used)):
            extra = tuple(a for a in _names(r) if a not in _names(u))
            if extra:
                w = checkpoint_name(wide(lambda x: jax.lax.all_gather(x, extra, axis=dim, tiled=True), w),
                                    GATHERED)
        return w

    def local(buf, *ws):
        ws = [gather(w, r, u) for w, r, u in zip(ws, at_rest, compute)]
        b, E, C, D = buf.shape
        mine = checkpoint_name(exchange(buf.reshape(b, n, E // n, C, D)), EXCHANGED)  # [b, n (source), E/n (mine), C, D]
        if tensor:  # one all-reduce of the projections' summed input gradients (backward)
            mine = wide(lambda x: jax.lax.pcast(x, tuple(tensor), to="varying"), mine)
        out = fn(mine, *ws, reduce=lambda y: wide(lambda x: jax.lax.psum(x, tuple(tensor)), y) if tensor else y)
        return checkpoint_name(exchange(out), EXCHANGED).reshape(b, E, C, out.shape[-1])

    def only_manual(spec: P) -> P:
        return P(*(tuple(a for a in _names(e) if a in manual) or None for e in spec))

    rows = P(tuple(rules.batch_axes))
    return jax.shard_map(local, mesh=rules.context_mesh, in_specs=(rows, *map(only_manual, at_rest)),
                         out_specs=rows, axis_names=manual)(buf_BECD, *weights)


def _names(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
