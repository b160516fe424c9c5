"""Abstract init -> shardings -> sharded materialisation of the train state.

Nothing is ever materialised on one device: the state's shapes come from ``eval_shape``,
its shardings from the rules, and ``jit(init, out_shardings=...)`` writes each shard where
it lives (the nanodo pattern). Optimizer moments take the ZeRO/FSDP at-rest layout of
:attr:`~jaxshard.rules.StateKind.OPT_STATE`, params that of ``PARAMS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxshard import optim
from jaxshard.rules import ShardingRules, StateKind


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: number of updates applied
    params: Any
    opt_state: Any


@dataclass(frozen=True)
class StateLayout:
    """Where every part of the train state lives at rest."""

    shardings: TrainState  # of NamedSharding
    grad_shardings: Any  # params-shaped; the gradient layout after reduction
    abstract: TrainState  # of ShapeDtypeStruct


def state_layout(model: Any, tx: optax.GradientTransformation, rules: ShardingRules) -> StateLayout:
    axes = model.param_axes()
    abstract_params = model.abstract_params()
    abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32), abstract_params,
                          jax.eval_shape(tx.init, abstract_params))
    moments = rules.param_shardings(axes, abstract_params, StateKind.OPT_STATE)
    shardings = TrainState(
        step=rules.replicated(),
        params=rules.param_shardings(axes, abstract_params, StateKind.PARAMS),
        opt_state=optim.state_shardings(tx, abstract.opt_state, moments, rules.replicated()))
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            abstract, shardings)
    return StateLayout(shardings=shardings,
                       grad_shardings=rules.param_shardings(axes, abstract_params, StateKind.GRADS),
                       abstract=abstract)


def build_init(model: Any, tx: optax.GradientTransformation, layout: StateLayout):
    """``init(seed) -> TrainState``, jitted so every array is created in its own sharding."""

    def init(seed: jax.Array) -> TrainState:
        params = model.init(jax.random.key(seed))
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))

    return jax.jit(init, out_shardings=layout.shardings)
