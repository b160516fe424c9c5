"""The decoder-only language model as functions of (params, inputs).

Params are a plain nested dict of arrays (easy to shard, checkpoint and hand to optax):
the :class:`~models.layers.Embedder`'s params at the top level, and ``blocks`` holding every
layer's :class:`~models.layers.Block` params stacked on a leading ``layers`` dim. An MoE model
keeps its MoE layers' params apart, stacked in ``moe_blocks`` (``blocks`` then holds the dense
ones, if any). The layers run in a ``lax.scan`` so compile time does not grow with depth; with
MoE layers every ``moe_every``-th, the scan steps over groups of ``moe_every`` layers. The pieces a pipeline needs --
:meth:`embed`, :meth:`blocks` / :meth:`moe_block` and :meth:`head` -- are public
(:class:`jaxshard.model.LanguageModel`); :mod:`jaxshard.parallel.staged` builds the stages from
them. The remat policy is a parameter of the scan.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxshard import remat as remat_lib
from jaxshard.axes import Dim
from jaxshard.errors import ConfigError
from jaxshard.pytree import cast_floats
from jaxshard.model import MOE_METRICS, Loss, Params
from jaxshard.parallel import attention
from jaxshard.parallel.vocab import cross_entropy, table_copies
from jaxshard.rules import constrain, for_compute
from models.config import ModelConfig, Positions
from models.layers import CACHE_BTKH, Block, Embedder, KVCache, dropout, rope_tables
from models.moe import MoEFeedForward

BLOCKS = "blocks"
MOE_BLOCKS = "moe_blocks"
STACKS = (BLOCKS, MOE_BLOCKS)


def _logical_axes(state: nnx.State) -> dict:
    return nnx.to_pure_dict(jax.tree.map(lambda v: tuple(v.get_metadata()["logical_axes"]), state,
                                         is_leaf=lambda x: isinstance(x, nnx.Variable)))


class TransformerLM:
    """A :class:`jaxshard.model.LanguageModel`: GPT-2 and Llama families, dense or MoE."""

    stacks = STACKS
    stage_layout = None  # stored in model order (jaxshard.parallel.staged stores it by stages)

    def __init__(self, cfg: ModelConfig, remat: remat_lib.Remat | str = remat_lib.Remat.NONE,
                 unroll: bool = False):
        """``unroll``: unroll the layer scan (slower to compile; XLA's cost analysis then
        counts every layer, which it does not for a loop body)."""
        self.cfg = cfg
        self.remat = remat_lib.Remat.parse(remat)
        self.unroll = unroll
        self._abstract = None
        self._embedder_def, emb = nnx.split(nnx.eval_shape(lambda: Embedder(cfg, nnx.Rngs(0))), nnx.Param)
        self._block_def, blk = nnx.split(nnx.eval_shape(lambda: Block(cfg, nnx.Rngs(0))), nnx.Param)
        self.embedder_axes = _logical_axes(emb)
        self.block_axes = _logical_axes(blk)
        self.moe_layers = tuple(i for i in range(cfg.n_layers) if cfg.is_moe_layer(i))
        self.dense_layers = tuple(i for i in range(cfg.n_layers) if not cfg.is_moe_layer(i))
        if self.moe_layers:
            self._moe_def, moe = nnx.split(
                nnx.eval_shape(lambda: Block(cfg, nnx.Rngs(0), MoEFeedForward)), nnx.Param)
            self.moe_block_axes = _logical_axes(moe)

    @property
    def stack(self) -> str:
        """The layer stack a pipeline splits: the one stack of a model whose layers are all of
        one kind (dense, or all MoE)."""
        return MOE_BLOCKS if self.moe_layers else BLOCKS

    # ---- parameters -----------------------------------------------------------------------
    def init(self, key: jax.Array) -> Params:
        """Fresh params. Jit it with ``out_shardings`` to create them already sharded."""
        k_emb, k_blocks = jax.random.split(key)

        def block_params(ffn):
            return lambda k: nnx.to_pure_dict(nnx.state(Block(self.cfg, nnx.Rngs(k), ffn), nnx.Param))

        params = nnx.to_pure_dict(nnx.state(Embedder(self.cfg, nnx.Rngs(k_emb)), nnx.Param))
        keys = jax.random.split(k_blocks, self.cfg.n_layers)  # layer i's, whatever its kind
        if self.dense_layers:
            params[BLOCKS] = jax.vmap(block_params(None))(keys[jnp.array(self.dense_layers)])
        if self.moe_layers:
            params[MOE_BLOCKS] = jax.vmap(block_params(MoEFeedForward))(keys[jnp.array(self.moe_layers)])
        return params

    def param_axes(self) -> dict:
        """Logical dims of every param, a dict of the same structure as the params."""
        axes = dict(self.embedder_axes)
        stacked = lambda tree: jax.tree.map(lambda ax: (Dim.LAYERS, *ax), tree,  # noqa: E731
                                            is_leaf=lambda x: isinstance(x, tuple))
        if self.dense_layers:
            axes[BLOCKS] = stacked(self.block_axes)
        if self.moe_layers:
            axes[MOE_BLOCKS] = stacked(self.moe_block_axes)
        return axes

    def abstract_params(self) -> Params:
        """Shapes and dtypes of the params (computed once: planners ask often)."""
        if self._abstract is None:
            self._abstract = jax.eval_shape(self.init, jax.random.key(0))
        return self._abstract

    def n_params(self) -> int:
        """Counted from shapes alone: works for models far larger than memory."""
        return sum(math.prod(x.shape) for x in jax.tree.leaves(self.abstract_params()))

    def n_active_params(self) -> int:
        """Params one token passes through: all but the experts its router does not pick (k of
        E per MoE layer), counted from shapes. Equal to :meth:`n_params` for a dense model."""
        if not self.moe_layers:
            return self.n_params()
        E, k = self.cfg.moe_experts, self.cfg.moe_top_k
        shapes, axes = self.abstract_params(), self.param_axes()
        flat = zip(jax.tree.leaves(shapes), jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple)))
        return sum(math.prod(x.shape) * (k if Dim.EXPERTS in ax else E) // E for x, ax in flat)

    # ---- pieces ---------------------------------------------------------------------------
    def _embedder(self, params: Params) -> Embedder:
        outer = {k: v for k, v in params.items() if k not in STACKS}
        return nnx.merge(self._embedder_def, for_compute(outer, self.embedder_axes))

    def embed(self, params: Params, tokens_BL: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        """The tokens' embedding, at their places (in their documents, when traced under
        :func:`attention.documents`)."""
        x_BLD = self._embedder(params).encode(tokens_BL, attention.positions(tokens_BL.shape[1]))
        return dropout(x_BLD, self.cfg.dropout, key)

    def block(self, layer_params: Params, x_BLD: jax.Array, *, key: jax.Array | None = None,
              cache: KVCache | None = None):
        """One layer, given that layer's (unstacked) params, cast to the dtype of its input.
        With that layer's ``cache`` (decoding, :meth:`extend`): (output, the updated cache)."""
        layer_params = cast_floats(layer_params, x_BLD.dtype)
        block = nnx.merge(self._block_def, for_compute(layer_params, self.block_axes, self.cfg.fp8))
        if cache is None:
            return block(x_BLD, self._rope(x_BLD.shape[1]), key)
        positions_BL = cache.start[:, None] + jnp.arange(x_BLD.shape[1])
        return block(x_BLD, self._rope(positions_BL), key, cache)

    def blocks(self, params: Params, x_BLD: jax.Array, *, key: jax.Array | None = None,
               layer_keys: jax.Array | None = None, present: jax.Array | None = None) -> jax.Array:
        """All layers of ``params``' stack: a scan, remat'd by the model's policy. Dropout keys:
        ``key`` split per layer, or ``layer_keys`` one per layer. ``present``: per slot of the
        stack, whether it holds a layer (an empty slot is skipped, not computed)."""
        keys = layer_keys if key is None else jax.random.split(key, self.cfg.n_layers)

        def body(x, layer):
            layer_params, layer_key, here = layer
            if here is None:
                return self.block(layer_params, x, key=layer_key), None
            return jax.lax.cond(here, lambda: self.block(layer_params, x, key=layer_key), lambda: x), None

        x_BLD, _ = jax.lax.scan(remat_lib.apply(body, self.remat), x_BLD, (params[BLOCKS], keys, present),
                                unroll=self.unroll)
        return x_BLD

    # ---- decoding with a KV cache ------------------------------------------------------------
    def new_cache(self, batch: int, length: int, dtype: Any = jnp.float32) -> KVCache:
        """An empty :class:`~models.layers.KVCache` of ``length`` slots for every layer, laid
        out by the active rules (rows over the batch axes, kv heads over ``tensor``)."""
        cfg = self.cfg
        kv = jnp.zeros((cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.d_head), dtype)
        kv = constrain(kv, (None, *CACHE_BTKH))
        return KVCache(kv, kv, jnp.zeros((batch,), jnp.int32))

    def extend(self, params: Params, tokens_BL: jax.Array, cache: KVCache,
               at_B: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """Run ``tokens_BL`` at each row's slots ``cache.start + l`` (a prompt, or the token just
        drawn), the layers attending to the cache: (float32 logits ``[B, L, V]``, the cache
        with their keys and values and ``start`` advanced by L). ``at_B``: only the logits at
        index ``at_B[b]`` of each row (``[B, 1, V]``). A dense model in model order only."""
        L = tokens_BL.shape[1]
        positions_BL = cache.start[:, None] + jnp.arange(L)
        x_BLD = self._embedder(params).encode(tokens_BL, positions_BL)

        def body(x, layer):
            layer_params, k, v = layer
            x, c = self.block(layer_params, x, cache=KVCache(k, v, cache.start))
            return x, (c.k, c.v)

        x_BLD, (k, v) = jax.lax.scan(body, x_BLD, (params[BLOCKS], cache.k, cache.v), unroll=self.unroll)
        if at_B is not None:
            x_BLD = jnp.take_along_axis(x_BLD, at_B[:, None, None], axis=1)
        return self.head(params, x_BLD), KVCache(k, v, cache.start + L)

    def moe_block(self, layer_params: Params, x_BLD: jax.Array, *,
                  key: jax.Array | None = None) -> tuple[jax.Array, Any]:
        """One MoE layer, given its (unstacked) params, cast to the dtype of its input:
        (output, its ``models.moe.Routing``)."""
        layer_params = cast_floats(layer_params, x_BLD.dtype)
        block = nnx.merge(self._moe_def, for_compute(layer_params, self.moe_block_axes))
        return block(x_BLD, self._rope(x_BLD.shape[1]), key)

    def moe_stack(self, params: Params, x_BLD: jax.Array, *,
                  key: jax.Array | None = None) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """All layers of an MoE model: the first dense ones in a scan, then a scan over groups
        of ``moe_every`` layers, the last of each an MoE layer (dropout keys as :meth:`blocks`
        splits them, one per layer in model order). Returns the output and the MoE layers'
        (load balance, z-loss, dropped fraction), each ``[n_moe_layers]``."""
        cfg = self.cfg
        keys = None if key is None else jax.random.split(key, cfg.n_layers)
        first, every, groups = cfg.moe_first_dense, cfg.moe_every, cfg.n_moe_layers
        dense = params.get(BLOCKS)
        if first:
            x_BLD = self.blocks({BLOCKS: jax.tree.map(lambda p: p[:first], dense)}, x_BLD,
                                layer_keys=None if keys is None else keys[:first])
        in_groups = None if every == 1 else jax.tree.map(
            lambda p: p[first:].reshape(groups, every - 1, *p.shape[1:]), dense)
        group_keys = None if keys is None else keys[first:].reshape(groups, every)

        def group(x, xs):
            dense_g, moe_g, keys_g = xs
            for j in range(every - 1):
                x = self.block(jax.tree.map(lambda p: p[j], dense_g), x,
                               key=None if keys_g is None else keys_g[j])
            x, r = self.moe_block(moe_g, x, key=None if keys_g is None else keys_g[-1])
            return x, r.stats

        return jax.lax.scan(remat_lib.apply(group, self.remat), x_BLD,
                            (in_groups, params[MOE_BLOCKS], group_keys), unroll=self.unroll)

    def head(self, params: Params, x_BLD: jax.Array) -> jax.Array:
        """Float32 logits ``[B, L, V]``."""
        return self._embedder(params).decode(x_BLD)

    def loss(self, params: Params, inputs_BL: jax.Array, targets_BL: jax.Array, *,
             key: jax.Array | None = None) -> Loss:
        """The batch's :class:`Loss`. An MoE model's total adds, per token, ``moe_aux_coef``
        times the load-balancing loss and ``moe_z_coef`` times the router z-loss, each the mean
        over its MoE layers."""
        nll_BL, counted_BL, stats = self._token_losses(params, inputs_BL, targets_BL, key)
        if counted_BL is None:
            nll, tokens = nll_BL.sum(), jnp.asarray(nll_BL.size, jnp.float32)
        else:
            nll, tokens = jnp.where(counted_BL, nll_BL, 0.0).sum(), counted_BL.sum(dtype=jnp.float32)
        moe = {name: tokens * jnp.mean(s) for name, s in zip(MOE_METRICS, stats)}
        total = nll + self.aux_loss(**moe) if moe else nll
        return Loss(total, tokens, nll, moe)

    def token_losses(self, params: Params, inputs_BL: jax.Array, targets_BL: jax.Array) -> jax.Array:
        """Each target's cross-entropy ``[B, L]``, in the sequence's order; 0 where it does not
        count (after an end-of-text, with packed documents)."""
        nll_BL, counted_BL, _ = self._token_losses(params, inputs_BL, targets_BL, None)
        order = self.balanced_order(inputs_BL.shape[1])
        if counted_BL is not None:
            nll_BL = jnp.where(counted_BL, nll_BL, 0.0)
        return nll_BL if order is None else nll_BL[:, np.argsort(order)]

    def _token_losses(self, params: Params, inputs_BL: jax.Array, targets_BL: jax.Array, key: jax.Array | None):
        """(each target's cross-entropy, which count -- None: all -- and the MoE layers'
        routing statistics), in the order the tokens are traced in."""
        self.check_seq_len(inputs_BL)
        k_embed, k_blocks = jax.random.split(key) if key is not None else (None, None)
        # One embedder for both ends (not embed() then head()): a tied table is gathered once
        # and its two gradients are summed before they are reduced.
        embedder = self._embedder(params)
        table = table_copies(embedder.tokens[...], embedder.tied)
        # Packed documents (``documents_eot``): attention within each, positions from 0 in each,
        # and the target after an end-of-text not counted.
        # They are made from the whole row of token ids on every device, and kept whole: under
        # a sequence split, one all-gather of the ids (the one the balanced layout's reordering
        # makes anyway), and the rings and Ulysses slice the ids they need. (Made on the split,
        # the prefix sums and the reordering gathered each of them, and every layer's attention
        # its segment ids.)
        whole_BL = inputs_BL
        layout = (None, None, None)
        if self.cfg.documents_eot is not None:
            whole_BL = constrain(inputs_BL, (Dim.BATCH, None))
            layout = tuple(constrain(x, (Dim.BATCH, None))
                           for x in attention.document_layout(whole_BL, self.cfg.documents_eot))
        order = self.balanced_order(inputs_BL.shape[1])
        if order is not None:  # a ring's balanced layout: the loss is a sum over tokens, in any order
            inputs_BL, targets_BL = whole_BL[:, order], targets_BL[:, order]
            layout = tuple(None if x is None else x[:, order] for x in layout)
        segments_BL, positions_BL, counted_BL = layout
        with attention.balanced(order), attention.documents(segments_BL, positions_BL):
            x_BLD = dropout(embedder.encode(inputs_BL, attention.positions(inputs_BL.shape[1]), table),
                            self.cfg.dropout, k_embed)
            stats = ()
            if self.moe_layers:
                x_BLD, stats = self.moe_stack(params, x_BLD, key=k_blocks)
            else:
                x_BLD = self.blocks(params, x_BLD, key=k_blocks)
        logits_BLV = embedder.decode(x_BLD, table)
        return cross_entropy(logits_BLV, targets_BL, self.cfg.vocab_size), counted_BL, stats

    def balanced_order(self, L: int) -> np.ndarray | None:
        """The token order of a load-balanced ring (:func:`attention.balanced_order`) under the
        active rules, or None: no ring, a sequence that does not split into 2S halves, or
        dropout, whose masks follow the sequence's order (so the ring keeps it, and masks its
        future chunks)."""
        S = attention.ring_size()
        return attention.balanced_order(L, S) if attention.balances(self.cfg, S, L) else None

    def aux_loss(self, moe_load_balance: jax.Array, moe_z_loss: jax.Array, moe_max_violation: jax.Array,
                 **_) -> jax.Array:
        """The auxiliary losses' part of the differentiated loss, from the token-weighted sums of
        the routing statistics (:data:`MOE_METRICS`): the weighted load-balancing loss (none
        under ``moe_balance`` bias) and z-loss, and with a routing bias the max violation's
        zero-valued load term, which carries the loads to the bias's gradient (``models.moe``)."""
        total = self.cfg.moe_aux_weight * moe_load_balance + self.cfg.moe_z_coef * moe_z_loss
        if self.cfg.moe_router_bias:
            total = total + (moe_max_violation - jax.lax.stop_gradient(moe_max_violation))
        return total

    def check_seq_len(self, inputs_BL: jax.Array) -> None:
        if inputs_BL.shape[1] > self.cfg.max_seq_len:
            raise ConfigError(f"--seq-len {inputs_BL.shape[1]} exceeds model {self.cfg.name}'s "
                              f"max_seq_len {self.cfg.max_seq_len}")

    def _rope(self, positions: int | jax.Array) -> tuple[jax.Array, jax.Array] | None:
        """Rotary tables for positions ``0..positions-1``, or for the given ``[B, L]``."""
        if self.cfg.positions is not Positions.ROPE:
            return None
        if isinstance(positions, int):
            positions = attention.positions(positions)
        return rope_tables(positions, self.cfg.d_head, self.cfg.rope_theta, self.cfg.rope_scaling)
