"""Local SGD (``--sync-every H``): data-parallel replicas that step on their own rows and are
averaged every H steps.

Each replica (one per device of ``data``, R of them) keeps its own params and AdamW state and
steps on its own rows' mean gradient. Every H-th step -- steps H, 2H, ... counting from 1, i.e.
where ``(step + 1) % H == 0`` -- synchronises: the replicas' params and optimizer moments are
averaged over ``data`` (pmean), the gradient at the averaged params is all-reduced as in DDP,
and every replica applies the same update. H = 1 is DDP: every step synchronises, replicas that
start equal stay equal, so no averaging is compiled and the step is DDP's (up to the order of
the gradient reduction). H > 1 leaves H - 1 local steps between synchronisations, each with no
collective but the loss's two scalars (and the spread's, below).

The state is a proper array per replica: params and optimizer state carry a leading replica dim
of size R sharded over ``data`` (each device holds its replica's full params, the memory of
DDP). The step is one ``shard_map`` manual over ``data``; the synchronisation is a
``lax.cond`` on the step counter, so its all-reduces (3 x params for params and moments, 1 x
for the gradients) run on synchronising steps only (the compiled HLO shows them in a
conditional's branch).

Metrics: ``loss`` (the mean over the whole batch), ``grad_norm`` (on synchronising steps the
norm of the averaged gradient, as DDP reports it; on local steps the replicas' mean of their own
gradients' norms, each clipped by its own), ``lr``, ``synced`` (1 on synchronising steps) and
``replica_spread``: the largest absolute difference between two replicas over all params, of the
params the step starts from (before any averaging), so it is 0 on the first step after a
synchronisation and grows over the local steps. Measuring it costs an all-reduce (max) of twice
the params every step; ``measure_spread=False`` leaves it out.

Checkpoints hold every replica, so a resume on a mesh with the same ``data`` size continues
exactly; another ``data`` size cannot restore the state (see :func:`check_restore`). The
replicas' average (:func:`consensus`) is what evaluation, exports and samples use, and what
generation and the checkpoint converter read from such a checkpoint (:func:`saved_replicas`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxshard import runtime
from jaxshard.axes import MeshAxis
from jaxshard.errors import ConfigError
from jaxshard.model import LanguageModel
from jaxshard.pytree import cast_floats
from jaxshard.rules import ShardingRules, use_rules
from jaxshard.training import optim
from jaxshard.training.state import StateLayout, TrainState, fresh_state, state_layout
from jaxshard.training.step import Program, StepConfig

DATA = str(MeshAxis.DATA)


@dataclass(frozen=True)
class LocalSGDProgram(Program):
    """A :class:`~jaxshard.training.step.Program` whose params and optimizer state hold one replica
    per device of ``data`` (leading dim ``replicas``)."""

    sync_every: int = 1
    replicas: int = 1  # (model_shardings: those of params without the replica dim, what ``consensus`` returns)


def check(model: LanguageModel, rules: ShardingRules, cfg: StepConfig, sync_every: int) -> None:
    """One-line errors for what ``--sync-every`` does not cover."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ConfigError(f"--sync-every must be an integer >= 1, got {sync_every!r}")
    others = {a: n for a, n in rules.mesh.shape.items() if a != DATA and n > 1}
    if others:
        raise ConfigError(f"--sync-every averages replicas over data only; the mesh also has "
                          f"{', '.join(f'{a}={n}' for a, n in others.items())} (every other axis must be 1)")
    if rules.strategy.zero or rules.strategy.offload:
        raise ConfigError("--sync-every keeps a whole replica per device: not with --zero or --offload")
    if cfg.grad_accum > 1:
        raise ConfigError("--sync-every steps once per batch: not with --grad-accum > 1")
    pipeline = (cfg.pipeline_schedule, cfg.microbatches, cfg.virtual_stages, cfg.stage_layers, cfg.balance)
    if any(x is not None for x in pipeline):
        raise ConfigError("--sync-every has no pipeline: not with --pipeline-schedule, --microbatches, "
                          "--virtual-stages, --stage-layers or --balance")
    if model.moe_layers:
        raise ConfigError("--sync-every covers dense models (this one has MoE layers)")
    if getattr(model.cfg, "fp8", None):
        raise ConfigError("--sync-every with --fp8 is not implemented (a replica's amaxes would be maxed over "
                          "the replicas in every matmul: the communication local SGD leaves out)")
    if cfg.param_dtype != "float32" or cfg.scaled:
        raise ConfigError("--sync-every needs float32 params and no loss scaling "
                          "(--param-dtype float32, --compute-dtype float32 or bfloat16)")
    if cfg.reducer != "gspmd":
        raise ConfigError("--sync-every reduces the gradients itself: not with --strategy explicit")


def build_local_sgd_program(model: LanguageModel, rules: ShardingRules, optim_cfg: optim.OptimConfig,
                            step_cfg: StepConfig, sync_every: int, *,
                            measure_spread: bool = True) -> LocalSGDProgram:
    """The program of local SGD averaging every ``sync_every`` steps (1: DDP)."""
    check(model, rules, step_cfg, sync_every)
    rules.check_model(model.param_axes(), model.abstract_params())
    H, mesh = sync_every, rules.mesh
    R = mesh.shape[DATA]
    tx = optim.make(optim_cfg, model.param_axes(), optim.router_bias_rate(model))
    lr_schedule = optim.schedule(optim_cfg)
    dtype = jnp.dtype(step_cfg.compute_dtype)
    one = state_layout(model, tx, rules)  # one replica's state, as DDP lays it out
    layout = _replica_layout(one.abstract, mesh, R)
    replicated = rules.replicated()
    batch_sharding = rules.batch_sharding()

    def local_sums(params, batch, key):
        """This device's rows' loss sums at its replica's params (inside the manual region)."""
        with use_rules(None):
            return model.loss(cast_floats(params, dtype), batch["inputs"], batch["targets"], key=key)

    grad_fn = jax.grad(lambda p, b, k: (lambda s: (s.total, s))(local_sums(p, b, k)), has_aux=True)

    def replica_key(step):
        # Each replica its own dropout masks (GSPMD DDP draws one mask for the global batch, so
        # with dropout the two are not comparable step by step).
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(step_cfg.seed), step),
                                  jax.lax.axis_index(DATA))

    def replica_step(step, params, opt_state, batch):
        """One device: its replica (the leading dim of size 1 dropped) and its rows."""
        params, opt_state = jax.tree.map(lambda x: x[0], (params, opt_state))
        sync = (step + 1) % H == 0
        metrics = {"lr": lr_schedule(step), "synced": sync.astype(jnp.int32)}
        if measure_spread:
            metrics["replica_spread"] = _spread(params)
        if H > 1:  # with H = 1 the replicas are equal already (see unsaved below)
            params, opt_state = jax.lax.cond(sync, _average, lambda t: t, (params, opt_state))
        grads, sums = grad_fn(params, batch, replica_key(step))
        tokens = jax.lax.psum(sums.tokens, DATA)
        metrics["loss"] = jax.lax.psum(sums.nll, DATA) / tokens

        def synced(grads):
            """DDP: the gradient of the whole batch's mean loss, the same on every replica."""
            grads = jax.tree.map(lambda g: jax.lax.psum(g, DATA) / tokens, grads)
            norm = optim.global_norm(optim.without_router_bias(grads))
            return _varying((grads, norm)), norm  # (psum's results are the same on every replica)

        def local(grads):
            """This replica's rows' mean gradient, clipped by its own norm."""
            grads = jax.tree.map(lambda g: g / sums.tokens, grads)
            norm = optim.global_norm(optim.without_router_bias(grads))
            return (grads, norm), jax.lax.pmean(norm, DATA)

        (grads, own_norm), metrics["grad_norm"] = synced(grads) if H == 1 else \
            jax.lax.cond(sync, synced, local, grads)
        grads = optim.clip(grads, own_norm, optim_cfg.grad_clip)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optim.apply(params, updates, opt_state)
        return *jax.tree.map(lambda x: x[None], (params, opt_state)), metrics

    run_replicas = jax.shard_map(replica_step, mesh=mesh, axis_names=frozenset({DATA}),
                                 in_specs=(P(), P(DATA), P(DATA), P(DATA)),
                                 out_specs=(P(DATA), P(DATA), P()))

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        params, opt_state, metrics = run_replicas(state.step, state.params, state.opt_state, batch)
        return TrainState(state.step + 1, params, opt_state, None), metrics

    def loss(params, batch, key):
        """The sums over all replicas of their own rows' losses at their own params (the sum
        the step differentiates)."""
        keys = () if key is None else (key,)

        def replica(params, batch, *keys):
            key = jax.random.fold_in(keys[0], jax.lax.axis_index(DATA)) if keys else None
            sums = local_sums(jax.tree.map(lambda x: x[0], params), batch, key)
            return jax.tree.map(lambda x: jax.lax.psum(x, DATA), sums)

        return jax.shard_map(replica, mesh=mesh, axis_names=frozenset({DATA}), out_specs=P(),
                             in_specs=(P(DATA), P(DATA), *[P()] * len(keys)))(params, batch, *keys)

    def evaluate(params, batch):
        """The mean loss at the replicas' average."""
        with use_rules(rules):
            average = cast_floats(jax.tree.map(_mean_replica, params), dtype)
            sums = model.loss(average, batch["inputs"], batch["targets"])
        return sums.nll / sums.tokens

    def stacked_fresh(params):
        state = fresh_state(tx, params, jnp.float32)
        return state._replace(params=_broadcast(state.params, R), opt_state=_broadcast(state.opt_state, R))

    def equalise(state: TrainState) -> TrainState:
        """Every replica set to the replicas' average (params and moments)."""
        same = lambda x: jnp.broadcast_to(_mean_replica(x), x.shape) if _is_float(x) else x  # noqa: E731
        return state._replace(params=jax.tree.map(same, state.params), opt_state=jax.tree.map(same, state.opt_state))

    # H = 1 compiles no averaging, so a state whose replicas differ (a checkpoint of an H > 1
    # run saved between synchronisations) is made equal once, when it is restored. The average
    # of equal replicas is exact (see _mean_replica), so an H = 1 resume stays exact.
    unsaved = jax.jit(equalise, out_shardings=layout.shardings) if H == 1 else (lambda state: state)
    options = runtime.xla_options()
    return LocalSGDProgram(
        rules=rules, layout=layout, batch_sharding=batch_sharding,
        init=jax.jit(lambda seed: stacked_fresh(model.init(jax.random.key(seed))), out_shardings=layout.shardings),
        step=jax.jit(step, in_shardings=(layout.shardings, batch_sharding),
                     out_shardings=(layout.shardings, replicated), donate_argnums=0, compiler_options=options),
        eval=jax.jit(evaluate, in_shardings=(layout.shardings.params, batch_sharding),
                     out_shardings=replicated, compiler_options=options),
        loss=loss, saved_abstract=layout.abstract, unsaved=unsaved,
        from_params=jax.jit(stacked_fresh, out_shardings=layout.shardings),
        sync_every=H, replicas=R, model_shardings=one.shardings.params)


def consensus(params: Any) -> Any:
    """The replicas' average of replica-stacked ``params``: model-shaped (no replica dim),
    replicated over their mesh. Equal replicas give their value exactly."""
    leaf = jax.tree.leaves(params)[0]
    sharding = getattr(leaf, "sharding", None)
    out = NamedSharding(sharding.mesh, P()) if isinstance(sharding, NamedSharding) else None
    return _consensus(out)(params)


@functools.cache
def _consensus(out: NamedSharding | None):
    return jax.jit(lambda params: jax.tree.map(_mean_replica, params), out_shardings=out)


def check_restore(meta: dict[str, Any], replicas: int) -> None:
    """A checkpoint's state holds one replica per device of the ``data`` it was trained on:
    one line if this program's ``replicas`` differ (``meta``: the checkpoint's record, with
    ``mesh``, its axis sizes)."""
    saved = dict(meta.get("mesh") or {}).get(DATA, 1)
    if saved != replicas:
        raise ConfigError(f"--sync-every: the checkpoint holds {saved} replicas (data={saved}) but this "
                          f"mesh has data={replicas}; resume on data={saved}")


def predicted_collectives(model: LanguageModel, sync_every: int) -> list[dict[str, Any]]:
    """What a step sends per device beyond the loss's scalars, as the report lists it: on a
    synchronising step (``sync_every`` > 1: one in H, inside a conditional) an all-reduce over
    ``data`` of the float32 params, both Adam moments (averaged) and the gradients (summed);
    with H = 1 DDP's gradient all-reduce every step and no averaging."""
    params = 4 * model.n_params()
    if sync_every == 1:
        return [{"kind": "all-reduce", "bytes": params, "when": "every step: the gradients (DDP)"}]
    return [{"kind": "all-reduce", "bytes": 4 * params,
             "when": f"synchronising steps (1 in {sync_every}): params, Adam's two moments, gradients"}]


def saved_replicas(meta: dict[str, Any]) -> int | None:
    """The replicas a checkpoint's params are stacked over (None: not a local-SGD run's), from
    its record (``flags``: the run's flags, ``mesh``: its axis sizes)."""
    if (meta.get("flags") or {}).get("sync_every") is None:
        return None
    return dict(meta.get("mesh") or {}).get(DATA, 1)


def stacked_abstract(abstract: Any, replicas: int) -> Any:
    """Model-shaped abstract params as a local-SGD checkpoint holds them: a leading dim of
    ``replicas``, kept whole on each device (the other dims sharded as given)."""
    def stack(x):
        sharding = NamedSharding(x.sharding.mesh, P(None, *x.sharding.spec))
        return jax.ShapeDtypeStruct((replicas, *x.shape), x.dtype, sharding=sharding)

    return jax.tree.map(stack, abstract)


def average(params: Any, shardings: Any) -> Any:
    """Replica-stacked ``params`` averaged into model-shaped ones laid out as ``shardings``."""
    return jax.jit(lambda p: jax.tree.map(_mean_replica, p), out_shardings=shardings)(params)


def _replica_layout(one: TrainState, mesh: jax.sharding.Mesh, R: int) -> StateLayout:
    """``one`` replica's abstract state, stacked ``R`` times along a leading dim over ``data``."""
    def stack(x):
        return jax.ShapeDtypeStruct((R, *x.shape), x.dtype, sharding=NamedSharding(mesh, P(DATA)))

    abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())),
                          jax.tree.map(stack, one.params), jax.tree.map(stack, one.opt_state), None)
    shardings = jax.tree.map(lambda x: x.sharding, abstract)
    return StateLayout(shardings=shardings, compute=shardings, grad_shardings=shardings.params,
                       reduce_shardings=shardings.params, abstract=abstract)


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _broadcast(tree: Any, R: int) -> Any:
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (R, *jnp.shape(x))), tree)


def _mean_replica(x: jax.Array) -> jax.Array:
    """The mean over the leading (replica) dim, as the first replica plus the mean difference
    from it: exactly the first replica where all are equal (a plain mean may round)."""
    return x[0] + jnp.mean(x - x[0], axis=0)


def _average(tree: Any) -> Any:
    """Inside the manual region: every float leaf averaged over ``data``; counts (equal on
    every replica) unchanged."""
    return jax.tree.map(lambda x: _varying(jax.lax.pmean(x, DATA)) if _is_float(x) else x, tree)


def _varying(tree: Any) -> Any:
    """Values reduced over ``data`` (the same on every device) typed as varying over it, as the
    other branch of a cond gives them."""
    return jax.tree.map(lambda x: jax.lax.pcast(x, DATA, to="varying"), tree)


def _spread(params: Any) -> jax.Array:
    """Inside the manual region: the largest difference between two replicas, over all params
    (max - min as max(x) + max(-x): one all-reduce. A max and a min all-reduce of the same
    operands, beside the two conditionals, made XLA:CPU's executables crash at the first
    synchronisation when loaded from the persistent compilation cache, jaxlib 0.10.2)."""
    leaves = jax.tree.leaves(params)
    highs, lows = jax.lax.pmax((leaves, [-x for x in leaves]), DATA)
    return jnp.max(jnp.stack([jnp.max(h + l) for h, l in zip(highs, lows)]))
