"""One training step: loss and grads (over microbatches), gradient layout, AdamW update.

:func:`build_program` builds the jitted init/step/eval functions and their shardings without
running anything, so tools can ``program.step.lower(...).compile()`` and read the HLO.

Collectives come from the layouts alone: the batch is sharded over ``data``/``fsdp``, each
layer's weights are constrained to their compute layout inside the layer scan (the FSDP
all-gather), grads are constrained to their at-rest layout (all-reduce for DDP and ZeRO-1,
reduce-scatter for ZeRO-2/3), and the updated params to theirs (the ZeRO-1/2 all-gather).

Three kinds of step share the update and differ in how a microbatch's gradients are made and
reduced, each built by its own function and chosen by :func:`_step_kind`: the partitioner's
(:func:`_gspmd`), ``--strategy explicit``'s buckets reduced by hand (:func:`_explicit`), and a
pipeline's tick executor (:func:`_pipelined`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxshard import runtime
from jaxshard.axes import Dim, MeshAxis
from jaxshard.errors import ConfigError
from jaxshard.model import LanguageModel, Stageable
from jaxshard.options import flag, option
from jaxshard.parallel import attention
from jaxshard.parallel import balance as balance_lib
from jaxshard.parallel import pipeline
from jaxshard.parallel.staged import staged
from jaxshard.pytree import cast_floats
from jaxshard.remat import Kind, Remat
from jaxshard.rows import microbatch_rows
from jaxshard.rules import ShardingRules, check_host_memory, constrain, use_rules
from jaxshard.training import loss_scale as scaling
from jaxshard.training import optim
from jaxshard.training import reducer as reducer_lib
from jaxshard.training.state import StateLayout, TrainState, build_init, fresh_state, move, state_layout

DTYPES = ("float32", "bfloat16", "float16")


def parse_counts(text: str) -> tuple[int, ...]:
    """``--stage-layers``' text: comma-separated layer counts."""
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise ConfigError(f"{flag(StepConfig, 'stage_layers')} expects comma-separated layer counts "
                          f"like 3,3,2, got {text!r}") from None


def show_counts(counts: tuple[int, ...] | None) -> str | None:
    return None if counts is None else ",".join(map(str, counts))


@dataclass(frozen=True, slots=True)
class StepConfig:
    grad_accum: int = option(1, "microbatches per step", group="training")
    # Matmuls run in this (norms, softmax and the loss in float32); None: param_dtype.
    compute_dtype: str | None = option(
        None, "dtype of matmuls (norms, softmax and the loss stay float32); float16 adds dynamic "
              "loss scaling", choices=DTYPES, default_text="--param-dtype", group="precision")
    seed: int = option(0, "drives init, data order and dropout", group="training")
    # Params (and so gradients and their collectives) are stored in this; a 2-byte dtype keeps
    # a float32 master copy in the optimizer state.
    param_dtype: str = option(
        "float32", "dtype params and gradients are stored and communicated in; a 2-byte one keeps a "
                   "float32 master copy in the optimizer state (2+2+12 bytes/param)",
        choices=DTYPES, group="precision")
    loss_scale: float = option(2.0 ** 15, "float16: the initial dynamic loss scale", group="precision")
    loss_scale_period: int = option(2000, "float16: finite steps before the loss scale doubles",
                                    group="precision")
    # With a stage axis: the schedule, microbatches per step (None: the stages), chunks per
    # stage (interleaved) and layers per (virtual) stage (None: even).
    pipeline_schedule: str | None = option(
        None, "with a stage axis: naive (one microbatch through the stages in turn), gpipe (all "
              "forwards, then all backwards), 1f1b (one forward and one backward per tick: at most "
              "2 x stages microbatches' activations kept), interleaved (1f1b over --virtual-stages "
              "chunks per stage), zb-h1 (zero bubble: each backward split into the input's and the "
              "weights' gradients, the latter deferred into idle ticks)", metavar="|".join(pipeline.SCHEDULES),
        default_text=pipeline.DEFAULT_SCHEDULE, group="pipeline")
    microbatches: int | None = option(
        None, "with a stage axis: microbatches per step; the bubble is (stages - 1) / (virtual x "
              "microbatches + stages - 1)", default_text="the stages; naive: 1", group="pipeline")
    virtual_stages: int | None = option(
        None, "interleaved: chunks of layers per stage, stage s holding chunks s, s + stages, ...",
        default_text=str(pipeline.DEFAULT_VIRTUAL), group="pipeline")
    stage_layers: tuple[int, ...] | None = option(
        None, "layers of each (virtual) stage in pipeline order, e.g. 3,3,2", parse=parse_counts,
        show=show_counts, metavar="N1,N2,...", default_text="an even split", group="pipeline")
    balance: str | None = option(
        None, "choose --stage-layers so the slowest stage is fastest: from the FLOPs model, or by "
              "timing a layer, the embedding and the head on this machine",
        metavar="|".join(balance_lib.HOW), group="pipeline")
    # Who reduces the gradients (--strategy): the partitioner ('gspmd'), or the step itself in
    # buckets of bucket_mb MB ('explicit': DDP's Reducer by hand, see jaxshard/training/reducer.py).
    reducer: str = option(
        "gspmd", "gspmd: the partitioner places the collectives; explicit: the data-parallel step "
                 "written with shard_map, reducing its gradients itself in buckets like DDP's "
                 "Reducer (an all-reduce per bucket; a reduce-scatter per bucket, explicit ZeRO-2, "
                 "with --zero 1/2; data-only meshes)", flag="--strategy", choices=reducer_lib.REDUCERS,
        group="mesh and strategy")
    bucket_mb: float = option(
        25.0, "--strategy explicit: MB of gradients per bucket, filled in reverse layer order "
              "(DDP's default size)", group="mesh and strategy")

    def __post_init__(self) -> None:
        if self.compute_dtype is None:
            object.__setattr__(self, "compute_dtype", self.param_dtype)
        if self.grad_accum < 1:
            raise ConfigError(f"{flag(StepConfig, 'grad_accum')} must be >= 1, got {self.grad_accum}")
        for name in ("compute_dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ConfigError(f"{flag(StepConfig, name)} must be one of {', '.join(DTYPES)}, "
                                  f"got {getattr(self, name)}")
        if not self.loss_scale > 0 or self.loss_scale_period < 1:
            raise ConfigError(f"{flag(StepConfig, 'loss_scale')} must be > 0 and "
                              f"{flag(StepConfig, 'loss_scale_period')} >= 1")
        if self.balance is not None and self.balance not in balance_lib.HOW:
            raise ConfigError(f"{flag(StepConfig, 'balance')} must be one of {', '.join(balance_lib.HOW)}, "
                              f"got {self.balance!r}")
        if self.balance is not None and self.stage_layers is not None:
            raise ConfigError(f"{flag(StepConfig, 'balance')} chooses {flag(StepConfig, 'stage_layers')}: "
                              "give one of them")
        if self.reducer not in reducer_lib.REDUCERS:
            raise ConfigError(f"{flag(StepConfig, 'reducer')} must be one of {', '.join(reducer_lib.REDUCERS)}, "
                              f"got {self.reducer!r}")
        if not self.bucket_mb > 0:
            raise ConfigError(f"{flag(StepConfig, 'bucket_mb')} must be > 0, got {self.bucket_mb}")

    @property
    def scaled(self) -> bool:
        """float16 anywhere needs dynamic loss scaling (bfloat16 has float32's range)."""
        return "float16" in (self.compute_dtype, self.param_dtype)


@dataclass(frozen=True)
class Program:
    """Everything jitted for one (model, mesh, strategy, optimizer): nothing has run yet."""

    rules: ShardingRules
    layout: StateLayout
    batch_sharding: jax.sharding.NamedSharding
    init: Callable[[int], TrainState]
    step: Callable  # (state, batch) -> (state, metrics); donates state
    eval: Callable  # (params, batch) -> mean loss
    loss: Callable  # (params, batch, key) -> the model's Loss (sums), unjitted, under the rules
    schedule: pipeline.Schedule | None = None  # with a stage axis: the pipeline's
    # Checkpoints and exports hold the layer stack in model order whatever the stage layout:
    # ``saved(state)`` gives that form of a state, ``unsaved`` takes it back, ``saved_abstract``
    # is its shapes and shardings (all three the identity without a stage layout).
    saved: Callable = lambda state: state
    unsaved: Callable = lambda state: state
    saved_abstract: TrainState | None = None
    # A fresh state (step 0) around given params in model order, e.g. imported weights.
    from_params: Callable | None = None
    buckets: list | None = None  # --strategy explicit: the gradient buckets (jaxshard.training.reducer.plan)
    # The shardings of model-shaped params, what ``from_params`` takes (e.g. weights to load
    # into); None: the saved state's params' (local SGD's params carry a replica dim instead).
    model_shardings: Any = None

    def weight_shardings(self) -> Any:
        """Where params in model order go: :attr:`model_shardings`, else the saved params'."""
        if self.model_shardings is not None:
            return self.model_shardings
        return jax.tree.map(lambda x: x.sharding, self.saved_abstract.params)

    def abstract_batch(self, batch_size: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
        x = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=self.batch_sharding)
        return {"inputs": x, "targets": x}

    def lower_step(self, batch_size: int, seq_len: int):
        return self.step.lower(self.layout.abstract, self.abstract_batch(batch_size, seq_len))


def check_batch(rules: ShardingRules, batch_size: int, seq_len: int, grad_accum: int,
                microbatches: int = 1) -> None:
    """Fail early with one line if the batch cannot be split into sharded microbatches
    (``microbatches``: a pipeline's, see :func:`pipeline_schedule`)."""
    rules.check_seq_len(seq_len)
    rules.check_batch(batch_size)
    for flag, n in (("--grad-accum", grad_accum), ("--microbatches", microbatches)):
        if n == 1:
            continue
        if batch_size % n:
            raise ConfigError(f"--batch-size {batch_size} is not divisible by {flag} {n}")
        rules.check_batch(batch_size // n, f"the microbatch of {batch_size // n} "
                          f"(--batch-size {batch_size} / {flag} {n})")


def pipeline_schedule(rules: ShardingRules, model: Stageable, cfg: StepConfig) -> pipeline.Schedule | None:
    """The pipeline schedule a stage axis asks for (None without one); one-line errors for
    what cannot run."""
    plan = _pipeline_plan(rules, model, cfg)
    if plan is None:
        return None
    if cfg.balance is not None and cfg.stage_layers is None:
        raise ConfigError("--balance needs the batch shape: resolve it with balance_stages() first")
    kind, stages, virtual, microbatches = plan
    layout = pipeline.StageLayout.make(model.cfg.n_layers, stages, virtual, cfg.stage_layers)
    slots = pipeline.slot_layout(dict(rules.sizes), pipeline.replica_axes(rules))
    if kind != "zb-h1":
        return pipeline.make_schedule(kind, stages, microbatches, virtual, layout)
    remat, experts = Remat.parse(model.remat), model.cfg.moe_experts > 0
    cap = pipeline.residual_cap(stages, remat, slots, microbatches, experts)
    return dataclasses.replace(pipeline.make_schedule(kind, stages, microbatches, virtual, layout, residual_cap=cap),
                               handover_apart=pipeline.handover_apart(remat, slots, experts))


def balance_stages(model: Stageable, rules: ShardingRules, cfg: StepConfig, batch_size: int,
                   seq_len: int) -> tuple[StepConfig, str]:
    """``cfg`` with ``--balance`` resolved into ``stage_layers``, and a line saying what was
    chosen and each stage's predicted time per microbatch."""
    plan = _pipeline_plan(rules, model, cfg)
    if plan is None:
        raise ConfigError("--balance needs a stage axis of size > 1 in --mesh")
    kind, stages, virtual, microbatches = plan
    if model.moe_layers:
        raise ConfigError("--balance does not model MoE layers yet; give --stage-layers")
    check_batch(rules, batch_size, seq_len, cfg.grad_accum, microbatches)  # before any timing
    rows = batch_size // microbatches // rules.size(rules.batch_axes)
    if cfg.balance == "flops":
        costs = balance_lib.flop_costs(model.cfg, rows, seq_len)
    else:
        costs = balance_lib.profile_costs(model, rows, seq_len, cfg.compute_dtype)
    parts, n_layers = stages * virtual, model.cfg.n_layers
    layers = balance_lib.assign(n_layers, parts, costs)
    loads = [costs.stage(u, parts, n) for u, n in enumerate(layers)]
    line = (f"--balance {cfg.balance}: --stage-layers {','.join(map(str, layers))}, per microbatch "
            + " | ".join(costs.format(x) for x in loads) + f" (slowest {costs.format(max(loads))}")
    if n_layers % parts == 0:
        even = max(costs.stage(u, parts, n_layers // parts) for u in range(parts))
        line += f"; an even split's {costs.format(even)}"
    return dataclasses.replace(cfg, stage_layers=layers, balance=None), line + ")"


def _pipeline_plan(rules: ShardingRules, model: Stageable, cfg: StepConfig) -> tuple[str, int, int, int] | None:
    """(schedule, stages, chunks per stage, microbatches) of a stage axis, None without one."""
    stages = rules.size(rules.active_axes((MeshAxis.STAGE,)))
    if stages == 1:
        for name in ("pipeline_schedule", "microbatches", "virtual_stages", "stage_layers", "balance"):
            if getattr(cfg, name) is not None:
                raise ConfigError(f"{flag(StepConfig, name)} needs a stage axis of size > 1 in --mesh")
        return None
    kind = cfg.pipeline_schedule or pipeline.DEFAULT_SCHEDULE
    if cfg.virtual_stages is not None and kind != "interleaved":
        raise ConfigError(f"--virtual-stages needs --pipeline-schedule interleaved, got {kind}")
    virtual = (cfg.virtual_stages or pipeline.DEFAULT_VIRTUAL) if kind == "interleaved" else 1
    if cfg.grad_accum != 1:
        raise ConfigError("--grad-accum with a stage axis: a pipeline accumulates over its "
                          "microbatches; use --microbatches")
    if rules.activation_mesh_axes(Dim.LENGTH):
        raise ConfigError("a stage axis with context parallelism (sequence > 1) is not implemented yet")
    if rules.strategy.offload:
        raise ConfigError("--offload with a stage axis is not implemented yet")
    if model.moe_layers and len(model.moe_layers) != model.cfg.n_layers:
        raise ConfigError("a stage axis needs every layer of an MoE model to be an MoE layer "
                          "(--moe-every 1, no first dense layers)")
    if Remat.parse(model.remat).kind is Kind.OFFLOAD:
        raise ConfigError("--remat offload with a stage axis is not implemented yet")
    default = 1 if kind == "naive" else stages
    return kind, stages, virtual, default if cfg.microbatches is None else cfg.microbatches


@dataclass(frozen=True)
class _Parts:
    """What every kind of step is built from."""

    model: Stageable  # under a pipeline, staged over the schedule's layout
    rules: ShardingRules
    cfg: StepConfig
    tx: optax.GradientTransformation
    layout: StateLayout
    schedule: pipeline.Schedule | None
    dtype: Any  # the compute dtype
    loss_sums: Callable  # (params, batch, key, under=rules) -> the model's Loss (sums)
    scaled_loss: Callable  # (params, batch, key, factor, under=rules) -> (the scaled total, sums)


@dataclass(frozen=True)
class _StepKind:
    """What one kind of step does its own way: a microbatch's gradients, reduced into the
    layout the update uses, and the evaluation's loss sums."""

    reduced_grads: Callable  # (params, batch, key, factor, micro=(0, 1)) -> (sums, grads)
    eval_sums: Callable  # (params, batch) -> the model's Loss (sums)
    buckets: list | None = None  # Program.buckets
    compiler_options: dict = dataclasses.field(default_factory=dict)  # the step's, beyond runtime's
    saved: dict = dataclasses.field(default_factory=dict)  # Program.saved, unsaved, saved_abstract


def _gspmd(parts: _Parts) -> _StepKind:
    """The partitioner reduces the gradients, constrained to the layout the update uses
    (rules.reduced_into): replicated -> all-reduce; sharded (ZeRO-1's optimizer shard,
    ZeRO-2/3's gradient shard) -> reduce-scatter."""
    grad_fn = jax.grad(parts.scaled_loss, has_aux=True)

    def reduced_grads(params, batch, key, factor, micro=(0, 1)):
        """(the loss's sums, gradients of the total's sum) of microbatch ``micro`` = (index,
        count) of the step's batch."""
        with microbatch_rows(*micro):
            grads, sums = grad_fn(params, batch, key, factor)
        return sums, jax.lax.with_sharding_constraint(grads, parts.layout.reduce_shardings)

    return _StepKind(reduced_grads, eval_sums=functools.partial(parts.loss_sums, key=None))


def _explicit(parts: _Parts) -> _StepKind:
    """``--strategy explicit``: each device's gradients reduced over data by the step itself,
    in buckets (DDP's Reducer by hand, jaxshard/training/reducer.py)."""
    model, rules, layout = parts.model, parts.rules, parts.layout
    reducer_lib.check(rules, model, parts.cfg.grad_accum, parts.schedule)
    buckets = reducer_lib.plan(layout.abstract.params, model.param_axes(), layout.reduce_shardings,
                               parts.cfg.bucket_mb)
    n_data = rules.mesh.shape[reducer_lib.DATA]
    grad_specs = jax.tree.map(lambda s: s.spec, layout.reduce_shardings)

    # One device's program: the region is manual over data.
    local_grad_fn = jax.grad(functools.partial(parts.scaled_loss, under=None), has_aux=True)

    def local_grads(params, batch, key, factor):
        """This device's rows: their loss sums and gradients, reduced over data by hand.
        The params are marked as varying over data: the gradient of a value the same on
        every device would come back already summed (autodiff's own all-reduce)."""
        params = jax.tree.map(lambda x: jax.lax.pcast(x, reducer_lib.DATA, to="varying"), params)
        grads, sums = local_grad_fn(params, batch, key, factor)
        sums = jax.tree.map(lambda x: jax.lax.psum(x, reducer_lib.DATA), sums)
        return sums, reducer_lib.reduce(grads, buckets, n_data)

    def reduced_grads(params, batch, key, factor, micro=(0, 1)):
        """``micro``: (index, count) of the microbatch ``batch`` is (dropout draws its
        rows of the whole batch's mask; here each device its block of them)."""
        index, count = micro
        scale = () if factor is None else (factor,)  # float16's loss scale, when there is one

        def local(p, b, k, i, *f):
            with microbatch_rows(i, count, (reducer_lib.DATA,)):
                return local_grads(p, b, k, *f or (None,))

        return jax.shard_map(local, mesh=rules.mesh, axis_names=frozenset({reducer_lib.DATA}),
                             in_specs=(P(), P(reducer_lib.DATA), P(), P(), *[P()] * len(scale)),
                             out_specs=(P(), grad_specs))(params, batch, key, jnp.asarray(index), *scale)

    return _StepKind(reduced_grads, eval_sums=functools.partial(parts.loss_sums, key=None), buckets=buckets,
                     compiler_options=reducer_lib.COMPILER_OPTIONS)


def _pipelined(parts: _Parts) -> _StepKind:
    """A stage axis: the schedule's tick executor runs the staged model's slots
    (``model.pipeline_grads``); the partitioner reduces the gradients as :func:`_gspmd`'s. The
    evaluation runs the forward slots, so no stage gathers the others' layers."""
    model, rules, schedule, dtype = parts.model, parts.rules, parts.schedule, parts.dtype

    def cast(p):
        return cast_floats(p, dtype)

    def reduced_grads(params, batch, key, factor, micro=(0, 1)):
        """(``micro`` is always the whole batch: the schedule makes its own microbatches.)"""
        sums, grads = model.pipeline_grads(params, batch["inputs"], batch["targets"], schedule, key=key,
                                           seed=1.0 if factor is None else factor, cast=cast)
        return sums, jax.lax.with_sharding_constraint(grads, parts.layout.reduce_shardings)

    def eval_sums(params, batch):
        with use_rules(rules):
            return model.pipeline_loss(params, batch["inputs"], batch["targets"], schedule, cast=cast)

    saved = {} if schedule.layout.trivial else _saved_forms(model, parts.tx, parts.layout)
    return _StepKind(reduced_grads, eval_sums, saved=saved)


def _step_kind(parts: _Parts) -> _StepKind:
    """``--strategy explicit``'s step (which rejects a pipeline), a pipeline's, or the partitioner's."""
    if parts.cfg.reducer == "explicit":
        return _explicit(parts)
    return _gspmd(parts) if parts.schedule is None else _pipelined(parts)


def build_program(model: Stageable, rules: ShardingRules, optim_cfg: optim.OptimConfig,
                  cfg: StepConfig, schedule: pipeline.Schedule | None = None) -> Program:
    """``schedule``: a pipeline schedule of one's own tables, for a stage axis (default: the
    one ``cfg`` asks for)."""
    if schedule is None:
        schedule = pipeline_schedule(rules, model, cfg)  # its errors name the flags
    if schedule is not None:
        model = staged(model, schedule.layout)
    rules.check_model(model.param_axes(), model.abstract_params())
    attention.check_ulysses(model.cfg, rules)
    if model.moe_layers and (rules.activation_mesh_axes(Dim.LENGTH) or rules.strategy.sequence_parallel):
        raise ConfigError("MoE layers with sequence or context parallelism are not implemented yet "
                          "(capacity groups are whole sequences)")
    if Remat.parse(model.remat).kind is Kind.OFFLOAD:
        check_host_memory(rules.mesh, "--remat offload")
    if getattr(model.cfg, "fp8", None) == "delayed" and (cfg.grad_accum > 1 or schedule is not None
                                                          or cfg.reducer != "gspmd"
                                                          or cfg.param_dtype != "float32" or cfg.scaled):
        raise ConfigError("--fp8 delayed takes each step's amaxes from one pass: not yet with --grad-accum, "
                          "a pipeline's microbatches, --strategy explicit, 2-byte --param-dtype or float16")
    tx = optim.make(optim_cfg, model.param_axes(), optim.router_bias_rate(model))
    if cfg.param_dtype != "float32":
        tx = optim.with_master(tx)
    lr_schedule = optim.schedule(optim_cfg)
    initial_scale = cfg.loss_scale if cfg.scaled else None
    layout = state_layout(model, tx, rules, cfg.param_dtype, initial_scale)
    dtype = jnp.dtype(cfg.compute_dtype)
    batch_sharding = rules.batch_sharding()
    rest, compute = layout.shardings, layout.compute

    def loss_sums(params, batch, key, under=rules):
        with use_rules(under):
            # The layers' stacks stay as stored: the model casts one layer at a time.
            outer = cast_floats({k: v for k, v in params.items() if k not in model.stacks}, dtype)
            return model.loss(outer | {k: v for k, v in params.items() if k in model.stacks},
                              batch["inputs"], batch["targets"], key=key)

    def scaled_loss(params, batch, key, factor, under=rules):
        sums = loss_sums(params, batch, key, under)
        return (sums.total if factor is None else sums.total * factor), sums

    step_kind = _step_kind(_Parts(model, rules, cfg, tx, layout, schedule, dtype, loss_sums, scaled_loss))

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        with use_rules(rules):
            key = jax.random.fold_in(jax.random.key(cfg.seed), state.step)
            # float16: the loss is scaled as a mean over the step's tokens would be (the sum
            # times scale / tokens), so the gradients are those of the scaled mean loss.
            factor = None if state.loss_scale is None else state.loss_scale.scale / batch["inputs"].size
            # --offload: state at rest in host memory comes to the device where it is used (the
            # params for forward, the optimizer state for the update) and goes back after.
            old_params = move(state.params, rest.params, compute.params)
            if cfg.grad_accum == 1:
                sums, grads = step_kind.reduced_grads(old_params, batch, key, factor)
            else:
                sums, grads = _accumulate(step_kind.reduced_grads, old_params, batch, key, factor,
                                          cfg.grad_accum, layout.reduce_shardings)
            count = sums.tokens
            # Unscaled and averaged in float32, whatever dtype the gradients were reduced in.
            divisor = count if factor is None else count * factor
            grads, stored = optim.stored_apart(grads)  # --fp8 delayed: the next float8 states
            grads = jax.tree.map(lambda g: g.astype(jnp.float32) / divisor, grads)
            grad_norm = optim.global_norm(optim.without_router_bias(grads), layout.reduce_shardings)
            grads = optim.stored_back(optim.clip(grads, grad_norm, optim_cfg.grad_clip), stored)
            old_opt_state = move(state.opt_state, rest.opt_state, compute.opt_state)
            updates, opt_state = tx.update(grads, old_opt_state, old_params)
            params = optim.apply(old_params, updates, old_opt_state)
            metrics = {"loss": sums.nll / count, "grad_norm": grad_norm,
                       "lr": lr_schedule(state.step), **{k: v / count for k, v in sums.moe.items()}}
            new_scale = None
            if state.loss_scale is not None:
                # A step whose gradients overflowed changes nothing but the (halved) scale.
                # Any inf or NaN in the gradients makes their norm one.
                finite = jnp.isfinite(grad_norm)
                params, opt_state = scaling.select(finite, (params, opt_state), (old_params, old_opt_state))
                new_scale = scaling.adjust(state.loss_scale, finite, cfg.loss_scale_period)
                metrics |= {"loss_scale": state.loss_scale.scale, "skipped": (~finite).astype(jnp.int32),
                            "skipped_steps": new_scale.skipped}
            params = move(params, compute.params, rest.params)
            opt_state = move(opt_state, compute.opt_state, rest.opt_state)
            return TrainState(state.step + 1, params, opt_state, new_scale), metrics

    def evaluate(params, batch):
        sums = step_kind.eval_sums(move(params, rest.params, compute.params), batch)
        return sums.nll / sums.tokens

    replicated = rules.replicated()
    saved = step_kind.saved
    saved_shardings = jax.tree.map(lambda x: x.sharding, saved.get("saved_abstract", layout.abstract))
    fresh = jax.jit(lambda params: fresh_state(tx, params, jnp.dtype(cfg.param_dtype), initial_scale),
                    out_shardings=saved_shardings)
    unsaved = saved.get("unsaved", lambda state: state)
    return Program(
        rules=rules, layout=layout, batch_sharding=batch_sharding,
        init=build_init(model, tx, layout, initial_scale), loss=loss_sums, schedule=schedule,
        **{"saved_abstract": layout.abstract, **saved},
        from_params=lambda params: unsaved(fresh(params)), buckets=step_kind.buckets,
        step=jax.jit(step, in_shardings=(layout.shardings, batch_sharding),
                     out_shardings=(layout.shardings, replicated), donate_argnums=0,
                     compiler_options=runtime.xla_options() | step_kind.compiler_options),
        eval=jax.jit(evaluate, in_shardings=(layout.shardings.params, batch_sharding),
                     out_shardings=replicated, compiler_options=runtime.xla_options()))


def _saved_forms(model: LanguageModel, tx: optax.GradientTransformation, layout: StateLayout) -> dict[str, Any]:
    """The state with its layer stack in model order (checkpoints, exports) and back, for a
    model whose stage layout stores the stack otherwise. In model order the stack is not split
    over ``stage`` (its layer count need not divide it), so a save holds the whole stack's share
    of the other axes for a moment."""
    stage_layout = model.stage_layout
    stacked = jax.tree.map(lambda ax: ax[0] == Dim.LAYERS, model.param_axes(),
                           is_leaf=lambda x: isinstance(x, tuple))

    def convert(state: TrainState, fn: Callable) -> TrainState:
        """``fn`` applied to every stacked leaf of a state-shaped tree (params, the params-shaped
        parts of the optimizer state)."""
        one = lambda x, is_stacked: fn(x) if is_stacked else x  # noqa: E731
        return state._replace(
            params=jax.tree.map(one, state.params, stacked),
            opt_state=optax.tree_utils.tree_map_params(tx, one, state.opt_state, stacked,
                                                       transform_non_params=lambda x: x))

    def without_stage(sharding: jax.sharding.NamedSharding) -> jax.sharding.NamedSharding:
        first, *rest = sharding.spec
        kept = tuple(a for a in (first if isinstance(first, tuple) else (first,))
                     if a not in (None, str(MeshAxis.STAGE)))
        return jax.sharding.NamedSharding(sharding.mesh, P(kept or None, *rest))

    shardings = convert(layout.shardings, without_stage)
    shapes = jax.eval_shape(lambda s: convert(s, stage_layout.to_model), layout.abstract)
    return dict(
        saved=jax.jit(lambda s: convert(s, stage_layout.to_model), out_shardings=shardings),
        unsaved=jax.jit(lambda s: convert(s, stage_layout.to_stored), out_shardings=layout.shardings),
        saved_abstract=jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                    shapes, shardings))


def _accumulate(reduced_grads, params, batch, key, factor, n_micro: int, grad_shardings):
    """Sum loss, token count and grads over ``n_micro`` microbatches in a scan.

    Microbatch ``i`` is rows ``i, i + n, i + 2n, ...`` of the batch, so every microbatch stays
    spread over all batch shards (no device idles) and the full-batch mean is recovered
    exactly by dividing the sums once; with dropout, the step equals the whole batch's.
    """

    def split(x_BL):
        B = x_BL.shape[0]
        x_MBL = x_BL.reshape(B // n_micro, n_micro, *x_BL.shape[1:]).swapaxes(0, 1)
        return constrain(x_MBL, (None, Dim.BATCH) + (None,) * (x_BL.ndim - 1))

    micro = jax.tree.map(split, batch)

    def body(carry, xs):
        mb, i = xs  # one key: dropout draws the microbatch's rows of the whole batch's mask
        return jax.tree.map(jnp.add, carry, reduced_grads(params, mb, key, factor, (i, n_micro))), None

    zeros = jax.lax.with_sharding_constraint(
        jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params), grad_shardings)
    first = jax.tree.map(lambda x: x[0], micro)
    sums_shape = jax.eval_shape(lambda: reduced_grads(params, first, key, factor)[0])
    init = (jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), sums_shape), zeros)
    (sums, grads), _ = jax.lax.scan(body, init, (micro, jnp.arange(n_micro)))
    return sums, grads
