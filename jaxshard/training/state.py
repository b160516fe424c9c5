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

from jaxshard.model import LanguageModel
from jaxshard.pytree import cast_floats
from jaxshard.rules import ShardingRules, StateKind, on_host
from jaxshard.training import loss_scale, optim


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: number of updates applied
    params: Any
    opt_state: Any
    loss_scale: loss_scale.LossScale | None = None  # float16 training only


@dataclass(frozen=True)
class StateLayout:
    """Where every part of the train state lives at rest."""

    shardings: TrainState  # of NamedSharding, at rest (offloaded parts in host memory)
    compute: TrainState  # the same, all in device memory: where the step computes
    grad_shardings: Any  # params-shaped; the gradients' at-rest layout (ZeRO-1: whole)
    reduce_shardings: Any  # params-shaped; where the step reduces them into (ZeRO-1: sharded)
    abstract: TrainState  # of ShapeDtypeStruct


def state_layout(model: LanguageModel, tx: optax.GradientTransformation, rules: ShardingRules,
                 param_dtype: str = "float32", initial_scale: float | None = None) -> StateLayout:
    """``initial_scale``: keep a dynamic loss scale (float16) starting there."""
    axes = model.param_axes()
    abstract_params = cast_floats(model.abstract_params(), jnp.dtype(param_dtype))
    scale = None if initial_scale is None else jax.eval_shape(lambda: loss_scale.init(initial_scale))
    abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32), abstract_params,
                          jax.eval_shape(tx.init, abstract_params), scale)
    moments = rules.param_shardings(axes, abstract_params, StateKind.OPT_STATE)
    shardings = TrainState(
        step=rules.replicated(),
        params=rules.param_shardings(axes, abstract_params, StateKind.PARAMS),
        opt_state=optim.state_shardings(tx, abstract.opt_state, moments, rules.replicated()),
        loss_scale=None if scale is None else jax.tree.map(lambda _: rules.replicated(), scale))
    compute = shardings
    if rules.offloaded(StateKind.PARAMS):
        shardings = shardings._replace(params=on_host(shardings.params))
    if rules.offloaded(StateKind.OPT_STATE):
        # Everything params-shaped (moments, master copy) goes; the step counters stay.
        shardings = shardings._replace(opt_state=optim.state_shardings(
            tx, abstract.opt_state, on_host(moments), rules.replicated()))
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            abstract, shardings)
    return StateLayout(shardings=shardings, compute=compute,
                       grad_shardings=rules.param_shardings(axes, abstract_params, StateKind.GRADS),
                       reduce_shardings=rules.param_shardings(axes, abstract_params, rules.reduced_into),
                       abstract=abstract)


def move(tree: Any, src: Any, dst: Any) -> Any:
    """``tree``, laid out as ``src``, moved to ``dst`` (between host and device memory, inside a
    jitted step); where the two are the same nothing happens and nothing enters the program."""
    return tree if src == dst else jax.device_put(tree, dst)


def fresh_state(tx: optax.GradientTransformation, params: Any, param_dtype: Any,
                initial_scale: float | None = None) -> TrainState:
    """Step 0 around float32 ``params``: the optimizer sees them as they are (a master copy
    keeps them exactly); params are stored in ``param_dtype``."""
    opt_state = tx.init(params)
    params = cast_floats(params, param_dtype)
    scale = None if initial_scale is None else loss_scale.init(initial_scale)
    return TrainState(jnp.zeros((), jnp.int32), params, opt_state, scale)


def build_init(model: LanguageModel, tx: optax.GradientTransformation, layout: StateLayout,
               initial_scale: float | None = None):
    """``init(seed) -> TrainState``, jitted so every array is created in its own sharding."""
    param_dtype = jax.tree.leaves(layout.abstract.params)[0].dtype
    return jax.jit(lambda seed: fresh_state(tx, model.init(jax.random.key(seed)), param_dtype, initial_scale),
                   out_shardings=layout.shardings)
