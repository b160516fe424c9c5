"""Logical dims -> mesh axes: the one place where a strategy decides placement.

Two mappings, as in Levanter:

* **at rest** -- how params, grads and optimizer state are stored between steps. ZeRO and
  FSDP live here: the ``fsdp`` axis always shards all three (ZeRO-3); the ``data`` axis shards
  optimizer state from ``--zero 1``, grads from ``--zero 2`` and params from ``--zero 3``.
* **in compute** -- how activations are laid out (``batch`` over the batch axes) and what a
  parameter looks like when a layer uses it (at-rest layout minus the ZeRO/FSDP axes, so FSDP
  all-gathers one layer's weights inside the layer scan, and its transpose reduce-scatters the
  gradient).

Model-parallel axes are the same in both mappings: ``tensor`` splits ``heads``, ``kv_heads``,
``mlp`` and ``vocab`` (Megatron); ``expert`` splits ``experts`` (and the batch elsewhere); ``sequence`` splits the sequence of every activation
(context parallelism); with sequence parallelism ``tensor`` also splits the sequence of the
residual stream between sublayers. A mesh axis that does not divide a dim is left off that
dim (so grouped-query attention with fewer kv heads than ``tensor`` replicates the kv heads);
:meth:`ShardingRules.check_model` turns the cases that cannot be handled into one-line errors.

Model code calls :func:`constrain` and :func:`for_compute`; both read the rules made active
by :func:`use_rules` while the step is traced, and do nothing outside it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterator

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec

from jaxshard import fp8
from jaxshard.axes import BATCH_AXES, Dim, LogicalAxes, MeshAxis
from jaxshard.errors import ConfigError
from jaxshard.options import flag, option, parse_bool

# The name (jax.ad_checkpoint.checkpoint_name) of a ZeRO-3/FSDP weight all-gathered for compute:
# the remat policies keep it for the backward pass or not (``jaxshard.remat``).
GATHERED = "gathered_weights"

# Where offloaded state lives between uses (ZeRO-Offload): page-locked host memory, which the
# device reads and writes by DMA. What ``--offload`` can place there:
HOST_MEMORY = "pinned_host"
OFFLOAD = ("optimizer", "params")

# How context parallelism computes attention (``--context-parallel``).
CONTEXT_PARALLEL = ("ring", "ulysses")

# Dims that ZeRO/FSDP never pick: the layer scan slices ``layers`` one layer at a time, and the
# learned positions are sliced to the sequence length (rows split over devices would move
# between them: collective-permutes, which inside a pipeline stage's embedding deadlock).
_NO_STATE_SHARDING = frozenset({Dim.LAYERS, Dim.POSITION})


class StateKind(Enum):
    """What is stored at rest; the value is the ZeRO stage from which ``data`` shards it."""

    OPT_STATE = 1
    GRADS = 2
    PARAMS = 3


def parse_offload(text: str) -> tuple[str, ...]:
    """``--offload``'s text: none, or a comma-separated subset of :data:`OFFLOAD`."""
    return () if text.strip().lower() == "none" else tuple(o.strip() for o in text.split(","))


def show_offload(offload: tuple[str, ...]) -> str:
    return ",".join(offload) or "none"


@dataclass(frozen=True, slots=True)
class Strategy:
    """What a mesh does beyond its axes: the ZeRO stage over ``data``, FSDP's wrap size, the
    sequence split of tensor parallelism and where ZeRO-3 keeps its gathered weights and its
    state.

    ``fsdp_min_size``: params with fewer elements stay replicated (FSDP's min-params wrap
    policy), so tiny norm scales and biases cost no collective.
    """

    zero: int = option(0, "ZeRO stage over the data axis: 1 shards optimizer state, 2 also grads, "
                          "3 also params (the fsdp axis always shards all three)", choices=(0, 1, 2, 3))
    fsdp_min_size: int = option(0, "params with fewer elements stay replicated under ZeRO/FSDP")
    sequence_parallel: bool = option(
        False, "with tensor > 1: split the residual stream's sequence over tensor (the block "
               "all-reduces become reduce-scatter + all-gather)")
    # How context parallelism runs attention over the split sequence (parallel.attention): a
    # ring passing key/value chunks, or Ulysses' all-to-alls trading the sequence split for a
    # head split around a whole-sequence attention.
    context_parallel: str = option(
        "ring", "with sequence > 1: ring (key/value chunks passed around the devices, the causal "
                "work balanced) or ulysses (all-to-all to a head split around whole-sequence "
                "attention; heads divisible by sequence)", choices=CONTEXT_PARALLEL)
    # ZeRO-3/FSDP: drop a layer's gathered weights after its forward and gather them again for
    # its backward (PyTorch FSDP's default); False keeps them (one gather fewer, more memory).
    reshard_after_forward: bool = option(
        True, "ZeRO-3/FSDP: gather each layer's weights again for its backward pass instead of "
              "keeping all gathered layers from the forward pass", parse=parse_bool, metavar="true|false",
        group="memory")
    # State kept in host memory between uses (ZeRO-Offload): "optimizer" (Adam's moments and the
    # float32 master copy), "params" (ZeRO-3/FSDP's sharded params).
    offload: tuple[str, ...] = option(
        (), "ZeRO-Offload: keep state in host memory between uses: optimizer (Adam's moments and "
            "the float32 master copy), params (ZeRO-3/FSDP's shards), optimizer,params, or none",
        parse=parse_offload, show=show_offload, group="memory")

    def __post_init__(self) -> None:
        unknown = [o for o in self.offload if o not in OFFLOAD]
        if unknown or len(set(self.offload)) != len(self.offload):
            raise ConfigError(f"{flag(Strategy, 'offload')} takes none or a comma-separated subset of "
                              f"{', '.join(OFFLOAD)}, got {','.join(self.offload)}")
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"{flag(Strategy, 'zero')} must be 0, 1, 2 or 3, got {self.zero}")
        if self.context_parallel not in CONTEXT_PARALLEL:
            raise ConfigError(f"{flag(Strategy, 'context_parallel')} must be one of "
                              f"{', '.join(CONTEXT_PARALLEL)}, got {self.context_parallel}")
        if self.fsdp_min_size < 0:
            raise ConfigError(f"{flag(Strategy, 'fsdp_min_size')} must be >= 0, got {self.fsdp_min_size}")


def _spec(entries: list[tuple[str, ...]]) -> PartitionSpec:
    return PartitionSpec(*(None if not e else e[0] if len(e) == 1 else e for e in entries))


class ShardingRules:
    """The rules table of one (mesh, strategy): specs and shardings for any pytree."""

    def __init__(self, mesh: jax.sharding.Mesh, strategy: Strategy = Strategy()):
        self.mesh = mesh
        self.strategy = strategy
        self.sizes = {str(a): int(s) for a, s in mesh.shape.items()}
        self._batch_axes = self.active_axes(BATCH_AXES)
        tensor = self.active_axes((MeshAxis.TENSOR,))
        sequence = self.active_axes((MeshAxis.SEQUENCE,))
        if strategy.sequence_parallel and not tensor:
            raise ConfigError("--sequence-parallel needs a tensor axis of size > 1 in --mesh")
        if strategy.context_parallel != "ring" and not sequence:
            raise ConfigError(f"--context-parallel {strategy.context_parallel} needs a sequence axis of "
                              "size > 1 in --mesh")
        if strategy.zero and self.sizes[MeshAxis.DATA] == 1:
            raise ConfigError(f"--zero {strategy.zero} shards state over the data axis, which --mesh does "
                              "not split (an fsdp axis shards params, grads and optimizer state already)")
        if strategy.fsdp_min_size and not self.state_axes(StateKind.OPT_STATE):
            raise ConfigError("--fsdp-min-size keeps small params out of ZeRO/FSDP sharding; this mesh "
                              "and --zero shard no state (add an fsdp axis or --zero)")
        if not strategy.reshard_after_forward and not self.gathers_params:
            raise ConfigError("--reshard-after-forward false applies to ZeRO-3/FSDP only (an fsdp "
                              "axis of size > 1 or --zero 3); this strategy gathers no weights")
        if "params" in strategy.offload and not self.gathers_params:
            raise ConfigError("--offload params keeps ZeRO-3/FSDP's sharded params on the host between "
                              "uses; this strategy does not shard params (use an fsdp axis or "
                              "--zero 3, or --offload optimizer)")
        if strategy.offload:
            check_host_memory(mesh, "--offload")
        # logical param dim -> model-parallel mesh axes (kept in compute, unlike ZeRO/FSDP)
        # (``stage`` splits the layer stack into pipeline stages, at rest and in compute.)
        self.param_table: dict[Dim, tuple[str, ...]] = {
            Dim.HEADS: tensor, Dim.KV_HEADS: tensor, Dim.MLP: tensor, Dim.VOCAB: tensor,
            Dim.LAYERS: self.active_axes((MeshAxis.STAGE,)), Dim.EXPERTS: self.active_axes((MeshAxis.EXPERT,))}
        # logical activation dim -> mesh axes
        self.activation_table: dict[Dim, tuple[str, ...]] = {
            Dim.BATCH: self._batch_axes,
            Dim.LENGTH: sequence,
            Dim.RESIDUAL_LENGTH: sequence + (tensor if strategy.sequence_parallel else ()),
            Dim.ACT_HEADS: tensor, Dim.ACT_KV_HEADS: tensor, Dim.ACT_MLP: tensor,
            Dim.ACT_VOCAB: tensor}

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The axes that split the batch (size > 1, outermost first), less those of the manual
        region being traced, inside which each device holds its own rows."""
        manual = self.manual_axes
        return tuple(a for a in self._batch_axes if a not in manual)

    @property
    def all_batch_axes(self) -> tuple[str, ...]:
        """The axes that split the batch, manual ones included."""
        return self._batch_axes

    @property
    def manual_axes(self) -> frozenset[str]:
        """The axes of the manual region being traced (a pipeline stage's), if any."""
        context = jax.sharding.get_abstract_mesh()
        return frozenset() if context.empty else frozenset(map(str, context.manual_axes))

    @property
    def manual_token_axes(self) -> tuple[str, ...]:
        """The axes of the manual region being traced that split the tokens (batch or length):
        each device holds its own rows of every activation."""
        tokens = {*self._batch_axes, *self.activation_table.get(Dim.LENGTH, ())}
        return tuple(a for a in self.mesh.axis_names if a in self.manual_axes and a in tokens)

    @property
    def manual_stack_axes(self) -> tuple[str, ...]:
        """The axes of the manual region being traced that split the layer stack (``stage``):
        each device runs its own layers, none of whose tensors the axis splits."""
        return tuple(a for a in self.manual_axes if a == str(MeshAxis.STAGE))

    def active_axes(self, axes) -> tuple[str, ...]:
        """The axes of ``axes`` (names or MeshAxis) with size > 1, in mesh nesting order."""
        wanted = {str(a) for a in axes}
        return tuple(a for a in self.mesh.axis_names if a in wanted and self.sizes[a] > 1)

    def size(self, axes: tuple[str, ...]) -> int:
        return math.prod(self.sizes[a] for a in axes)

    # ---- naming ---------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """Short strategy name for reports, e.g. ddp, zero2, fsdp, hsdp+zero1, fsdp+tp+sp+cp."""
        data, fsdp, zero = self.sizes[MeshAxis.DATA], self.sizes[MeshAxis.FSDP], self.strategy.zero
        parts = []
        if fsdp > 1:
            parts.append("hsdp" if data > 1 else "fsdp")
            if data > 1 and zero:
                parts.append(f"zero{zero}")
        elif data > 1:
            parts.append(f"zero{zero}" if zero else "ddp")
        if self.sizes[MeshAxis.TENSOR] > 1:
            parts.append("tp+sp" if self.strategy.sequence_parallel else "tp")
        if self.sizes[MeshAxis.SEQUENCE] > 1:
            parts.append("cp" if self.strategy.context_parallel == "ring" else "cp-ulysses")
        if self.sizes[MeshAxis.STAGE] > 1:
            parts.append("pp")
        if self.sizes[MeshAxis.EXPERT] > 1:
            parts.append("ep")
        return "+".join(parts) or "single"

    @property
    def gathers_params(self) -> bool:
        """Params are stored sharded over ZeRO-3/FSDP axes and gathered where they are used."""
        return bool(self.state_axes(StateKind.PARAMS))

    @property
    def relayouts_weights(self) -> bool:
        """A layer uses its weights as a copy of their own (:func:`for_compute`): gathered, or
        with the gradient reduce-scattered into its ZeRO-2 shard where it is made."""
        return bool(self.state_axes(StateKind.GRADS))

    @property
    def reduced_into(self) -> StateKind:
        """The layout a step reduces the gradients into: their own at rest, or under ZeRO-1 the
        optimizer's shard, which is all each device updates (a reduce-scatter where DDP
        all-reduces)."""
        return StateKind.OPT_STATE if self.strategy.zero == 1 else StateKind.GRADS

    def offloaded(self, kind: StateKind) -> bool:
        """State of ``kind`` lives in host memory between steps (``--offload``)."""
        return {StateKind.OPT_STATE: "optimizer", StateKind.PARAMS: "params"}.get(kind) in self.strategy.offload

    # ---- at rest --------------------------------------------------------------------------
    def state_axes(self, kind: StateKind) -> tuple[str, ...]:
        """Mesh axes that shard state of ``kind`` beyond the model-parallel axes, major first.

        ``fsdp`` comes before ``data``: a ZeRO shard over (fsdp, data) is then a slice of the
        device's own fsdp shard of the params, so updating it moves nothing (data-major order
        would make every update a collective-permute of the gradients).
        """
        axes = [a for a in (MeshAxis.FSDP,) if self.sizes[a] > 1]
        if self.strategy.zero >= kind.value and self.sizes[MeshAxis.DATA] > 1:
            axes.append(MeshAxis.DATA)
        return tuple(str(a) for a in axes)

    def param_spec(self, axes: LogicalAxes, shape: tuple[int, ...],
                   kind: StateKind = StateKind.PARAMS) -> PartitionSpec:
        """At-rest spec of one parameter (or its grad / optimizer moment)."""
        entries = self._model_parallel(axes, shape)
        state = self.state_axes(kind)
        if state and math.prod(shape) >= self.strategy.fsdp_min_size:
            # Shard on one dim: the first that divides (see _state_dim). If none divides by
            # all state axes, drop the ZeRO `data` axis, then `fsdp`.
            for k in range(len(state), 0, -1):
                dim = self._state_dim(axes, shape, entries, self.size(state[:k]))
                if dim is not None:
                    entries[dim] = entries[dim] + state[:k]
                    break
        return _spec(entries)

    def _state_dim(self, axes, shape, entries, n: int) -> int | None:
        """The major-most dim that ``n`` more shards divide, preferring one no model-parallel
        axis splits. A row-major array split on its leading dim is gathered, and its gradient
        reduce-scattered, in contiguous blocks; split on a minor dim, each side needs a
        transpose (on XLA:CPU they cost 5% of an FSDP step of llama-tiny, whose output
        projections were split on their last, ``embed``, dim). On a dim ``tensor`` splits too,
        the partitioner moves more bytes under sequence parallelism."""
        ok = [i for i, d in enumerate(axes)
              if d not in _NO_STATE_SHARDING and shape[i] % (self.size(entries[i]) * n) == 0]
        free = [i for i in ok if not entries[i]]
        return (free or ok or [None])[0]

    # ---- in compute -----------------------------------------------------------------------
    def compute_param_spec(self, axes: LogicalAxes, shape: tuple[int, ...]) -> PartitionSpec:
        """A parameter as a layer uses it: model-parallel axes only (ZeRO/FSDP gathered)."""
        return _spec(self._model_parallel(axes, shape))

    def _model_parallel(self, axes: LogicalAxes, shape: tuple[int, ...]) -> list[tuple[str, ...]]:
        if len(axes) != len(shape):
            raise ValueError(f"logical axes {axes} do not match shape {shape}")
        return [self._dividing(self.param_table.get(d, ()), n) for d, n in zip(axes, shape)]

    def _dividing(self, mesh_axes: tuple[str, ...], n: int | None) -> tuple[str, ...]:
        """The mesh axes that can split a dim of size ``n`` (all of them, or none)."""
        return mesh_axes if n is None or n % self.size(mesh_axes) == 0 else ()

    def activation_spec(self, axes: LogicalAxes, shape: tuple[int, ...] | None = None) -> PartitionSpec:
        """Spec of an activation with dims ``axes``; with ``shape``, axes that do not divide a
        dim are left off it (e.g. kv heads fewer than ``tensor``)."""
        used: set[str] = set(self.manual_axes)  # inside a manual region: the device's own
        entries = []
        for i, d in enumerate(axes):
            mesh_axes = tuple(a for a in self.activation_table.get(d, ()) if a not in used)
            mesh_axes = self._dividing(mesh_axes, None if shape is None else shape[i])
            used.update(mesh_axes)
            entries.append(mesh_axes)
        return _spec(entries)

    def param_mesh_axes(self, dim: Dim) -> tuple[str, ...]:
        """Model-parallel mesh axes (size > 1) that split parameter dim ``dim``."""
        return self.param_table.get(dim, ())

    def activation_mesh_axes(self, dim: Dim) -> tuple[str, ...]:
        return self.activation_table.get(dim, ())

    # ---- shardings ------------------------------------------------------------------------
    @property
    def context_mesh(self) -> Any:
        """The mesh to lay out and ``shard_map`` over here: inside a region manual over some
        axes (a pipeline stage) the context's abstract mesh, which marks them manual; else the
        rules' mesh."""
        context = jax.sharding.get_abstract_mesh()
        return context if not context.empty and context.manual_axes else self.mesh

    def named(self, spec: PartitionSpec) -> NamedSharding:
        return NamedSharding(self.context_mesh, spec)

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def batch_sharding(self) -> NamedSharding:
        """Token batches ``[batch, length]``: rows over the batch axes, sequence over ``sequence``."""
        return self.named(self.activation_spec((Dim.BATCH, Dim.LENGTH)))

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
        n = self.size(self._batch_axes)
        if rows % n:
            axes = ",".join(f"{a}={self.sizes[a]}" for a in self._batch_axes)
            raise ConfigError(f"{label or f'--batch-size {rows}'} is not divisible by the "
                              f"batch-sharding axes ({axes}: {n} shards)")


    def check_model(self, axes_tree: Any, shapes_tree: Any) -> None:
        """One clear error for a param dim that a model-parallel axis cannot split.

        Kv heads fewer than ``tensor`` are replicated (each device holds the kv heads its query
        heads use); every other mapped dim must divide.
        """
        flat_axes = jax.tree.leaves(axes_tree, is_leaf=_is_axes)
        expert = self.active_axes((MeshAxis.EXPERT,))
        if expert and not any(Dim.EXPERTS in ax for ax in flat_axes):
            raise ConfigError(f"--mesh expert={self.size(expert)} splits the experts of MoE layers, and "
                              "this model has none (add --moe-experts E)")
        for ax, x in zip(flat_axes, jax.tree.leaves(shapes_tree)):
            for d, n in zip(ax, x.shape):
                mesh_axes = self.param_table.get(d, ()) if d is not None else ()
                size = self.size(mesh_axes)
                if n % size == 0 or (d == Dim.KV_HEADS and size % n == 0):
                    continue
                split = ",".join(f"{a}={self.sizes[a]}" for a in mesh_axes)
                hint = " (use a vocab multiple: --vocab-multiple)" if d == Dim.VOCAB else ""
                raise ConfigError(f"{d} ({n}) is not divisible by {split}{hint}")

    def check_seq_len(self, seq_len: int) -> None:
        for dim in (Dim.LENGTH, Dim.RESIDUAL_LENGTH):
            mesh_axes = self.activation_table[dim]
            if seq_len % self.size(mesh_axes):
                split = "x".join(f"{a}={self.sizes[a]}" for a in mesh_axes)
                why = " (sequence parallelism splits the sequence over tensor too)" \
                    if dim == Dim.RESIDUAL_LENGTH else ""
                raise ConfigError(f"--seq-len {seq_len} is not divisible by {split}{why}")


def check_host_memory(mesh: Any, flag: str) -> None:
    """``flag`` needs a host memory space the devices can address (an abstract mesh, as the
    planner uses, has no devices to ask)."""
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return
    device = next(iter(mesh.devices.flat))
    kinds = {m.kind for m in device.addressable_memories()}
    if HOST_MEMORY not in kinds:
        raise ConfigError(f"{flag} needs {HOST_MEMORY} memory, which {device.platform} devices do not "
                          f"have (they have: {', '.join(sorted(kinds))})")


def on_host(shardings: Any) -> Any:
    """The same shardings in host memory."""
    return jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY), shardings)


def entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one entry of a spec (None, a name or a tuple of names), in order."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spec_axes(spec: PartitionSpec) -> set[str]:
    """The mesh axes a spec mentions."""
    return {a for e in spec for a in entry_axes(e)}


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


def active() -> ShardingRules | None:
    """The rules of the step being traced, or None (plain single-device semantics)."""
    return _ACTIVE.get()


def constrain(x: jax.Array, axes: LogicalAxes) -> jax.Array:
    """Lay out activation ``x`` (dims named ``axes``) by the active rules."""
    rules = _ACTIVE.get()
    if rules is None:
        return x
    return jax.lax.with_sharding_constraint(x, rules.named(rules.activation_spec(axes, x.shape)))


def relayout(x: jax.Array, src: LogicalAxes, dst: LogicalAxes) -> jax.Array:
    """Move activation ``x`` from layout ``src`` to ``dst``, and its gradient back to ``src``.

    A plain constraint to ``dst`` leaves the backward layout to the partitioner, which may
    all-reduce a whole activation gradient where a reduce-scatter into ``src`` suffices (it
    does so under sequence parallelism, to compute a norm's bias gradient from the full
    array). Here the gradient is constrained to ``src`` explicitly: the transpose of an
    all-gather is a reduce-scatter.
    """
    rules = _ACTIVE.get()
    if rules is None:
        return x
    return _relayout(x, rules.named(rules.activation_spec(src, x.shape)),
                     rules.named(rules.activation_spec(dst, x.shape)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _relayout(x, src, dst):
    return jax.lax.with_sharding_constraint(x, dst)


def _relayout_fwd(x, src, dst):
    return jax.lax.with_sharding_constraint(x, dst), None


def _relayout_bwd(src, dst, _, g):
    return (jax.lax.with_sharding_constraint(g, src),)


_relayout.defvjp(_relayout_fwd, _relayout_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather(x, src, dst):
    """A ZeRO-3/FSDP weight gathered for compute. The name sits inside the custom_vjp so that
    the remat policies see it on the one equation that makes the gathered copy
    (``jaxshard.remat.is_gathered``) and can keep it or not."""
    return checkpoint_name(jax.lax.with_sharding_constraint(x, dst), GATHERED)


_gather.defvjp(lambda x, src, dst: (_gather(x, src, dst), None), _relayout_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_fp8(x, src, dst):
    """:func:`_gather` of a weight that a float8 matmul takes with a tensorwise scale
    (``--fp8 tensorwise``), as torchtitan's float8 all-gather: quantised to e4m3 where it rests
    with its whole tensor's scale (the partitioner reduces the amax over the shards), gathered
    as float8 (1 byte an element), and multiplied back by the scale. The matmul's own
    quantisation then finds the same amax and gives back the same float8 values. The gradient
    passes straight through, reduce-scattered as :func:`_gather`'s."""
    scale = fp8.scale_from_amax(fp8.amax(x), fp8.E4M3)
    # Quantised where it rests (pinned there, or the partitioner gathers the wider input).
    resting = jax.lax.with_sharding_constraint(fp8.quantize(x, scale, fp8.E4M3), src)
    gathered = jax.lax.with_sharding_constraint(resting, dst)
    return checkpoint_name(fp8.dequantize(gathered, scale, x.dtype), GATHERED)


_gather_fp8.defvjp(lambda x, src, dst: (_gather_fp8(x, src, dst), None), _relayout_bwd)


def for_compute(params: Any, axes_tree: Any, fp8_recipe: str | None = None) -> Any:
    """Params as a layer uses them: ZeRO-3/FSDP all-gather the weights here, and the gradient
    is reduce-scattered straight into its at-rest layout (DDP/ZeRO-1: all-reduced), where the
    layer's backward pass produces it. ``fp8_recipe``: the layer's float8 recipe (``--fp8``);
    the params :func:`jaxshard.fp8.gathers_as_float8` names are gathered as float8
    (:func:`_gather_fp8`)."""
    rules = _ACTIVE.get()
    if rules is None:
        return params

    experts_split = bool(rules.param_mesh_axes(Dim.EXPERTS))

    def gather(x, ax):
        if experts_split and Dim.EXPERTS in ax:
            return x  # split over `expert`: gathered inside the dispatch (parallel.experts)
        shape = tuple(x.shape)
        at_rest = rules.param_spec(ax, shape, StateKind.PARAMS)
        compute = rules.compute_param_spec(ax, shape)
        grads = rules.named(rules.param_spec(ax, shape, StateKind.GRADS))
        if at_rest == compute == grads.spec:
            # Nothing to move either way. (A constraint here would make the layer's weights a
            # value of their own, which autodiff saves as a stacked copy for the backward scan.)
            return x
        # Gathered (ZeRO-3/FSDP), or with a gradient reduce-scattered where it is made (ZeRO-2):
        # a named copy that the remat policies need not save (jaxshard.remat).
        if fp8.gathers_as_float8(fp8_recipe, ax) and compute != at_rest:
            return _gather_fp8(x, grads, rules.named(compute))
        return _gather(x, grads, rules.named(compute))

    return jax.tree.map(gather, params, axes_tree)
