"""Dynamic loss scaling for float16 training (``--compute-dtype float16`` or ``--param-dtype
float16``).

float16 has 5 exponent bits: small gradients underflow to zero unless the loss is multiplied by
a large scale before the backward pass (and the gradients divided by it after). Too large a
scale overflows instead, so the scale adapts, as in Micikevicius et al. (2018) and PyTorch's
``GradScaler``: a step whose gradients are not all finite is skipped (params and optimizer state
unchanged) and the scale halves; after ``period`` finite steps in a row it doubles. bfloat16 has
float32's exponent range and needs none of this.

The state is three scalars kept in the train state (so it is checkpointed and resumed): the
scale (float32), the finite steps since the last change and the steps skipped so far. It is a
module of its own rather than ``jmp``'s ``DynamicLossScale`` (same rules): that package has had
no release since 2023, and the skip must also hold back the optimizer state, which
``optax.apply_if_finite`` does but without the scale.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxshard.errors import ConfigError


class LossScale(NamedTuple):
    scale: jax.Array  # float32 scalar
    good_steps: jax.Array  # int32: finite steps since the scale last changed
    skipped: jax.Array  # int32: steps skipped because their gradients overflowed


def init(scale: float) -> LossScale:
    if not scale > 0:
        raise ConfigError(f"--loss-scale must be > 0, got {scale}")
    return LossScale(jnp.asarray(scale, jnp.float32), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))


def adjust(state: LossScale, finite: jax.Array, period: int, factor: float = 2.0) -> LossScale:
    """The next state: halve (and count a skip) on overflow; double after ``period`` finite steps."""
    grow = finite & (state.good_steps + 1 >= period)
    scale = jnp.where(finite, jnp.where(grow, state.scale * factor, state.scale), state.scale / factor)
    # Never let the scale reach 0 or overflow float32 itself.
    scale = jnp.clip(scale, 1.0, jnp.finfo(jnp.float32).max / factor)
    good = jnp.where(finite & ~grow, state.good_steps + 1, 0).astype(jnp.int32)
    return LossScale(scale, good, state.skipped + (~finite).astype(jnp.int32))


def select(finite: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where the step was finite, else ``old`` (the skipped step changes nothing)."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
