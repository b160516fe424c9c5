"""Pipeline parallelism's collectives, per device per step (``parallel.pipeline``: the tick
tables and their executor; ``parallel.staged``: the model over them).

Stages pass each microbatch's residual stream forward and its gradient back (GPipe, Huang et
al. 2019; 1F1B, Narayanan et al. 2021), and the gradients are reduced once at the end of the
step. What runs inside the schedule's slots (FSDP's gathers, tensor parallelism's reductions)
runs as often as the schedule gives each stage work, which the compiled step's loop does not
record; it is not predicted here.
"""

from __future__ import annotations

from typing import Any

from jax.sharding import PartitionSpec

from jaxshard.analysis.shards import dtype_bytes, param_infos, shard_elems
from jaxshard.analysis.traffic.ledger import Communication, Transfer
from jaxshard.axes import Dim, MeshAxis
from jaxshard.model import Stageable
from jaxshard.parallel.pipeline import replica_axes
from jaxshard.parallel.staged import staged
from jaxshard.rules import ShardingRules, spec_axes


def pipeline_transfers(model: Stageable, rules: ShardingRules, schedule: Any, batch_size: int, seq_len: int,
                       compute_dtype: str = "float32") -> list[Transfer]:
    """What a pipeline's stages send each other per step, per device: every tick one stage
    input (a microbatch's residual stream, in its layout: SP splits its length) to the next
    stage and one gradient of it to the previous. In lockstep SPMD a tick's send runs whether
    or not the stage has a microbatch to pass, so it is ``ticks`` sends per direction where the
    textbook's is M (the executor's idle ticks carry zeros)."""
    rows = batch_size // schedule.microbatches // rules.size(rules.batch_axes)
    length = seq_len // rules.size(rules.activation_mesh_axes(Dim.RESIDUAL_LENGTH))
    one = rows * length * model.cfg.d_model * dtype_bytes(compute_dtype)
    stage = rules.active_axes((MeshAxis.STAGE,))
    return [Transfer("collective-permute", stage, one, schedule.ticks, "stage inputs to the next stage", 2),
            Transfer("collective-permute", stage, one, schedule.ticks, "their gradients to the previous stage", 2)]


def pipeline_communication(model: Stageable, rules: ShardingRules, schedule: Any, batch_size: int,
                           seq_len: int, *, compute_dtype: str = "float32",
                           param_dtype: str = "float32") -> Communication:
    """The collectives of a pipelined step outside the schedule's slots, per device: the stage
    sends of every tick (:func:`pipeline_transfers`), the gradients' reductions once at the end
    -- over the data replicas the stage's layers' (an all-reduce; ZeRO-1: a reduce-scatter and
    the updated params' all-gather), over the stages and replicas the outer params' (the
    embedding's from stage 0, the head's from the last) -- and the loss and gradient norm."""
    stored = staged(model, schedule.layout)
    pb, sizes = dtype_bytes(param_dtype), rules.sizes
    replicas = replica_axes(rules)
    stage = rules.active_axes((MeshAxis.STAGE,))
    infos = param_infos(stored, rules)
    layers = sum(pb * shard_elems(p.shape, p.params, sizes) for p in infos if p.in_layers)
    outer = sum(pb * shard_elems(p.shape, p.params, sizes) for p in infos
                if not p.in_layers and p.axes[:1] != (Dim.POSITION,))
    # A learned position table's gradient: its first L rows (the executor is given only those),
    # under sequence parallelism split over tensor by row, reduced, then gathered.
    position = [p for p in infos if p.axes[:1] == (Dim.POSITION,)]
    rows = sum(pb * seq_len * shard_elems(p.shape[1:], PartitionSpec(*p.params[1:]), sizes) for p in position)
    tensor = rules.activation_mesh_axes(Dim.ACT_HEADS)
    sp = tuple(a for a in tensor if a in rules.activation_mesh_axes(Dim.RESIDUAL_LENGTH))
    zero1 = bool(replicas) and rules.strategy.zero == 1
    reduce = "reduce-scatter" if zero1 else "all-reduce"
    out = list(pipeline_transfers(model, rules, schedule, batch_size, seq_len, compute_dtype))

    def add(kind, axes, nbytes, what):
        axes = rules.active_axes(axes)
        if axes and nbytes:
            out.append(Transfer(kind, axes, int(nbytes), 1, what, rules.size(axes)))

    add(reduce, replicas, layers, "the stage's layer gradients over the data replicas, once a step")
    add(reduce, stage + replicas, outer + rows // rules.size(sp) + 4,
        "the outer params' gradients (both ends; the used position rows) and the loss, once")
    add("all-gather", sp, rows, "the used position rows' gradient, from the sequence-parallel shards")
    if zero1:
        table = sum(pb * shard_elems(p.shape, p.params, sizes) for p in position)
        add("all-gather", replicas, layers + outer + table, "ZeRO-1: the updated params")
    # The gradient norm: one scalar over every axis that splits some gradient.
    split = set(stage) | {a for p in infos for a in spec_axes(p.grads)}
    add("all-reduce", tuple(split), 4, "the gradient norm")
    return Communication(out)
