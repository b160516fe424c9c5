"""Logical dims -> mesh axes: the one place where a strategy decides placement.

Two mappings, as in Levanter:

* **at rest** -- how params, grads and optimizer state are stored between steps. ZeRO and
  FSDP live here: the ``fsdp`` axis always shards all three (ZeRO-3); the ``data`` axis shards
  optimizer state from ``--zero 1``, grads from ``--zero 2`` and params from ``--zero 3``.
* **in compute** -- how activations are laid out (``batch`` over the batch axes) and what a
  parameter looks like when a layer uses it (at-rest layout minus the ZeRO/FSDP axes, so FSDP
  all-gathers one layer's weights inside the layer scan, and its transpose reduce-scatters the
  gradient).

Model code calls :func:`constrain` and :func:`for_compute`; both read the rules made active
by :func:`use_rules` while the step is traced, and do nothing outside it.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterator

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxshard.axes import BATCH_AXES, Dim, LogicalAxes, MeshAxis
from jaxshard.errors import ConfigError

# Dims that ZeRO/FSDP never pick: the layer scan slices ``layers`` one layer at a time.
_NO_STATE_SHARDING = frozenset({Dim.LAYERS})


class StateKind(Enum):
    """What is stored at rest; the value is the ZeRO stage from which ``data`` shards it."""

    OPT_STATE = 1
    GRADS = 2
    PARAMS = 3


@dataclass(frozen=True, slots=True)
class Strategy:
    """What a mesh does beyond its axes: the ZeRO stage over ``data`` and FSDP's wrap size.

    ``fsdp_min_size``: params with fewer elements stay replicated (FSDP's min-params wrap
    policy), so tiny norm scales and biases cost no collective.
    """

    zero: int = 0
    fsdp_min_size: int = 0

    def __post_init__(self) -> None:
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"--zero must be 0, 1, 2 or 3, got {self.zero}")
        if self.fsdp_min_size < 0:
            raise ConfigError(f"--fsdp-min-size must be >= 0, got {self.fsdp_min_size}")


def _spec(entries: list[tuple[str, ...]]) -> PartitionSpec:
    return PartitionSpec(*(None if not e else e[0] if len(e) == 1 else e for e in entries))


class ShardingRules:
    """The rules table of one (mesh, strategy): specs and shardings for any pytree."""

    def __init__(self, mesh: jax.sharding.Mesh, strategy: Strategy = Strategy()):
        self.mesh = mesh
        self.strategy = strategy
        self.sizes = {str(a): int(s) for a, s in mesh.shape.items()}
        self.batch_axes = self._active(BATCH_AXES)
        # logical activation dim -> mesh axes
        self.activation_table: dict[Dim, tuple[str, ...]] = {Dim.BATCH: self.batch_axes}
        # logical param dim -> model-parallel mesh axes (kept in compute, unlike ZeRO/FSDP)
        self.param_table: dict[Dim, tuple[str, ...]] = {}

    def _active(self, axes: tuple[MeshAxis, ...]) -> tuple[str, ...]:
        """The axes of ``axes`` with size > 1, in mesh nesting order."""
        wanted = {str(a) for a in axes}
        return tuple(a for a in self.mesh.axis_names if a in wanted and self.sizes[a] > 1)

    def size(self, axes: tuple[str, ...]) -> int:
        return math.prod(self.sizes[a] for a in axes)

    # ---- naming ---------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """Short strategy name for reports: ddp, zero1, zero2, zero3, fsdp, hsdp, single."""
        data, fsdp, zero = self.sizes[MeshAxis.DATA], self.sizes[MeshAxis.FSDP], self.strategy.zero
        if fsdp > 1:
            base = "hsdp" if data > 1 else "fsdp"
            return f"{base}+zero{zero}" if data > 1 and zero else base
        if data > 1:
            return f"zero{zero}" if zero else "ddp"
        return "single"

    # ---- at rest --------------------------------------------------------------------------
    def state_axes(self, kind: StateKind) -> tuple[str, ...]:
        """Mesh axes that shard state of ``kind`` beyond the model-parallel axes."""
        axes = [str(MeshAxis.FSDP)]
        if self.strategy.zero >= kind.value:
            axes.append(str(MeshAxis.DATA))
        return self._active(tuple(MeshAxis(a) for a in axes))

    def param_spec(self, axes: LogicalAxes, shape: tuple[int, ...],
                   kind: StateKind = StateKind.PARAMS) -> PartitionSpec:
        """At-rest spec of one parameter (or its grad / optimizer moment)."""
        entries = self._model_parallel(axes, shape)
        state = self.state_axes(kind)
        if state and math.prod(shape) >= self.strategy.fsdp_min_size:
            # Shard on one dim: `embed` if it divides, else the largest dim that does. If
            # none divides by all state axes, drop the outer (slower) ones until one does.
            for k in range(len(state)):
                dim = self._state_dim(axes, shape, entries, self.size(state[k:]))
                if dim is not None:
                    entries[dim] = entries[dim] + state[k:]
                    break
        return _spec(entries)

    def _state_dim(self, axes, shape, entries, n: int) -> int | None:
        ok = [i for i, d in enumerate(axes)
              if d not in _NO_STATE_SHARDING and shape[i] % (self.size(entries[i]) * n) == 0]
        for i in ok:
            if axes[i] == Dim.EMBED:
                return i
        return max(ok, key=lambda i: shape[i]) if ok else None

    # ---- in compute -----------------------------------------------------------------------
    def compute_param_spec(self, axes: LogicalAxes, shape: tuple[int, ...]) -> PartitionSpec:
        """A parameter as a layer uses it: model-parallel axes only (ZeRO/FSDP gathered)."""
        return _spec(self._model_parallel(axes, shape))

    def _model_parallel(self, axes: LogicalAxes, shape: tuple[int, ...]) -> list[tuple[str, ...]]:
        if len(axes) != len(shape):
            raise ValueError(f"logical axes {axes} do not match shape {shape}")
        return [self.param_table.get(d, ()) if d is not None else () for d in axes]

    def activation_spec(self, axes: LogicalAxes) -> PartitionSpec:
        used: set[str] = set()
        entries = []
        for d in axes:
            mesh_axes = tuple(a for a in self.activation_table.get(d, ()) if a not in used)
            used.update(mesh_axes)
            entries.append(mesh_axes)
        return _spec(entries)

    # ---- shardings ------------------------------------------------------------------------
    def named(self, spec: PartitionSpec) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def batch_sharding(self, ndim: int = 2) -> NamedSharding:
        """Token batches ``[batch, length, ...]``: rows over the batch axes."""
        return self.named(self.activation_spec((Dim.BATCH,) + (None,) * (ndim - 1)))

    def param_specs(self, axes_tree: Any, shapes_tree: Any,
                    kind: StateKind = StateKind.PARAMS) -> Any:
        return jax.tree.map(lambda ax, x: self.param_spec(ax, tuple(x.shape), kind),
                            axes_tree, shapes_tree, is_leaf=_is_axes)

    def param_shardings(self, axes_tree: Any, shapes_tree: Any,
                        kind: StateKind = StateKind.PARAMS) -> Any:
        return jax.tree.map(self.named, self.param_specs(axes_tree, shapes_tree, kind),
                            is_leaf=lambda x: isinstance(x, PartitionSpec))

    def check_batch(self, rows: int, label: str | None = None) -> None:
        """One clear error if ``rows`` sequences cannot be split over the batch axes."""
        n = self.size(self.batch_axes)
        if rows % n:
            axes = ",".join(f"{a}={self.sizes[a]}" for a in self.batch_axes)
            raise ConfigError(f"{label or f'--batch-size {rows}'} is not divisible by the "
                              f"batch-sharding axes ({axes}: {n} shards)")


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and all(d is None or isinstance(d, str) for d in x)


# ---- the active rules while a step is traced ----------------------------------------------
_ACTIVE: contextvars.ContextVar[ShardingRules | None] = contextvars.ContextVar(
    "jaxshard_rules", default=None)


@contextlib.contextmanager
def use_rules(rules: ShardingRules | None) -> Iterator[None]:
    token = _ACTIVE.set(rules)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, axes: LogicalAxes) -> jax.Array:
    """Lay out activation ``x`` (dims named ``axes``) by the active rules."""
    rules = _ACTIVE.get()
    if rules is None:
        return x
    return jax.lax.with_sharding_constraint(x, rules.named(rules.activation_spec(axes)))


def for_compute(params: Any, axes_tree: Any) -> Any:
    """Params as a layer uses them. Under FSDP/ZeRO-3 this is the all-gather of the weights;
    in the backward pass its transpose reduce-scatters their gradient."""
    rules = _ACTIVE.get()
    if rules is None:
        return params
    return jax.tree.map(
        lambda x, ax: jax.lax.with_sharding_constraint(
            x, rules.named(rules.compute_param_spec(ax, tuple(x.shape)))),
        params, axes_tree)
