"""BatchNorm's batch statistics per device or synchronised over the batch axes, and a
data-parallel step for models that carry running statistics.

Under data parallelism each device holds a slice of the batch. PyTorch DDP's default BatchNorm
normalises each slice with the mean and variance of its own rows (:attr:`Sync.DEVICE`): the
model then computes something else than on one device, and something else again for every
number of devices. Synchronised (:attr:`Sync.GLOBAL`, PyTorch's SyncBatchNorm) the statistics
are reduced over the batch axes and the trajectory is one device's.

"Per device" needs the batch split by hand: :func:`over_batch` runs a function on each batch
shard in a ``jax.shard_map`` manual over the batch axes, and :func:`moments` reads those axes
from the trace context. Outside such a region (one device) the statistics are the plain ones
of the whole array.

Global statistics are two-pass: a psum of the sums for the mean, then a psum of the squared
deviations from it -- two all-reduces of C floats per layer, latency rather than bandwidth. The
one-pass psum of sums and squared sums saves one of them but takes var = E[x^2] - mean^2,
which in float32 loses about log10(mean^2 / var) of its ~7 digits to cancellation (inputs
offset by 1000 from a unit spread keep none); the two-pass variance is one device's
arithmetic up to the order of the additions. (PyTorch all-gathers each device's mean and
variance and merges them, Chan's way: one collective, as stable, n times the bytes.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxshard.axes import BATCH_AXES
from jaxshard.errors import ConfigError


class Sync(StrEnum):
    DEVICE = "device"  # each device's own rows (PyTorch DDP's BatchNorm)
    GLOBAL = "global"  # the whole batch, reduced over the batch axes (SyncBatchNorm)


@dataclass(frozen=True, slots=True)
class BatchNormConfig:
    sync: Sync = Sync.GLOBAL
    # PyTorch's convention: running = (1 - momentum) * running + momentum * batch statistic.
    momentum: float = 0.1
    eps: float = 1e-5

    def __post_init__(self) -> None:
        if not isinstance(self.sync, Sync):
            raise ConfigError(f"BatchNorm sync must be one of {', '.join(Sync)}, got {self.sync!r}")
        if not 0.0 <= self.momentum <= 1.0:
            raise ConfigError(f"BatchNorm momentum must be in [0, 1], got {self.momentum}")
        if self.eps <= 0:
            raise ConfigError(f"BatchNorm eps must be > 0, got {self.eps}")


class Moments(NamedTuple):
    mean: jax.Array  # [C]
    var: jax.Array  # [C], biased (divided by count), as normalisation uses it
    count: int  # values per channel the statistics were taken over


class Running(NamedTuple):
    """A BatchNorm layer's running statistics: state, neither trained nor in the optimizer."""

    mean: jax.Array  # [C]
    var: jax.Array  # [C], unbiased (PyTorch's running_var)

    @classmethod
    def init(cls, channels: int) -> Running:
        return cls(jnp.zeros((channels,), jnp.float32), jnp.ones((channels,), jnp.float32))


# ---- statistics -------------------------------------------------------------------------------
def batch_axes(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh) -> tuple[str, ...]:
    """The mesh axes of size > 1 that split the batch, in the mesh's nesting order."""
    return tuple(a for a in map(str, mesh.axis_names) if a in BATCH_AXES and mesh.shape[a] > 1)


def _manual_batch_axes() -> tuple[str, ...]:
    """The batch axes of the ``shard_map`` region being traced (none outside one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    manual = set(map(str, mesh.manual_axes))
    return tuple(a for a in batch_axes(mesh) if a in manual)


def _psum(x: Any, axes: tuple[str, ...]) -> Any:
    return jax.lax.psum(x, axes) if axes else x


def moments(x: jax.Array, sync: Sync) -> Moments:
    """Mean and biased variance of ``x`` over all dims but the last (channels): over this
    device's rows (``DEVICE``) or over the rows of every device of the region's batch axes
    (``GLOBAL``: two all-reduces of C floats). Outside a region, of all of ``x``."""
    dims = tuple(range(x.ndim - 1))
    axes = _manual_batch_axes() if sync is Sync.GLOBAL else ()
    mesh = jax.sharding.get_abstract_mesh()
    count = math.prod(x.shape[:-1]) * math.prod(mesh.shape[a] for a in axes)
    mean = _psum(jnp.sum(x, dims), axes) / count
    var = _psum(jnp.sum(jnp.square(x - mean), dims), axes) / count
    return Moments(mean, var, count)


def _first_shard(x: jax.Array) -> jax.Array:
    """Inside a region: the value of the first batch shard, on every device. PyTorch DDP
    broadcasts rank 0's buffers before each forward, so its running statistics are rank 0's."""
    axes = _manual_batch_axes()
    if not axes:
        return x
    return jax.lax.psum(jnp.where(jax.lax.axis_index(axes) == 0, x, jnp.zeros_like(x)), axes)


def update_running(running: Running, m: Moments, cfg: BatchNormConfig) -> Running:
    """One momentum step of the running statistics, with the unbiased variance (PyTorch's).
    Equal on every device of a region: the global statistics are, per-device ones are first
    replaced by the first shard's."""
    mean, var = jax.lax.stop_gradient((m.mean, m.var * (m.count / max(m.count - 1, 1))))
    if cfg.sync is Sync.DEVICE:
        mean, var = _first_shard(mean), _first_shard(var)
    k = cfg.momentum
    return Running((1 - k) * running.mean + k * mean, (1 - k) * running.var + k * var)


def batch_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, running: Running,
               cfg: BatchNormConfig, train: bool) -> tuple[jax.Array, Running]:
    """Normalise the channels (last dim) of ``x``: training, with the batch's statistics (as
    ``cfg.sync`` says) and a running update; evaluating, with the running statistics."""
    if train:
        m = moments(x, cfg.sync)
        mean, var, running = m.mean, m.var, update_running(running, m, cfg)
    else:
        mean, var = running
    return (x - mean) * (jax.lax.rsqrt(var + cfg.eps) * scale) + bias, running


# ---- data parallelism -------------------------------------------------------------------------
def over_batch(fn: Callable[[Any, Any], tuple[Any, Any]], mesh: jax.sharding.Mesh) -> Callable:
    """``fn(shared, rows) -> (rows_out, shared_out)`` on each batch shard, manual over the mesh's
    batch axes: ``rows`` split on their leading dim and ``rows_out`` put back together along it;
    ``shared`` (params, running statistics) whole on every device, and ``shared_out`` must be
    the same on every device (synchronised: the region checks it when traced). Without batch
    axes, ``fn`` itself."""
    axes = batch_axes(mesh)
    if not axes:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=(P(), P(axes)), out_specs=(P(axes), P()))


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: updates applied
    params: Any
    stats: Any  # running statistics: updated by the forward pass, not by the optimizer
    opt_state: Any


def init_state(params: Any, stats: Any, tx: optax.GradientTransformation,
               mesh: jax.sharding.Mesh) -> TrainState:
    """The train state, replicated over ``mesh`` (data parallelism)."""
    replicated = NamedSharding(mesh, P())
    return jax.jit(lambda p, s: TrainState(jnp.zeros((), jnp.int32), p, s, tx.init(p)),
                   out_shardings=replicated)(params, stats)


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    """Batches: rows over the batch axes."""
    return NamedSharding(mesh, P(batch_axes(mesh)))


def check_batch(mesh: jax.sharding.Mesh, rows: int) -> None:
    """One clear error if ``rows`` cannot be split evenly over the batch axes."""
    axes = batch_axes(mesh)
    shards = math.prod(mesh.shape[a] for a in axes)
    if rows % shards:
        split = ",".join(f"{a}={mesh.shape[a]}" for a in axes)
        raise ConfigError(f"--batch-size {rows} is not divisible by the batch axes ({split}: {shards} shards)")


def build_train_step(loss_fn: Callable[[Any, Any, Any], tuple[jax.Array, Any]],
                     tx: optax.GradientTransformation, mesh: jax.sharding.Mesh) -> Callable:
    """``step(state, batch) -> (state, {'loss', 'grad_norm'})`` for ``loss_fn(params, stats,
    rows) -> (sum of the rows' losses, new stats)``, which runs per batch shard.

    The loss is the mean over the global batch: each shard's sum over the global row count,
    psummed. The params enter the region replicated, so differentiating through it sums the
    shards' gradients (the transpose of that broadcast is a psum: DDP's all-reduce), and
    through a synchronised BatchNorm's psums each shard's share of the statistics' gradient
    reaches every shard, as on one device.
    """
    axes = batch_axes(mesh)
    shards = math.prod(mesh.shape[a] for a in axes)

    def shard_loss(shared, rows):
        params, stats = shared
        total, stats = loss_fn(params, stats, rows)
        n = jax.tree.leaves(rows)[0].shape[0] * shards
        return (), (_psum(total / n, axes), stats)

    region = over_batch(shard_loss, mesh)

    def loss(params, stats, batch):
        return region((params, stats), batch)[1]

    def step(state: TrainState, batch: Any):
        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(state.params, state.stats, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": value, "grad_norm": optax.tree.norm(grads)}
        return TrainState(state.step + 1, params, stats, opt_state), metrics

    replicated = NamedSharding(mesh, P())
    return jax.jit(step, in_shardings=(replicated, batch_sharding(mesh)),
                   out_shardings=(replicated, replicated), donate_argnums=0)


def train(loss_fn: Callable, params: Any, stats: Any, tx: optax.GradientTransformation,
          mesh: jax.sharding.Mesh, batches: Iterable[Any]) -> tuple[np.ndarray, TrainState]:
    """Train on ``batches`` (host arrays, whole batches): the losses per step and the final state."""
    step = build_train_step(loss_fn, tx, mesh)
    state = init_state(params, stats, tx, mesh)
    losses = []
    for batch in batches:
        check_batch(mesh, jax.tree.leaves(batch)[0].shape[0])
        state, metrics = step(state, jax.device_put(batch, batch_sharding(mesh)))
        losses.append(float(metrics["loss"]))
    return np.asarray(losses), state
