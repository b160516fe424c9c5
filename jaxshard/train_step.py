"""One training step: loss and grads (over microbatches), gradient layout, AdamW update.

:func:`build_program` builds the jitted init/step/eval functions and their shardings without
running anything, so tools can ``program.step.lower(...).compile()`` and read the HLO.

Collectives come from the layouts alone: the batch is sharded over ``data``/``fsdp``, each
layer's weights are constrained to their compute layout inside the layer scan (the FSDP
all-gather), grads are constrained to their at-rest layout (all-reduce for DDP and ZeRO-1,
reduce-scatter for ZeRO-2/3), and the updated params to theirs (the ZeRO-1/2 all-gather).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jaxshard import optim
from jaxshard.axes import Dim
from jaxshard.errors import ConfigError
from jaxshard.rules import ShardingRules, constrain, use_rules
from jaxshard.train_state import StateLayout, TrainState, build_init, state_layout

COMPUTE_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True, slots=True)
class StepConfig:
    grad_accum: int = 1
    compute_dtype: str = "float32"  # params stay float32 (master copy); matmuls run in this
    seed: int = 0  # drives init and dropout

    def __post_init__(self) -> None:
        if self.grad_accum < 1:
            raise ConfigError(f"--grad-accum must be >= 1, got {self.grad_accum}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"--compute-dtype must be one of {', '.join(COMPUTE_DTYPES)}, "
                              f"got {self.compute_dtype}")


@dataclass(frozen=True)
class Program:
    """Everything jitted for one (model, mesh, strategy, optimizer): nothing has run yet."""

    rules: ShardingRules
    layout: StateLayout
    batch_sharding: jax.sharding.NamedSharding
    init: Callable[[int], TrainState]
    step: Callable  # (state, batch) -> (state, metrics); donates state
    eval: Callable  # (params, batch) -> mean loss
    loss: Callable  # (params, batch, key) -> (loss sum, tokens), unjitted, under the rules

    def abstract_batch(self, batch_size: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
        x = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=self.batch_sharding)
        return {"inputs": x, "targets": x}

    def lower_step(self, batch_size: int, seq_len: int):
        return self.step.lower(self.layout.abstract, self.abstract_batch(batch_size, seq_len))


def _cast(tree: Any, dtype: jnp.dtype) -> Any:
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def check_batch(rules: ShardingRules, batch_size: int, seq_len: int, grad_accum: int) -> None:
    """Fail early with one line if the batch cannot be split into sharded microbatches."""
    rules.check_seq_len(seq_len)
    rules.check_batch(batch_size)
    if batch_size % grad_accum:
        raise ConfigError(f"--batch-size {batch_size} is not divisible by --grad-accum {grad_accum}")
    rules.check_batch(batch_size // grad_accum, f"the microbatch of {batch_size // grad_accum} "
                      f"(--batch-size {batch_size} / --grad-accum {grad_accum})")


def build_program(model: Any, rules: ShardingRules, optim_cfg: optim.OptimConfig,
                  cfg: StepConfig) -> Program:
    rules.check_model(model.param_axes(), model.abstract_params())
    tx = optim.make(optim_cfg, model.param_axes())
    lr_schedule = optim.schedule(optim_cfg)
    layout = state_layout(model, tx, rules)
    dtype = jnp.dtype(cfg.compute_dtype)
    batch_sharding = rules.batch_sharding()

    def loss_and_count(params, batch, key):
        with use_rules(rules):
            return model.loss(_cast(params, dtype), batch["inputs"], batch["targets"], key=key)

    grad_fn = jax.value_and_grad(loss_and_count, has_aux=True)

    def reduced_grads(params, batch, key):
        (loss_sum, count), grads = grad_fn(params, batch, key)
        # The gradient's at-rest layout: replicated -> all-reduce; sharded -> reduce-scatter.
        return loss_sum, count, jax.lax.with_sharding_constraint(grads, layout.grad_shardings)

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        with use_rules(rules):
            key = jax.random.fold_in(jax.random.key(cfg.seed), state.step)
            if cfg.grad_accum == 1:
                loss_sum, count, grads = reduced_grads(state.params, batch, key)
            else:
                loss_sum, count, grads = _accumulate(reduced_grads, state.params, batch, key,
                                                     cfg.grad_accum, layout.grad_shardings)
            grads = jax.tree.map(lambda g: g / count, grads)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            metrics = {"loss": loss_sum / count, "grad_norm": optax.tree.norm(grads),
                       "lr": lr_schedule(state.step)}
            return TrainState(state.step + 1, params, opt_state), metrics

    def evaluate(params, batch):
        loss_sum, count = loss_and_count(params, batch, None)
        return loss_sum / count

    replicated = rules.replicated()
    return Program(
        rules=rules, layout=layout, batch_sharding=batch_sharding,
        init=build_init(model, tx, layout), loss=loss_and_count,
        step=jax.jit(step, in_shardings=(layout.shardings, batch_sharding),
                     out_shardings=(layout.shardings, replicated), donate_argnums=0),
        eval=jax.jit(evaluate, in_shardings=(layout.shardings.params, batch_sharding),
                     out_shardings=replicated))


def _accumulate(reduced_grads, params, batch, key, n_micro: int, grad_shardings):
    """Sum loss, token count and grads over ``n_micro`` microbatches in a scan.

    Microbatch ``i`` is rows ``i, i + n, i + 2n, ...`` of the batch, so every microbatch stays
    spread over all batch shards (no device idles) and the full-batch mean is recovered
    exactly by dividing the sums once.
    """

    def split(x_BL):
        B = x_BL.shape[0]
        x_MBL = x_BL.reshape(B // n_micro, n_micro, *x_BL.shape[1:]).swapaxes(0, 1)
        return constrain(x_MBL, (None, Dim.BATCH) + (None,) * (x_BL.ndim - 1))

    micro = jax.tree.map(split, batch)

    def body(carry, xs):
        loss_acc, count_acc, grads_acc = carry
        mb, i = xs
        loss_sum, count, grads = reduced_grads(params, mb, jax.random.fold_in(key, i))
        return (loss_acc + loss_sum, count_acc + count, jax.tree.map(jnp.add, grads_acc, grads)), None

    zeros = jax.lax.with_sharding_constraint(
        jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params), grad_shardings)
    init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros)
    (loss_sum, count, grads), _ = jax.lax.scan(body, init, (micro, jnp.arange(n_micro)))
    return loss_sum, count, grads
