"""Expert parallelism: each device holds E / n of an MoE layer's experts (``expert`` axis of
size n) and the tokens go to their experts' devices and back: under a capacity with two
all-to-alls (:func:`run_experts`), dropless by gathering the tokens and scattering the
outputs back (:func:`run_dropless`, Megatron's all-gather dispatcher).

Under a capacity, the dispatch buffers ``[B, E, C, D]`` (each sequence's C slots per expert, built where the
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

Dropless, the rows each device's experts get are known only at run time, so no all-to-all
of fixed size can carry them without a capacity. ``jax.lax.ragged_all_to_all`` could (with
buffers of the largest size), but XLA:CPU does not run it ("HLO opcode ragged-all-to-all is
not supported by XLA:CPU ThunkEmitter", jaxlib 0.10.2), and a path only GPUs run would go
untested here; the all-gather dispatcher runs everywhere. Its cost against an all-to-all:
a device receives every token of its ``expert`` group (n T D), not the k T D of its own
experts' choices, and its buffers hold n min(k, E / n) T rows (a token's k choices are
different experts) where about k T are filled -- though only those are computed.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxshard.axes import Dim
from jaxshard.parallel import grouped
from jaxshard.rules import GATHERED, active, entry_axes


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
    split over the ``expert`` axis as above (on one device simply ``fn``; on a mesh without
    that axis the same region without the exchange). There the weights come in their at-rest layout and are gathered here over their
    ZeRO-3/FSDP axes (so the gradients' transpose is a reduce-scatter into it), as
    :func:`jaxshard.rules.for_compute` does elsewhere; under ``tensor`` each device runs its
    column and row split of every expert's MLP (Megatron's, by hand: ``reduce`` sums the
    partial outputs over ``tensor``, and the input's gradient is summed over it once)."""
    experts = expert_axes()
    rules = active()
    if rules is None:
        return fn(buf_BECD, *weights, reduce=lambda y: y)
    # (Without an expert axis the same region, with no exchange: left to the partitioner,
    # the experts' batched matmuls ran 2x the slots' FLOPs on data=8.)
    n = rules.size(experts)
    tensor = rules.param_mesh_axes(Dim.MLP)
    # The batch's axes (expert among them: each device's rows as they lie) and tensor. (With
    # tensor left to the partitioner, it gathered the weights' tensor split inside.)
    manual = frozenset(rules.batch_axes) | frozenset(tensor)
    at_rest = [rules.param_spec(ax, tuple(w.shape)) for ax, w in zip(axes, weights)]
    compute = [rules.compute_param_spec(ax, tuple(w.shape)) for ax, w in zip(axes, weights)]

    def exchange(x):  # [b, n, E/n, C, D]: block j of dim 1 to device j; back again the same way
        return jax.lax.all_to_all(x, experts, 1, 1, tiled=True)

    def local(buf, *ws):
        ws = [_gather(w, r, u) for w, r, u in zip(ws, at_rest, compute)]
        b, E, C, D = buf.shape
        mine = buf.reshape(b, n, E // n, C, D)  # [b, n (source), E/n (mine), C, D]
        if n > 1:
            mine = checkpoint_name(exchange(mine), EXCHANGED)
        if tensor:  # one all-reduce of the projections' summed input gradients (backward)
            mine = _wide(lambda x: jax.lax.pcast(x, tuple(tensor), to="varying"), mine)
        out = fn(mine, *ws, reduce=lambda y: _wide(lambda x: jax.lax.psum(x, tuple(tensor)), y) if tensor else y)
        if n > 1:
            out = checkpoint_name(exchange(out), EXCHANGED)
        return out.reshape(b, E, C, out.shape[-1])

    rows = P(tuple(rules.batch_axes))
    return jax.shard_map(local, mesh=rules.context_mesh, in_specs=(rows, *_only(manual, at_rest)),
                         out_specs=rows, axis_names=manual)(buf_BECD, *weights)


def run_dropless(fn: Callable[..., tuple[jax.Array, jax.Array]], x_BLD: jax.Array, experts_BLK: jax.Array,
                 gates_BLK: jax.Array, n_experts: int, weights: Sequence[jax.Array],
                 axes: Sequence[tuple]) -> tuple[jax.Array, jax.Array]:
    """(``[B, L, D]`` each token's gated sum of its k experts' outputs, the expert rows
    computed per routed choice): dropless, only the routed tokens computed -- Megatron's
    all-gather dispatcher. ``fn(x, token, gate, group, sizes, *weights, tile=, lead=)`` runs
    the experts (:func:`jaxshard.parallel.grouped.experts`) on the rows of the tokens ``x``
    that ``token`` names, sorted by expert (``sizes`` per expert; ``group`` each row's expert,
    clipped; ``gate`` 0 past the sizes' sum), adding its output biases times ``lead`` (1 on
    one ``tensor`` device, 0 on the others), and returns the tokens' gated sums (partial over
    ``tensor``: summed here) and the rows computed.

    Each device routes its own rows (a ``shard_map`` manual over the batch axes and
    ``tensor``, the weights gathered inside over their ZeRO-3/FSDP axes as
    :func:`run_experts` does). With the experts split over ``expert`` (n devices, E / n
    experts each), the tokens and their choices are all-gathered over it, each device runs
    the choices of its own experts, and the tokens' outputs are reduce-scattered back (the
    reduce sums each token's experts on other devices); backward, the gather and the scatter
    transpose into each other. The rows a device can receive are at most min(k, E / n) per
    token of all n devices (a token's k choices are different experts), so its buffers are
    that large (they must have a static shape), while the grouped matmul computes only the
    rows it got."""
    rules = active()
    k = experts_BLK.shape[-1]
    experts = expert_axes()
    if rules is None:
        return _dispatch_gathered(fn, x_BLD, experts_BLK, gates_BLK, n_experts, 1, (), (), k, *weights)
    n = rules.size(experts)
    tensor = tuple(rules.param_mesh_axes(Dim.MLP))
    batch = tuple(rules.batch_axes)
    manual = frozenset(batch) | frozenset(tensor)
    at_rest = [rules.param_spec(ax, tuple(w.shape)) for ax, w in zip(axes, weights)]
    compute = [rules.compute_param_spec(ax, tuple(w.shape)) for ax, w in zip(axes, weights)]

    def local(x, e, g, *ws):
        ws = [_gather(w, r, u) for w, r, u in zip(ws, at_rest, compute)]
        y, computed = _dispatch_gathered(fn, x, e, g, n_experts, n, experts, tensor, k, *ws)
        return y, jax.lax.psum(computed, batch) if batch else computed

    rows = P(batch)
    y, computed = jax.shard_map(local, mesh=rules.context_mesh, in_specs=(rows, rows, rows, *_only(manual, at_rest)),
                                out_specs=(rows, P()), axis_names=manual)(x_BLD, experts_BLK, gates_BLK, *weights)
    return y, computed / experts_BLK.size


def _dispatch_gathered(fn, x_bLD, experts_bLK, gates_bLK, E, n, experts, tensor, k, *ws):
    """One device's part of :func:`run_dropless`: its ``b`` rows in, their outputs and the
    expert rows it computed out."""
    b, L, D = x_bLD.shape
    T = b * L
    x_TD = x_bLD.reshape(T, D)
    if tensor:  # the rows' gradient summed over tensor once, on the device's own tokens
        x_TD = _wide(lambda v: jax.lax.pcast(v, tensor, to="varying"), x_TD)
    ids_TK, gates_TK = experts_bLK.reshape(T, k), gates_bLK.reshape(T, k)
    mine = E // n
    if n > 1:  # every device's tokens and choices: [n T, ...], in as few gathers as the dtypes allow
        x_TD, ids_TK, gates_TK = _gathered(x_TD, ids_TK, gates_TK, experts)
        ids_TK = ids_TK - jax.lax.axis_index(experts) * mine
    key = jnp.where((ids_TK >= 0) & (ids_TK < mine), ids_TK, mine).reshape(-1)  # other devices' experts last
    # A token's k choices are k different experts, so at most min(k, E / n) of them are this
    # device's: its rows are the first that many per token of the sorted order, the rest others'.
    order = _sorted_by(key, mine + 1)[:x_TD.shape[0] * min(k, mine)]
    group = key[order]
    sizes = jnp.bincount(key, length=mine + 1)[:mine].astype(jnp.int32)
    lead = (jax.lax.axis_index(tensor) == 0).astype(x_TD.dtype) if tensor else jnp.ones((), x_TD.dtype)
    gate = jnp.where(group < mine, gates_TK.reshape(-1)[order], 0)
    out_TD, computed = fn(x_TD, order // k, gate, jnp.minimum(group, mine - 1), sizes, *ws,
                          tile=grouped.tile_rows(x_TD.shape[0] * k / E), lead=lead)
    if n > 1:  # each token's outputs from every device's experts, summed where the token lies
        out_TD = checkpoint_name(_wide(lambda v: jax.lax.psum_scatter(v, experts, tiled=True), out_TD), EXCHANGED)
    if tensor:
        out_TD = _wide(lambda v: jax.lax.psum(v, tensor), out_TD)
    return out_TD.reshape(b, L, D), computed.astype(jnp.float32)


def _sorted_by(key: jax.Array, n: int) -> jax.Array:
    """The stable order of ``key`` (ints below ``n``): a counting sort where ``n`` is small (a
    cumulative sum over a ``[len, n]`` one-hot; XLA:CPU's sort calls a comparator function
    per comparison), else ``argsort``."""
    if n > 32:
        return jnp.argsort(key, stable=True)
    onehot = (key[:, None] == jnp.arange(n)[None, :]).astype(jnp.int32)
    before = jnp.cumsum(onehot, axis=0) - onehot  # same-key rows before each row
    counts = jnp.sum(onehot, axis=0)
    place = jnp.sum((before + (jnp.cumsum(counts) - counts)[None, :]) * onehot, axis=1)
    return jnp.zeros_like(key).at[place].set(jnp.arange(key.shape[0], dtype=key.dtype), unique_indices=True)


def _gathered(x_TD, ids_TK, gates_TK, axes):
    """The tokens, their choices and gates, all-gathered over ``axes``: in one float32 gather
    where the tokens travel in float32 (always on CPU, see :func:`_wide`; the choices as
    floats, exact below 2^24), else the tokens in their dtype and the choices and gates in a
    second. Backward, one reduce-scatter (two) of their gradients."""
    k = ids_TK.shape[-1]
    choices = jnp.concatenate([ids_TK.astype(jnp.float32), gates_TK.astype(jnp.float32)], axis=-1)

    def gather(v):
        return checkpoint_name(jax.lax.all_gather(v, axes, tiled=True), EXCHANGED)

    if x_TD.dtype == jnp.float32 or jax.default_backend() == "cpu":
        packed = gather(jnp.concatenate([x_TD.astype(jnp.float32), choices], axis=-1))
        x, choices = packed[:, :-2 * k].astype(x_TD.dtype), packed[:, -2 * k:]
    else:
        x, choices = gather(x_TD), gather(choices)
    return x, jax.lax.stop_gradient(choices[:, :k]).astype(ids_TK.dtype), choices[:, k:].astype(gates_TK.dtype)


# XLA:CPU aborts promoting a bf16 all-reduce or reduce-scatter made in a shard_map (the
# reduction region Shardy leaves has a copy at its root, which its AllReducePromotion cannot
# rebuild). It runs 2-byte collectives in float32 anyway, so on CPU the gathers (whose
# transpose is a reduce-scatter) and the sums are made in float32; elsewhere as is.
def _wide(collective, x):
    if jax.default_backend() != "cpu" or x.dtype == jnp.float32:
        return collective(x)
    return collective(x.astype(jnp.float32)).astype(x.dtype)


def _gather(w, rest, used):
    """``w`` at rest (spec ``rest``) gathered over the axes its compute spec ``used`` drops."""
    for dim, (r, u) in enumerate(zip(rest, used)):
        extra = tuple(a for a in entry_axes(r) if a not in entry_axes(u))
        if extra:
            w = _gathered_weight(w, extra, dim)
    return w


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gathered_weight(w, axes, dim):
    """An expert weight gathered over ``axes`` along ``dim`` (ZeRO-3/FSDP), named inside a
    custom_vjp as ``rules._gather`` names the dense layers' (``remat.is_gathered``): so that
    with reshard-after-forward no policy keeps it for the backward pass, which gathers it
    again. (Named outside, the all-gather's own output stayed saveable: under ``none`` and
    ``selective`` every layer's gathered experts were kept, 22.5 GB a device for Mixtral on
    ``fsdp=8,expert=8``.) Backward, the reduce-scatter of the gradient."""
    return checkpoint_name(_wide(lambda x: jax.lax.all_gather(x, axes, axis=dim, tiled=True), w), GATHERED)


def _gathered_weight_bwd(axes, dim, _, g):
    return (_wide(lambda x: jax.lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True), g),)


_gathered_weight.defvjp(lambda w, axes, dim: (_gathered_weight(w, axes, dim), None), _gathered_weight_bwd)


def _only(manual: frozenset, specs: Sequence[P]) -> list[P]:
    """``specs`` keeping only the ``manual`` axes (the rest left to the partitioner)."""
    return [P(*(tuple(a for a in entry_axes(e) if a in manual) or None for e in spec)) for spec in specs]

