"""What a language model gives the library: its loss as token sums (:class:`LanguageModel`), and
the pieces a pipeline stages -- the embedding, the layers of its stack, the head
(:class:`Stageable`).

Model code (``models/``) implements both; strategies take it from outside:
the pipeline adapter (:mod:`jaxshard.parallel.staged`) splits its layer stack into stages from
these pieces, so a model knows no schedule.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax

Params = dict[str, Any]

# The routing statistics of a model with MoE layers, in the order a layer reports them.
MOE_METRICS = ("moe_load_balance", "moe_z_loss", "moe_dropped")


class Loss(NamedTuple):
    """A batch's loss as sums over its tokens: callers divide each by ``tokens`` once globally,
    so microbatches and shards add up to the full-batch means exactly."""

    total: jax.Array  # what is differentiated: nll + tokens x the weighted auxiliary losses
    tokens: jax.Array
    nll: jax.Array  # the token cross-entropies' sum
    # MoE models: tokens x each routing statistic (MOE_METRICS), averaged over the MoE layers;
    # empty for a dense model.
    moe: dict[str, jax.Array]


@runtime_checkable
class LanguageModel(Protocol):
    """A decoder-only language model as functions of (params, inputs).

    Params are a nested dict; the layers' params are stacked on a leading ``layers`` dim under
    one of :attr:`stacks` (a pipeline splits :attr:`stack`); the rest are the outer params
    (embedding, final norm, head)."""

    cfg: Any  # the family's config (models.config.ModelConfig): shapes, dropout, MoE settings
    remat: Any  # the layer scan's recompute policy (jaxshard.remat.Remat)
    unroll: bool  # the layer scan unrolled (XLA's cost analysis then counts every layer)
    moe_layers: tuple[int, ...]  # indices of the MoE layers (empty: a dense model)
    stacks: tuple[str, ...]  # keys of the params that hold stacked layers
    stage_layout: Any  # None: the layer stack is stored in model order

    @property
    def stack(self) -> str: ...  # the stack a pipeline splits (all layers of one kind)

    def init(self, key: jax.Array) -> Params: ...
    def abstract_params(self) -> Params: ...
    def param_axes(self) -> dict: ...  # logical dims of every param, the params' structure
    def n_params(self) -> int: ...
    def n_active_params(self) -> int: ...
    def loss(self, params: Params, inputs_BL: jax.Array, targets_BL: jax.Array, *,
             key: jax.Array | None = None) -> Loss: ...



@runtime_checkable
class Stageable(LanguageModel, Protocol):
    """A model whose pieces a pipeline can stage (:mod:`jaxshard.parallel.staged`)."""

    def embed(self, params: Params, tokens_BL: jax.Array, *, key: jax.Array | None = None) -> jax.Array: ...
    def blocks(self, params: Params, x_BLD: jax.Array, *, key: jax.Array | None = None,
               layer_keys: jax.Array | None = None, present: jax.Array | None = None) -> jax.Array: ...
    def moe_block(self, layer_params: Params, x_BLD: jax.Array, *,
                  key: jax.Array | None = None) -> tuple[jax.Array, Any]: ...
    def head(self, params: Params, x_BLD: jax.Array) -> jax.Array: ...
    def aux_loss(self, load_balance: jax.Array, z_loss: jax.Array) -> jax.Array: ...
    def check_seq_len(self, inputs_BL: jax.Array) -> None: ...
