"""Pipeline parallelism over the ``stage`` mesh axis: static schedules, one executor.

The layer stack is split along ``layers`` into P stages, stage ``s`` holding layers
``[s L/P, (s+1) L/P)``. A schedule is a table of ticks: at tick ``t`` stage ``s`` runs at most
one forward (of microbatch ``fwd[t, s]``) and one backward (of microbatch ``bwd[t, s]``); -1 is
an idle slot. One executor runs every table: a ``lax.scan`` over the ticks inside a
``shard_map`` manual over ``stage`` (the other axes stay with the partitioner), with
``ppermute`` carrying activations to the next stage and their gradients to the previous one
between ticks, and an explicit ``jax.vjp`` per stage and microbatch. Idle slots skip their work
(``lax.switch``), they do not compute and mask it.

What a stage keeps between a microbatch's forward and its backward is the stage's input
(GPipe's re-materialisation): the backward slot runs the stage's forward again under
``jax.vjp``. So a stage's saved activations are ``slots`` inputs, which the schedule fixes:
GPipe all M microbatches, 1F1B at most 2P - 1 whatever M is.

The two ends run inside the executor: stage 0 embeds its microbatch's tokens (and, backward,
takes the embedding's gradient), the last stage applies the head and the loss in its backward
slot, the same tick as its forward. The outer params (token table, final norm, head) are
replicated over ``stage``; their gradients -- the embedding's from stage 0, the head's from the
last stage -- are summed over ``stage`` once at the end, so a tied table's two uses make one
gradient before the update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxshard.axes import MeshAxis
from jaxshard.errors import ConfigError

STAGE = str(MeshAxis.STAGE)
SCHEDULES = ("naive", "gpipe", "1f1b")


@dataclass(frozen=True)
class Schedule:
    """Which microbatch each stage runs forward and backward at each tick (-1: idle)."""

    kind: str
    stages: int
    microbatches: int
    fwd: np.ndarray  # [ticks, stages]
    bwd: np.ndarray  # [ticks, stages]
    slots: int  # stage inputs kept for the backward pass: microbatch i in slot i % slots

    @property
    def ticks(self) -> int:
        return self.fwd.shape[0]

    def bubble(self) -> float:
        """The theoretical idle fraction (P - 1) / (M + P - 1)."""
        return (self.stages - 1) / (self.microbatches + self.stages - 1)


def make_schedule(kind: str, stages: int, microbatches: int) -> Schedule:
    """``naive``: one microbatch through the stages in turn (vertical model parallelism);
    ``gpipe``: every forward, then every backward; ``1f1b``: microbatch i runs forward on stage s
    at tick i + s and backward at tick i + 2P - 2 - s, so a stage holds at most 2P - 1 inputs."""
    Pn, M = stages, microbatches
    if kind not in SCHEDULES:
        raise ConfigError(f"--pipeline-schedule must be one of {', '.join(SCHEDULES)}, got {kind!r}")
    if Pn < 2:
        raise ConfigError(f"--pipeline-schedule {kind} needs a stage axis of size > 1 in --mesh")
    if kind == "naive" and M != 1:
        raise ConfigError(f"--pipeline-schedule naive runs the whole batch as one microbatch; "
                          f"got --microbatches {M}")
    if M < 1:
        raise ConfigError(f"--microbatches must be >= 1, got {M}")
    if kind == "1f1b" and M < Pn:
        raise ConfigError(f"--pipeline-schedule 1f1b needs --microbatches >= the stages ({Pn}), got {M}")
    # Microbatch i runs forward on stage s at tick i + s in every schedule; they differ in when
    # it runs backward, and so in how many stage inputs a stage holds.
    if kind == "1f1b":
        ticks, slots = M + 2 * Pn - 2, min(M, 2 * Pn - 1)

        def bwd_at(i: int, s: int) -> int:
            return i + 2 * Pn - 2 - s
    else:
        # The last stage's backward of microbatch M-1 starts as soon as its forward is done.
        start = M + Pn - 2
        ticks, slots = start + M + Pn - 1, M

        def bwd_at(i: int, s: int) -> int:
            return start + (M - 1 - i) + (Pn - 1 - s)
    fwd = np.full((ticks, Pn), -1, np.int32)
    bwd = np.full((ticks, Pn), -1, np.int32)
    for i in range(M):
        for s in range(Pn):
            fwd[i + s, s] = i
            bwd[bwd_at(i, s), s] = i
    return Schedule(kind, Pn, M, fwd, bwd, slots)


def run(schedule: Schedule, mesh: jax.sharding.Mesh, *,
        embed: Callable[..., jax.Array], body: Callable[..., jax.Array], last: Callable[..., jax.Array],
        blocks: Any, outer: Any, inputs_MBL: jax.Array, targets_MBL: jax.Array,
        seed: jax.Array | float = 1.0, aux: Any = None) -> tuple[jax.Array, Any, Any]:
    """Loss sum and gradients of one step under ``schedule``.

    ``embed(outer, tokens, i, aux) -> x``; ``body(blocks, x, i, aux) -> y`` runs one stage's
    layers (``blocks`` is the stage's slice of the stack); ``last(blocks, outer, x, targets, i,
    aux) -> loss sum`` runs the last stage's layers, the head and the loss; ``i`` is the
    microbatch, ``aux`` is passed through (e.g. a dropout key), replicated.
    ``inputs_MBL``/``targets_MBL``: the step's microbatches. ``seed``: the cotangent of the loss
    sum (a loss scale). Returns the loss sum over all microbatches, the stack's gradients (laid
    out as ``blocks``) and the outer params'.
    """
    Pn, K = schedule.stages, schedule.slots
    fwd_table, bwd_table = jnp.asarray(schedule.fwd), jnp.asarray(schedule.bwd)
    seed = jnp.asarray(seed, jnp.float32)
    to_next = [(s, s + 1) for s in range(Pn - 1)]
    to_prev = [(s + 1, s) for s in range(Pn - 1)]

    def local(blocks, outer, inputs, targets, seed, aux):
        s = jax.lax.axis_index(STAGE)
        first, final = s == 0, s == Pn - 1
        x_shape = jax.eval_shape(embed, outer, inputs[0], 0, aux)
        zeros_x = jnp.zeros(x_shape.shape, x_shape.dtype)
        zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)  # noqa: E731

        def stage_input(i, received):
            return jax.lax.cond(first, lambda: embed(outer, inputs[i], i, aux), lambda: received)

        def backward(j, stash, received_g):
            x_in = stash[j % K]

            def middle():
                _, vjp = jax.vjp(lambda b, x: body(b, x, j, aux), blocks, x_in)
                d_blocks, d_x = vjp(received_g)
                return jnp.zeros((), jnp.float32), d_blocks, zeros(outer), d_x

            def end():
                loss, vjp = jax.vjp(lambda b, o, x: last(b, o, x, targets[j], j, aux), blocks, outer, x_in)
                d_blocks, d_outer, d_x = vjp(seed.astype(loss.dtype))
                return loss, d_blocks, d_outer, d_x

            loss, d_blocks, d_outer, d_x = jax.lax.cond(final, end, middle)
            # Stage 0: the gradient of its input goes into the embedding.
            d_outer = jax.lax.cond(first, lambda: jax.tree.map(
                jnp.add, d_outer, jax.vjp(lambda o: embed(o, inputs[j], j, aux), outer)[1](d_x)[0]),
                lambda: d_outer)
            return loss, d_blocks, d_outer, d_x

        def idle_backward(j, stash, received_g):
            return jnp.zeros((), jnp.float32), zeros(blocks), zeros(outer), zeros_x

        def tick(carry, t):
            received_x, received_g, stash, loss_acc, d_blocks_acc, d_outer_acc = carry
            i, j = fwd_table[t, s], bwd_table[t, s]
            # Forward slot: take the microbatch's input, keep it, pass the stage's output on
            # (the last stage's forward runs in its backward slot, with the head).
            i_ = jnp.maximum(i, 0)
            x_in = jax.lax.cond(i >= 0, lambda: stage_input(i_, received_x), lambda: zeros_x)
            stash = jax.lax.cond(i >= 0, lambda: stash.at[i_ % K].set(x_in), lambda: stash)
            y = jax.lax.cond((i >= 0) & ~final, lambda: body(blocks, x_in, i_, aux), lambda: zeros_x)
            # Backward slot.
            loss, d_blocks, d_outer, d_x = jax.lax.cond(
                j >= 0, backward, idle_backward, jnp.maximum(j, 0), stash, received_g)
            received_x = jax.lax.ppermute(y, STAGE, to_next)
            received_g = jax.lax.ppermute(d_x, STAGE, to_prev)
            return (received_x, received_g, stash, loss_acc + loss,
                    jax.tree.map(jnp.add, d_blocks_acc, d_blocks),
                    jax.tree.map(jnp.add, d_outer_acc, d_outer)), None

        stash = jnp.zeros((K, *x_shape.shape), x_shape.dtype)
        init = (zeros_x, zeros_x, stash, jnp.zeros((), jnp.float32), zeros(blocks), zeros(outer))
        (_, _, _, loss, d_blocks, d_outer), _ = jax.lax.scan(tick, init, jnp.arange(schedule.ticks))
        # The loss lives on the last stage, the outer params' gradients on the two ends.
        return jax.lax.psum(loss, STAGE), d_blocks, jax.lax.psum(d_outer, STAGE)

    stacked = jax.tree.map(lambda _: P(STAGE), blocks)
    replicated = jax.tree.map(lambda _: P(), outer)
    return jax.shard_map(local, mesh=mesh, axis_names=frozenset({STAGE}), check_vma=False,
                         in_specs=(stacked, replicated, P(), P(), P(), jax.tree.map(lambda _: P(), aux)),
                         out_specs=(P(), stacked, replicated))(blocks, outer, inputs_MBL, targets_MBL, seed, aux)
