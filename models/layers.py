"""flax NNX building blocks of one transformer layer and of the embedding ends.

Every parameter carries ``logical_axes`` metadata naming its dims (see ``jaxshard.axes.Dim``).
Shape letters: B batch, L length, D d_model, N heads, K kv heads, G = N/K, H d_head,
F d_mlp, V vocab.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxshard import fp8, rows
from jaxshard.axes import RESIDUAL_BLD, Dim
from jaxshard.errors import ConfigError
from jaxshard.parallel import attention
from jaxshard.parallel.attention import causal_attention
from jaxshard.parallel.tensor import column_parallel
from jaxshard.parallel.vectors import scale, shift, take_rows, whole_rows
from jaxshard.parallel.vocab import embed_lookup, logits_dot, project
from jaxshard.remat import attention_core, elementwise, tag
from jaxshard.rules import active, constrain
from models.config import ModelConfig, Mlp, Norm, Positions, RopeScaling


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[Dim, ...], std: float) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), logical_axes=axes)


def _const(value: float, shape: tuple[int, ...], axes: tuple[Dim, ...]) -> nnx.Param:
    return nnx.Param(jnp.full(shape, value, jnp.float32), logical_axes=axes)


def _meta() -> nnx.Param:
    """A delayed float8 linear layer's amax histories and scales (:func:`jaxshard.fp8.delayed_init`):
    a param whose "gradient" is its next value, which the step stores (``training.optim``)."""
    return nnx.Param(fp8.delayed_init(), logical_axes=(None, None))


def token_einsum(spec: str, x: jax.Array, w: jax.Array, out_axes: tuple | None = None) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` for a ``spec`` whose input and output start with ``bl``, laid
    out as ``out_axes`` says (if given). Batch and length are flattened into one token dim around
    the contraction: XLA:CPU lays the weight gradient of a contraction over two token dims out as
    a strided transpose fused into the activation's backward (the SwiGLU MLP's step ran ~3x
    slower); over one token dim it needs none. Elsewhere the reshape is free. Not where the
    length is split (context parallelism; the residual stream under sequence parallelism, whose
    reduce-scatter the partitioner would turn into a reduce-scatter plus an all-to-all)."""
    rules = active()
    split = rules is not None and (rules.activation_mesh_axes(Dim.LENGTH) or out_axes is not None
                                   and rules.activation_spec(out_axes)[1] is not None)
    if split:
        y = jnp.einsum(spec, x, w)
    else:
        y = jnp.einsum(spec.replace("bl", "t"), x.reshape(-1, *x.shape[2:]), w)
        y = y.reshape(*x.shape[:2], *y.shape[1:])
    return constrain(y, out_axes) if out_axes is not None else y


def linear(spec: str, x: jax.Array, w: jax.Array, recipe: str | None, out_axes: tuple | None = None,
           tokens: bool = False, columns: tuple[str, ...] = (), meta: jax.Array | None = None) -> jax.Array:
    """A block's linear layer, ``jnp.einsum(spec, x, w)`` contracting ``w``'s leading dims
    (:func:`token_einsum` where ``tokens``); with a float8 ``recipe`` (``--fp8``) the same
    product as a float8 matmul (:func:`jaxshard.fp8.dense`), whose amaxes must be the whole
    tensors' on any mesh. Under the partitioner they are. Inside a region manual over mesh
    axes, each such axis must be one the amaxes can be maxed over: ``columns``, the tensor axes
    of a column-parallel projection (:func:`jaxshard.parallel.tensor.column_parallel`), or an
    axis that splits the tokens (a pipeline's data-parallel replicas, the explicit gradient
    reducer's ``data``); ``stage`` splits no tensor (each stage runs its own layers). Any other
    is a one-line error, and so is the delayed recipe inside any manual region but a
    column-parallel one (its state's update, a cotangent, would be summed over the pieces).
    ``meta``: the delayed recipe's state (:func:`jaxshard.fp8.delayed_dense`)."""
    if recipe is None:
        if tokens:
            return token_einsum(spec, x, w, out_axes)
        y = jnp.einsum(spec, x, w)
        return constrain(y, out_axes) if out_axes is not None else y
    context = jax.sharding.get_abstract_mesh()  # the step may run a region with no rules active
    manual = frozenset() if context.empty else frozenset(map(str, context.manual_axes))
    rules = active()
    # The axes that split the tokens: the rules say, or without them (the explicit reducer's
    # per-device program) the rows' context does.
    token_axes = rows.manual_shards() if rules is None else rules.manual_token_axes
    row_axes = tuple(a for a in token_axes if a not in columns)
    other = manual - set(columns) - set(row_axes) - set(() if rules is None else rules.manual_stack_axes)
    if other:
        raise ConfigError(f"--fp8 is not implemented inside a region manual over {', '.join(sorted(other))} "
                          "(an amax there would be a piece's, not the tensor's)")
    if recipe == "delayed" and manual - set(columns):
        raise ConfigError(f"--fp8 delayed is not implemented inside a region manual over "
                          f"{', '.join(sorted(manual - set(columns)))} (its state's update would be summed over "
                          "the pieces: microbatches or replicas)")
    xs, rest = spec.split(",")
    ws, out = rest.split("->")
    n_in = sum(c in xs and c not in out for c in ws)  # contracted: w's leading dims, x's trailing
    if recipe == "delayed":
        y = fp8.delayed_dense(x, w, meta, n_in, tuple(columns))
    else:
        y = fp8.dense(x, w, n_in, recipe, tuple(columns), row_axes)  # () and () under the partitioner
    return constrain(y, out_axes) if out_axes is not None else y


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout. The mask is the whole batch's, drawn inside the jitted step (with
    partitionable threefry the same on any mesh); on a microbatch or inside a region manual over
    batch axes, that part's rows of it (:mod:`jaxshard.rows`), so accumulating, pipelining or
    reducing by hand drops what the whole batch on one device drops."""
    if key is None or rate == 0.0:
        return x
    keep = rows.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


class NormLayer(nnx.Module):
    """LayerNorm (GPT-2, with bias) or RMSNorm (Llama); statistics in float32."""

    def __init__(self, cfg: ModelConfig):
        self.kind, self.eps = cfg.norm, cfg.norm_eps
        self.scale = _const(1.0, (cfg.d_model,), (Dim.EMBED,))
        if cfg.norm is Norm.LAYER:
            self.bias = _const(0.0, (cfg.d_model,), (Dim.EMBED,))

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        """Recomputed in the backward pass from ``x`` (:func:`jaxshard.remat.elementwise`): the
        float32 centred and normalised values are not kept."""
        weights = (self.scale[...],) + ((self.bias[...],) if self.kind is Norm.LAYER else ())
        return elementwise(self._normalize)(x_BLD, *weights)

    def _normalize(self, x_BLD: jax.Array, w_D: jax.Array, b_D: jax.Array | None = None) -> jax.Array:
        x = x_BLD.astype(jnp.float32)
        if self.kind is Norm.LAYER:
            x = x - x.mean(-1, keepdims=True)
        y = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + self.eps)
        y = scale(y, w_D.astype(jnp.float32))
        if b_D is not None:
            y = shift(y, b_D.astype(jnp.float32))
        return y.astype(x_BLD.dtype)


def rope_tables(positions_L: jax.Array, d_head: int, theta: float,
                scaling: RopeScaling | None = None) -> tuple[jax.Array, jax.Array]:
    """(sin, cos) of shape [L, H/2] for rotary embeddings ([B, L, H/2] for per-row positions
    ``[B, L]``, as decoding uses)."""
    inv_freq = theta ** (-jnp.arange(0, d_head, 2, dtype=jnp.float32) / d_head)
    if scaling is not None:
        inv_freq = _llama3_frequencies(inv_freq, scaling)
    angles = positions_L.astype(jnp.float32)[..., None] * inv_freq
    return jnp.sin(angles), jnp.cos(angles)


def _llama3_frequencies(inv_freq: jax.Array, s: RopeScaling) -> jax.Array:
    """Llama 3's scaled rotary frequencies (as Hugging Face's ``_compute_llama3_parameters``)."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = s.original_max_len / s.low_freq_factor, s.original_max_len / s.high_freq_factor
    stretched = jnp.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * stretched / s.factor + smooth * stretched
    between = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(between, blended, stretched)


def apply_rope(x_BLNH: jax.Array, sin_cos: tuple[jax.Array, jax.Array]) -> jax.Array:
    sin, cos = (t[None, :, None, :] if t.ndim == 2 else t[:, :, None, :] for t in sin_cos)
    x1, x2 = jnp.split(x_BLNH.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLNH.dtype)


# A masked-out score: exp() of it minus any row's max is 0.
_NEG = float(jnp.finfo(jnp.float32).min)
CACHE_BTKH = (Dim.BATCH, None, Dim.ACT_KV_HEADS, None)  # a layer's cached keys or values


class KVCache(NamedTuple):
    """Keys and values of the tokens seen so far, for decoding. ``k``, ``v``: ``[B, T, K, H]``
    by slot, which is the token's position (the model's cache stacks them over layers:
    ``[layers, B, T, K, H]``); ``start`` ``[B]``: each row's slot for the next tokens. Slots
    at or past a row's ``start`` may hold stale values: attention never reads them."""

    k: jax.Array
    v: jax.Array
    start: jax.Array

    def write(self, k_BLKH: jax.Array, v_BLKH: jax.Array) -> KVCache:
        """The cache with L new tokens at each row's slots ``start .. start + L - 1``."""
        put = jax.vmap(lambda c, x, s: jax.lax.dynamic_update_slice_in_dim(c, x, s, axis=0))
        return self._replace(k=constrain(put(self.k, k_BLKH, self.start), CACHE_BTKH),
                             v=constrain(put(self.v, v_BLKH, self.start), CACHE_BTKH))

    def attend(self, q_BLKGH: jax.Array) -> jax.Array:
        """Causal attention of queries at slots ``start + l`` to the cache's slots up to
        theirs; ``[B, L, K, G, H]``. Heads stay where the tensor axes put them."""
        L, H, T = q_BLKGH.shape[1], q_BLKGH.shape[-1], self.k.shape[1]
        s_BKGLT = jnp.einsum("blkgh,btkh->bkglt", q_BLKGH, self.k,
                             preferred_element_type=jnp.float32) / math.sqrt(H)
        seen_BLT = self.start[:, None, None] + jnp.arange(L)[:, None] >= jnp.arange(T)
        s_BKGLT = jnp.where(seen_BLT[:, None, None], s_BKGLT, _NEG)
        p_BKGLT = jax.nn.softmax(s_BKGLT, axis=-1).astype(self.v.dtype)
        return jnp.einsum("bkglt,btkh->blkgh", p_BKGLT, self.v)


class Attention(nnx.Module):
    """Causal multi-head attention; grouped-query when n_kv_heads < n_heads.

    No key bias even with ``use_bias``: q.b_k is the same for every key of a query, so softmax
    cancels it and its gradient is identically zero -- only rounding noise, which Adam would
    amplify into run-to-run differences.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.wq = _param(rngs, (D, N, H), (Dim.EMBED, Dim.HEADS, Dim.HEAD_DIM), std)
        self.wk = _param(rngs, (D, K, H), (Dim.EMBED, Dim.KV_HEADS, Dim.HEAD_DIM), std)
        self.wv = _param(rngs, (D, K, H), (Dim.EMBED, Dim.KV_HEADS, Dim.HEAD_DIM), std)
        self.wo = _param(rngs, (N, H, D), (Dim.HEADS, Dim.HEAD_DIM, Dim.EMBED), out_std)
        self.use_bias, self.fp8 = cfg.use_bias, cfg.fp8
        if cfg.fp8 == "delayed":
            self.wq_fp8, self.wk_fp8, self.wv_fp8, self.wo_fp8 = (_meta() for _ in range(4))
        if cfg.use_bias:
            self.bq = _const(0.0, (N, H), (Dim.HEADS, Dim.HEAD_DIM))
            self.bv = _const(0.0, (K, H), (Dim.KV_HEADS, Dim.HEAD_DIM))
            self.bo = _const(0.0, (D,), (Dim.EMBED,))

    weight_axes = [(Dim.EMBED, Dim.HEADS, Dim.HEAD_DIM), (Dim.EMBED, Dim.KV_HEADS, Dim.HEAD_DIM),
                   (Dim.EMBED, Dim.KV_HEADS, Dim.HEAD_DIM)]
    qkv_axes = [(Dim.BATCH, Dim.LENGTH, Dim.ACT_HEADS, None),
                (Dim.BATCH, Dim.LENGTH, Dim.ACT_KV_HEADS, None), (Dim.BATCH, Dim.LENGTH, Dim.ACT_KV_HEADS, None)]

    def __call__(self, x_BLD: jax.Array, rope: tuple[jax.Array, jax.Array] | None,
                 cache: KVCache | None = None):
        """``x_BLD`` in the residual stream's layout (split over ``tensor`` under SP). With
        ``cache`` (decoding), ``x``'s tokens sit at slots ``cache.start + l`` (``rope`` per row,
        ``[B, L, H/2]``): their keys and values are written there and the queries attend to the
        cache; returns (output, the updated cache)."""
        metas = [self.wq_fp8[...], self.wk_fp8[...], self.wv_fp8[...]] if self.fp8 == "delayed" else None
        q_BLNH, k_BLKH, v_BLKH = column_parallel(
            x_BLD, [self.wq[...], self.wk[...], self.wv[...]], self.weight_axes,
            lambda x, w, columns, meta: linear("bld,dnh->blnh", x, w, self.fp8, columns=columns, meta=meta),
            self.qkv_axes, metas)
        if self.use_bias:
            q_BLNH, v_BLKH = shift(q_BLNH, self.bq[...]), shift(v_BLKH, self.bv[...])
        if rope is not None:
            q_BLNH, k_BLKH = apply_rope(q_BLNH, rope), apply_rope(k_BLKH, rope)
        q_BLNH = tag(constrain(q_BLNH, (Dim.BATCH, Dim.LENGTH, Dim.ACT_HEADS, None)), "qkv")
        k_BLKH = tag(constrain(k_BLKH, (Dim.BATCH, Dim.LENGTH, Dim.ACT_KV_HEADS, None)), "qkv")
        v_BLKH = tag(constrain(v_BLKH, (Dim.BATCH, Dim.LENGTH, Dim.ACT_KV_HEADS, None)), "qkv")

        B, L, N, H = q_BLNH.shape
        K = k_BLKH.shape[2]
        q_BLKGH = q_BLNH.reshape(B, L, K, N // K, H)
        if cache is None:
            core = functools.partial(causal_attention, **attention.traced_choices())
            segments_BL = attention.current_segments(L)  # packed documents, or None
            o_BLKGH = attention_core(core)(q_BLKGH, k_BLKH, v_BLKH, *(() if segments_BL is None else (segments_BL,)))
        else:
            cache = cache.write(k_BLKH, v_BLKH)
            o_BLKGH = cache.attend(q_BLKGH)
        o_BLNH = constrain(o_BLKGH.reshape(B, L, N, H), (Dim.BATCH, Dim.LENGTH, Dim.ACT_HEADS, None))
        o_BLNH = tag(o_BLNH, "attn_out")
        # Row-parallel output: the partial sums over heads are reduced into the residual
        # layout (all-reduce, or reduce-scatter under SP) before the bias, as in Megatron.
        y_BLD = tag(linear("blnh,nhd->bld", o_BLNH, self.wo[...], self.fp8, RESIDUAL_BLD,
                           meta=self.wo_fp8[...] if self.fp8 == "delayed" else None), "attn_proj")
        y_BLD = shift(y_BLD, self.bo[...]) if self.use_bias else y_BLD
        return y_BLD if cache is None else (y_BLD, cache)


def _gelu(h: jax.Array) -> jax.Array:
    return jax.nn.gelu(h, approximate=True)


def _swiglu(g: jax.Array, u: jax.Array) -> jax.Array:
    return jax.nn.silu(g) * u


class FeedForward(nnx.Module):
    """GPT-2 MLP (up, GELU, down) or Llama SwiGLU (SiLU(gate) * up, down)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, d_mlp: int | None = None):
        """``d_mlp``: the hidden size (default the config's)."""
        D, F = cfg.d_model, d_mlp or cfg.d_mlp
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.kind, self.use_bias, self.fp8 = cfg.mlp, cfg.use_bias, cfg.fp8
        if cfg.fp8 == "delayed":
            self.w_in_fp8, self.w_out_fp8 = _meta(), _meta()
            if cfg.mlp is Mlp.SWIGLU:
                self.w_gate_fp8 = _meta()
        self.w_in = _param(rngs, (D, F), (Dim.EMBED, Dim.MLP), std)
        if cfg.mlp is Mlp.SWIGLU:
            self.w_gate = _param(rngs, (D, F), (Dim.EMBED, Dim.MLP), std)
        self.w_out = _param(rngs, (F, D), (Dim.MLP, Dim.EMBED), out_std)
        if cfg.use_bias:
            self.b_in = _const(0.0, (F,), (Dim.MLP,))
            self.b_out = _const(0.0, (D,), (Dim.EMBED,))

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        """``x_BLD`` in the residual stream's layout (split over ``tensor`` under SP)."""
        weights = [self.w_in[...]] + ([self.w_gate[...]] if self.kind is Mlp.SWIGLU else [])
        delayed = self.fp8 == "delayed"
        metas = ([self.w_in_fp8[...]] + ([self.w_gate_fp8[...]] if self.kind is Mlp.SWIGLU else [])
                 if delayed else None)
        h = column_parallel(x_BLD, weights, [(Dim.EMBED, Dim.MLP)] * len(weights),
                            lambda x, w, columns, meta: linear("bld,df->blf", x, w, self.fp8, tokens=True,
                                                               columns=columns, meta=meta),
                            [(Dim.BATCH, Dim.LENGTH, Dim.ACT_MLP)] * len(weights), metas)
        h_BLF = tag(h[0], "mlp_in")
        if self.use_bias:
            h_BLF = shift(h_BLF, self.b_in[...])
        # The activation is recomputed from its inputs in the backward pass (as Megatron's
        # fused bias-GeLU): GELU's tanh pieces and SwiGLU's products are not kept.
        if self.kind is Mlp.SWIGLU:
            g_BLF = tag(h[1], "mlp_in")
            h_BLF = elementwise(_swiglu)(g_BLF, h_BLF)
        else:
            h_BLF = elementwise(_gelu)(h_BLF)
        h_BLF = tag(constrain(h_BLF, (Dim.BATCH, Dim.LENGTH, Dim.ACT_MLP)), "mlp_hidden")
        y_BLD = linear("blf,fd->bld", h_BLF, self.w_out[...], self.fp8, RESIDUAL_BLD, tokens=True,
                       meta=self.w_out_fp8[...] if delayed else None)
        return shift(y_BLD, self.b_out[...]) if self.use_bias else y_BLD


class Block(nnx.Module):
    """One pre-norm layer: x + attn(norm(x)), then x + ffn(norm(x)); the layer scan's body.
    ``ffn``: the feed-forward's class (``models.moe.MoEFeedForward`` for an MoE layer, which
    returns its routing too: the block then returns ``(x, routing)``). With a ``cache``
    (decoding, see :class:`Attention`) it returns ``(that, the updated cache)``."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, ffn: type[nnx.Module] | None = None):
        self.dropout = cfg.dropout
        self.attn_norm = NormLayer(cfg)
        self.attn = Attention(cfg, rngs)
        self.ffn_norm = NormLayer(cfg)
        self.ffn = (ffn or FeedForward)(cfg, rngs)

    def __call__(self, x_BLD: jax.Array, rope: tuple[jax.Array, jax.Array] | None,
                 key: jax.Array | None, cache: KVCache | None = None):
        k_attn, k_ffn = jax.random.split(key) if key is not None else (None, None)
        a_BLD = self.attn(self.attn_norm(x_BLD), rope, cache)
        if cache is not None:
            a_BLD, cache = a_BLD
        x_BLD = x_BLD + dropout(a_BLD, self.dropout, k_attn)
        x_BLD = constrain(x_BLD, RESIDUAL_BLD)
        y_BLD, routing = self.ffn(self.ffn_norm(x_BLD)), None
        if isinstance(y_BLD, tuple):
            y_BLD, routing = y_BLD
        x_BLD = constrain(x_BLD + dropout(y_BLD, self.dropout, k_ffn), RESIDUAL_BLD)
        out = x_BLD if routing is None else (x_BLD, routing)
        return out if cache is None else (out, cache)


class Embedder(nnx.Module):
    """The two ends of the model: token (+ learned position) embedding in, final norm and
    vocabulary projection out (tied to the token table unless ``tie_embeddings=False``)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.tied = cfg.tie_embeddings
        self.tokens = _param(rngs, (cfg.padded_vocab, cfg.d_model), (Dim.VOCAB, Dim.EMBED), cfg.init_std)
        if cfg.positions is Positions.LEARNED:
            self.positions = _param(rngs, (cfg.max_seq_len, cfg.d_model),
                                    (Dim.POSITION, Dim.EMBED), cfg.init_std)
        self.final_norm = NormLayer(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.d_model, cfg.padded_vocab), (Dim.EMBED, Dim.VOCAB),
                                  cfg.init_std)

    def encode(self, tokens_BL: jax.Array, positions_L: jax.Array, table: jax.Array | None = None) -> jax.Array:
        """``table``: the token table to use (e.g. its ``table_copies``); default, the param.
        ``positions_L``: ``0..L-1``, or per row ``[B, L]`` (decoding; packed documents')."""
        x_BLD = embed_lookup(self.tokens[...] if table is None else table, tokens_BL)
        if hasattr(self, "positions") and positions_L.ndim == 2:
            table = self.positions[...]
            if attention.current_segments(positions_L.shape[1]) is not None:
                # Packed documents' places lie within the window: the table's first L rows, so
                # that only they have a gradient to reduce (as for 0..L-1 below), looked up
                # token by token with the gradient made where the tokens are.
                x_BLD = x_BLD + take_rows(table[: positions_L.shape[1]], positions_L)
            else:  # (decoding)
                x_BLD = x_BLD + jnp.take(table, positions_L, axis=0)
        elif hasattr(self, "positions"):
            # positions_L is 0..L-1: a slice, whose gradient is a dense pad (a scatter-add's
            # would make XLA move the activation gradient around to scatter it); in a ring's
            # balanced order, that slice's rows in the order of the tokens.
            rows = self.positions[...][: positions_L.shape[0]]
            order = attention.current_order(positions_L.shape[0])
            x_BLD = shift(x_BLD, whole_rows(rows if order is None else rows[order], self.positions.shape))
        return constrain(x_BLD, RESIDUAL_BLD)

    def decode(self, x_BLD: jax.Array, table: jax.Array | None = None) -> jax.Array:
        """Float32 logits ``[B, L, V]`` over the padded vocab; ``table`` as in :meth:`encode`."""
        x_BLD = self.final_norm(x_BLD)
        if self.tied:
            logits = project(x_BLD, self.tokens[...] if table is None else table)
        else:
            dtype = jnp.result_type(x_BLD, self.lm_head[...])
            logits = logits_dot(x_BLD.astype(dtype), self.lm_head[...].astype(dtype), (((2,), (0,)), ((), ())))
        return constrain(logits, (Dim.BATCH, Dim.LENGTH, Dim.ACT_VOCAB))
