"""Mixture-of-experts feed-forward: a router picks k of E expert MLPs per token.

* **Router** in float32: logits ``x W_r``, softmax probabilities, the top k. k = 1 is the hard
  (Switch) gate and scales the expert's output by its probability; k >= 2 is the sparse gate
  and renormalises the k probabilities to sum to 1 (Mixtral).
* **Capacity** (``capacity_factor`` c > 0): within each token group -- one sequence, so the
  groups and what drops never depend on the mesh -- each expert takes at most
  C = ceil(c k S / E) of the group's S tokens' k choices, in GShard's priority: every token's
  first choice before any second choice, earlier tokens first. A choice past capacity is
  dropped: the token's residual passes through for it. ``dropped`` is the fraction of the k S
  choices dropped.
* **Dropless** (c = 0): every choice is computed, and only those. The (token, choice) pairs
  are sorted by expert and each expert's rows multiplied by its weights with a grouped matmul
  (``jaxshard.parallel.grouped``); with the experts split over devices, by Megatron's
  all-gather dispatcher (``jaxshard.parallel.experts.run_dropless``).
* **Auxiliary losses** (Switch / GShard form): load balancing E sum_e f_e P_e, f_e the fraction
  of the k S choices routed to e (before dropping) and P_e the mean router probability of e, 1
  at perfect balance; router z-loss mean(logsumexp(logits)^2). Both are means over all the
  step's tokens, so they too are the same on any mesh.
* **Auxiliary-loss-free balancing** (DeepSeek-V3, Wang et al. 2024; ``moe_balance`` bias or
  both): a per-expert bias b is added to the router probabilities for choosing the top k only
  (the gates stay the unbiased probabilities), and after each step b_e moves by gamma sign(1/E -
  f_e): up for an expert under the mean load, down for one over it. The step's loads reach the
  optimizer as the bias's gradient: the layer adds sum_e (b_e - stop_gradient(b_e))
  stop_gradient(f_e - 1/E) to its max-violation statistic, a term worth exactly 0 whose
  gradient is f_e - 1/E, so accumulation, data-parallel reduction and pipelines sum the loads as
  they sum any gradient; ``training.optim`` turns it into the signed step, outside Adam, the
  clipping norm and weight decay. ``moe_max_violation`` (DeepSeek's MaxVio, E max_e f_e - 1: 0
  at perfect balance) is logged either way.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxshard.axes import Dim
from jaxshard.parallel import grouped
from jaxshard.parallel.experts import batch_mean, run_dropless, run_experts
from jaxshard.rules import constrain
from jaxshard.remat import elementwise
from models.config import Mlp
from models.layers import FeedForward, _const, _gelu, _param, _swiglu


@dataclass(frozen=True)
class Routing:
    """One MoE layer's routing of ``[G, S]`` tokens (G groups of S) to their k choices."""

    experts: jax.Array  # [G, S, k] int32: the chosen experts, best first
    gates: jax.Array  # [G, S, k] float32: what each choice's output is scaled by
    position: jax.Array  # [G, S, k] int32: the choice's place in its expert's queue of the group
    kept: jax.Array  # [G, S, k] bool: within capacity (all true when dropless)
    load_balance: jax.Array  # scalar: E sum_e f_e P_e
    z_loss: jax.Array  # scalar: mean logsumexp(logits)^2
    dropped: jax.Array  # scalar: fraction of choices dropped
    max_violation: jax.Array  # scalar: E max_e f_e - 1 (with a bias, plus its zero-valued load term)
    computed: jax.Array | None = None  # scalar: expert rows computed per choice (set by the layer)

    @property
    def stats(self) -> tuple[jax.Array, ...]:
        """The routing's statistics in :data:`jaxshard.model.MOE_METRICS`' order: what the
        layer scan carries out."""
        return self.load_balance, self.z_loss, self.dropped, self.computed, self.max_violation


def _top_k(p: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k`` over the last dim (ties to the lower index, as it does) as k argmaxes:
    reductions, which the partitioner keeps on each device's tokens (it gathers a sharded
    ``top_k``'s operand whole)."""
    values, indices = [], []
    for _ in range(k):
        i = jnp.argmax(p, axis=-1)
        values.append(jnp.take_along_axis(p, i[..., None], axis=-1)[..., 0])
        indices.append(i.astype(jnp.int32))
        # (-inf, not a probability's floor: a routing bias may take every score below -1)
        p = jnp.where(jax.nn.one_hot(i, p.shape[-1], dtype=bool), -jnp.inf, p)
    return jnp.stack(values, axis=-1), jnp.stack(indices, axis=-1)


def route(logits_GSE: jax.Array, k: int, capacity_per_group: int, bias_E: jax.Array | None = None) -> Routing:
    """Route ``logits_GSE`` (float32 router logits) to the top ``k`` experts, keeping at most
    ``capacity_per_group`` choices per expert per group (0: keep all). ``bias_E``: DeepSeek-V3's
    balancing bias, added to the probabilities to choose the experts, not to the gates."""
    G, S, E = logits_GSE.shape
    logits_GSE = logits_GSE.astype(jnp.float32)
    probs_GSE = jax.nn.softmax(logits_GSE, axis=-1)
    if bias_E is None:
        top_p, experts = _top_k(probs_GSE, k)
    else:
        bias_E = bias_E.astype(jnp.float32)
        _, experts = _top_k(probs_GSE + jax.lax.stop_gradient(bias_E), k)
        top_p = jnp.take_along_axis(probs_GSE, experts, axis=-1)
    gates = top_p if k == 1 else top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    # Queue places in GShard's priority: choice-major, then token order.
    chosen_GKSE = jax.nn.one_hot(experts.swapaxes(1, 2), E, dtype=jnp.int32)
    flat = chosen_GKSE.reshape(G, k * S, E)
    place = jnp.sum((jnp.cumsum(flat, axis=1) - 1) * flat, axis=-1)
    position = place.reshape(G, k, S).swapaxes(1, 2)
    kept = position < capacity_per_group if capacity_per_group else jnp.ones(position.shape, bool)
    f_E = batch_mean(chosen_GKSE.astype(jnp.float32), axis=(0, 1, 2))  # sums to 1 over e
    p_E = batch_mean(probs_GSE, axis=(0, 1))
    z = batch_mean(jax.nn.logsumexp(logits_GSE, axis=-1) ** 2)
    max_violation = E * jnp.max(f_E) - 1.0
    if bias_E is not None:  # worth 0; its gradient, the bias's update direction: f_e - 1/E
        max_violation = max_violation + jnp.sum((bias_E - jax.lax.stop_gradient(bias_E)) * (f_E - 1.0 / E))
    return Routing(experts=experts, gates=gates, position=position, kept=kept,
                   load_balance=E * jnp.sum(f_E * p_E), z_loss=z,
                   dropped=1.0 - batch_mean(kept.astype(jnp.float32)), max_violation=max_violation)


def dispatch_capacity(x_GSD: jax.Array, r: Routing, n_experts: int, cap: int) -> tuple[jax.Array, jax.Array]:
    """(``[G, E, C, D]`` the experts' input buffers, ``[G, S, k]`` each choice's slot in the
    flattened ``E C`` buffer, or ``E C`` -- a zero row -- when dropped). Per group (a ``vmap``:
    the scatter's batch dim lets the partitioner keep each group where it lies)."""
    G, S, D = x_GSD.shape
    slot = jnp.where(r.kept, r.experts * cap + r.position, n_experts * cap)

    def one(x_SD, slot_SK):
        rows = jnp.broadcast_to(x_SD[:, None, :], (*slot_SK.shape, D))
        return jnp.zeros((n_experts * cap + 1, D), x_SD.dtype).at[slot_SK].add(rows)[:-1]

    return jax.vmap(one)(x_GSD, slot).reshape(G, n_experts, cap, D), slot


def combine_capacity(y_GECD: jax.Array, slot: jax.Array, r: Routing) -> jax.Array:
    """Each token's output: its kept choices' expert outputs, scaled by their gates and summed
    (a dropped choice's slot is the zero row). Per group, as :func:`dispatch_capacity`."""
    G, E, C, D = y_GECD.shape

    def one(y_ECD, slot_SK, gates_SK):
        flat = jnp.concatenate([y_ECD.reshape(E * C, D), jnp.zeros((1, D), y_ECD.dtype)])
        return jnp.einsum("skd,sk->sd", flat[slot_SK], gates_SK.astype(y_ECD.dtype))

    return jax.vmap(one)(y_GECD, slot, r.gates)


def _swiglu_act(up: jax.Array, gate: jax.Array) -> jax.Array:
    return _swiglu(gate, up)


def _gelu_act(up: jax.Array, _: None) -> jax.Array:
    return _gelu(up)


class MoEFeedForward(nnx.Module):
    """E expert MLPs of the family's kind (GELU with biases, or SwiGLU), hidden size
    ``moe_d_mlp`` (default ``d_mlp``), a float32 router, and optionally shared experts that
    every token passes through (DeepSeek). ``__call__`` returns the output and the routing's
    losses and dropped fraction."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        E, D, F = cfg.moe_experts, cfg.d_model, cfg.moe_d_mlp or cfg.d_mlp
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.cfg, self.n_experts, self.k = cfg, E, cfg.moe_top_k
        self.swiglu, self.use_bias = cfg.mlp is Mlp.SWIGLU, cfg.use_bias
        self.router = _param(rngs, (D, E), (Dim.EMBED, None), std)
        if cfg.moe_router_bias:  # DeepSeek-V3's balancing bias: moved by the optimizer, not the gradient
            self.router_bias = _const(0.0, (E,), (None,))
        axes = self.weight_axes
        self.w_in = _param(rngs, (E, D, F), axes["w_in"], std)
        if self.swiglu:
            self.w_gate = _param(rngs, (E, D, F), axes["w_gate"], std)
        self.w_out = _param(rngs, (E, F, D), axes["w_out"], out_std)
        if self.use_bias:
            self.b_in = _const(0.0, (E, F), axes["b_in"])
            self.b_out = _const(0.0, (E, D), axes["b_out"])
        # Shared experts: one MLP as wide as all of them (their hidden units are independent).
        self.shared = FeedForward(cfg, rngs, cfg.moe_shared_experts * F) if cfg.moe_shared_experts else None

    weight_axes = {"w_in": (Dim.EXPERTS, Dim.EMBED, Dim.MLP), "w_gate": (Dim.EXPERTS, Dim.EMBED, Dim.MLP),
                   "w_out": (Dim.EXPERTS, Dim.MLP, Dim.EMBED), "b_in": (Dim.EXPERTS, Dim.MLP),
                   "b_out": (Dim.EXPERTS, Dim.EMBED)}

    def _weights(self) -> dict[str, jax.Array]:
        names = ["w_in", "w_out"] + (["w_gate"] if self.swiglu else []) + (["b_in", "b_out"] if self.use_bias else [])
        return {n: getattr(self, n)[...] for n in names}

    def _hidden(self, h_in: jax.Array, gate: Callable[[], jax.Array], b_in: jax.Array | None) -> jax.Array:
        """The expert MLP's activation of its up projection ``h_in`` (SwiGLU: times SiLU of the
        gate projection, made by ``gate``), after the up bias ``b_in`` (broadcast already)."""
        if b_in is not None:
            h_in = h_in + b_in
        # Recomputed from its inputs in the backward pass, as the dense MLP's.
        return elementwise(_swiglu)(gate(), h_in) if self.swiglu else elementwise(_gelu)(h_in)

    def _experts(self, names: tuple[str, ...]):
        """Every expert on its slots: ``[..., E, C, D]`` and the named weights (experts dim
        first) to ``[..., E, C, D]``; ``reduce`` as ``parallel.experts.run_experts`` says."""

        def fn(buf, *weights, reduce):
            w = dict(zip(names, weights))
            hidden = (None,) * (buf.ndim - 1) + (Dim.ACT_MLP,)  # split over tensor, as the dense MLP's
            h = self._hidden(constrain(jnp.einsum("...ecd,edf->...ecf", buf, w["w_in"]), hidden),
                             lambda: constrain(jnp.einsum("...ecd,edf->...ecf", buf, w["w_gate"]), hidden),
                             w["b_in"][:, None, :] if "b_in" in w else None)
            y = reduce(constrain(jnp.einsum("...ecf,efd->...ecd", h, w["w_out"]), (None,) * buf.ndim))
            return y + w["b_out"][:, None, :] if "b_out" in w else y

        return fn

    def _ragged(self, names: tuple[str, ...]):
        """The experts on the routed rows (``parallel.experts.run_dropless``), by
        ``parallel.grouped.experts``."""
        act = _swiglu_act if self.swiglu else _gelu_act

        def fn(x_TD, token, gate, group, sizes, *weights, tile, lead):
            return grouped.experts(x_TD, token, gate, group, sizes, dict(zip(names, weights)), act,
                                   lead=lead, tile=tile)

        return fn

    def __call__(self, x_BLD: jax.Array) -> tuple[jax.Array, Routing]:
        B, L, D = x_BLD.shape
        logits = jnp.einsum("bld,de->ble", x_BLD.astype(jnp.float32), self.router[...].astype(jnp.float32))
        cap = self.cfg.moe_capacity(L)
        r = route(logits, self.k, cap, self.router_bias[...] if self.cfg.moe_router_bias else None)
        weights = self._weights()
        if cap:
            buf_BECD, slot = dispatch_capacity(x_BLD, r, self.n_experts, cap)
            buf_BECD = constrain(buf_BECD, (Dim.BATCH, None, None, None))
            y_BECD = run_experts(self._experts(tuple(weights)), buf_BECD, list(weights.values()),
                                 [self.weight_axes[n] for n in weights])
            y_BECD = constrain(y_BECD, (Dim.BATCH, None, None, None))
            y_BLD = combine_capacity(y_BECD, slot, r)
            computed = jnp.float32(self.n_experts * cap / (self.k * L))
        else:
            with grouped.kernel(self.cfg.moe_kernel):
                y_BLD, computed = run_dropless(self._ragged(tuple(weights)), x_BLD, r.experts, r.gates,
                                               self.n_experts, list(weights.values()),
                                               [self.weight_axes[n] for n in weights])
        r = dataclasses.replace(r, computed=computed)
        if self.shared is not None:
            y_BLD = y_BLD + self.shared(x_BLD)
        return y_BLD, r
