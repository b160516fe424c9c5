"""Causal attention, dense or as a ring over the ``sequence`` axis (context parallelism).

With the sequence sharded over ``sequence`` (size S), each device holds one chunk of C = L/S
queries, keys and values. The ring runs S steps: each device attends its queries to the kv
chunk it holds, folds the result into a running (max, sum, output) -- the online softmax of
flash attention -- and passes the kv chunk to its neighbour with ``ppermute``, so transfers
can overlap the next step's compute. Chunks wholly in a query chunk's future are masked, not
skipped: every step costs the same on every device (simple, and balanced for the SPMD
program; a zig-zag layout would avoid the waste).

Memory per device: the forward holds one query chunk, two kv chunks (the one in use and the
one arriving) and the running statistics, O(C) instead of O(L) for gathered keys/values.
Autodiff saves each step's kv chunk and probabilities for the backward pass, so the residuals
are those of dense attention divided by S: ``[B, heads, C, L]`` probabilities and ``[B, L,
kv_heads, H]`` keys/values per device. The partitioner alone would all-gather keys and values.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxshard.axes import Dim
from jaxshard.rules import active, spec_axes

_NEG = float(jnp.finfo(jnp.float32).min)


def causal_attention(q_BLKGH: jax.Array, k_BLKH: jax.Array, v_BLKH: jax.Array) -> jax.Array:
    """Softmax(q k^T / sqrt(H), causal) v for grouped queries; returns ``[B, L, K, G, H]``."""
    rules = active()
    axes = rules.activation_mesh_axes(Dim.LENGTH) if rules is not None else ()
    if not axes:
        return _dense(q_BLKGH, k_BLKH, v_BLKH)
    # Manual over the batch axes as well as the ring's; heads stay with the partitioner.
    spec = rules.activation_spec((Dim.BATCH, Dim.LENGTH), q_BLKGH.shape[:2])
    manual = spec_axes(spec)
    return jax.shard_map(lambda q, k, v: _ring(q, k, v, axes, tuple(manual)), mesh=rules.context_mesh,
                         in_specs=(spec, spec, spec), out_specs=spec,
                         axis_names=manual)(q_BLKGH, k_BLKH, v_BLKH)


def _scores(q_BLKGH, k_BMKH, q_pos, k_pos):
    s = jnp.einsum("blkgh,bmkh->bkglm", q_BLKGH, k_BMKH,
                   preferred_element_type=jnp.float32) / math.sqrt(q_BLKGH.shape[-1])
    return jnp.where(q_pos[:, None] >= k_pos[None, :], s, _NEG)


def _dense(q_BLKGH, k_BLKH, v_BLKH):
    if jax.default_backend() == "gpu":
        return fused(q_BLKGH, k_BLKH, v_BLKH)
    s_BKGLM = jnp.einsum("blkgh,bmkh->bkglm", q_BLKGH, k_BLKH,
                         preferred_element_type=jnp.float32) / math.sqrt(q_BLKGH.shape[-1])
    p_BKGLM = _causal_probabilities(s_BKGLM, v_BLKH.dtype)
    return jnp.einsum("bkglm,bmkh->blkgh", p_BKGLM, v_BLKH)


def _causal_softmax(s_BKGLM: jax.Array) -> jax.Array:
    L = s_BKGLM.shape[-1]
    return jax.nn.softmax(jnp.where(jnp.arange(L)[:, None] >= jnp.arange(L), s_BKGLM, _NEG), axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _causal_probabilities(s_BKGLM: jax.Array, dtype) -> jax.Array:
    """The causal softmax of the scores, in ``dtype``. Its backward pass needs only these
    probabilities (masked ones are 0, so is their gradient): autodiff keeps them alone, in the
    compute dtype, as Megatron's fused scale-mask-softmax does (Korthikanti et al. 2022's
    2as^2b) -- not also the float32 masked scores and probabilities."""
    return _causal_softmax(s_BKGLM).astype(dtype)


def _probabilities_fwd(s_BKGLM, dtype):
    p = _causal_softmax(s_BKGLM).astype(dtype)
    return p, p


def _probabilities_bwd(dtype, p, dp):
    p, dp = p.astype(jnp.float32), dp.astype(jnp.float32)
    return (p * (dp - (p * dp).sum(-1, keepdims=True)),)


_causal_probabilities.defvjp(_probabilities_fwd, _probabilities_bwd)


def fused(q_BLKGH: jax.Array, k_BLKH: jax.Array, v_BLKH: jax.Array,
          implementation: str | None = None) -> jax.Array:
    """Causal attention by ``jax.nn.dot_product_attention``: on GPUs its fused kernel (cuDNN
    flash attention, where dtype and shapes allow it; XLA's otherwise), the dense path's
    backend choice there. Query head ``k * G + g`` attends with kv head ``k``, as in the dense
    path."""
    B, L, K, G, H = q_BLKGH.shape
    o_BLNH = jax.nn.dot_product_attention(q_BLKGH.reshape(B, L, K * G, H), k_BLKH, v_BLKH,
                                          is_causal=True, implementation=implementation)
    return o_BLNH.reshape(B, L, K, G, H)


def _ring(q_BCKGH, k_BCKH, v_BCKH, axes, manual):
    S = math.prod(jax.lax.axis_size(a) for a in axes)
    C = q_BCKGH.shape[1]
    me = jax.lax.axis_index(axes)
    q_pos = me * C + jnp.arange(C)
    B, _, K, G, H = q_BCKGH.shape
    to_next = [(i, (i + 1) % S) for i in range(S)]

    # Step 0 is the device's own chunk, whose diagonal gives every query row a finite max,
    # so later fully-masked chunks add exp(_NEG - m) = 0.
    m_BKGC, l_BKGC, o_BKGCH = jax.tree.map(
        lambda x: jax.lax.pcast(x, manual, to="varying"),
        (jnp.full((B, K, G, C), _NEG, jnp.float32), jnp.zeros((B, K, G, C), jnp.float32),
         jnp.zeros((B, K, G, C, H), jnp.float32)))
    k, v = k_BCKH, v_BCKH
    # Unrolled in Python (S is small): XLA can overlap each transfer with the next step's math,
    # and there are S - 1 transfers by construction -- no dead last one for DCE to find, which
    # it could not under a remat policy (FSDP's reshard-after-forward).
    for i in range(S):
        if i:
            k, v = jax.lax.ppermute((k, v), axes, to_next)
        src = (me - i) % S  # the chunk this device holds at step i
        s_BKGCM = _scores(q_BCKGH, k, q_pos, src * C + jnp.arange(C))
        m_new = jnp.maximum(m_BKGC, s_BKGCM.max(-1))
        p = jnp.exp(s_BKGCM - m_new[..., None])
        scale = jnp.exp(m_BKGC - m_new)
        l_BKGC = l_BKGC * scale + p.sum(-1)
        pv = jnp.einsum("bkgcm,bmkh->bkgch", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        o_BKGCH = o_BKGCH * scale[..., None] + pv
        m_BKGC = m_new
    o_BKGCH = o_BKGCH / l_BKGC[..., None]
    return o_BKGCH.transpose(0, 3, 1, 2, 4).astype(q_BCKGH.dtype)
