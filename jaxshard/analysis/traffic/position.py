"""A learned position table's gradient, per device per step.

The model slices the table's first L rows, so only those rows have a gradient, and GSPMD
reduces only them over the batch (a reduce-scatter into ZeRO's shard, an all-reduce of it
otherwise). The rows are disjoint across the sequence shards, so those gather rather than
sum: one all-gather where the model makes them whole (``vectors.gathers_rows``: the table's
gradient not split along its model dim, no pipeline). Elsewhere, and for packed documents'
rows, the partitioner moves them as it chooses, counted here as an all-gather under context
parallelism and, under sequence parallelism, collective-permutes between the tensor shards
((T - 1) / T of the rows): it all-reduces them over the sequence under CP (twice an
all-gather's bytes) and under SP with FSDP adds an all-gather, a few rows within the
verifier's slack. ``--strategy explicit`` (``training.reducer``) reduces every gradient
whole, as DDP does: the whole table's.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec

from jaxshard.analysis.shards import shard_elems
from jaxshard.analysis.traffic.ledger import Ledger, ParamUse
from jaxshard.axes import Dim
from jaxshard.parallel.vectors import gathers_rows


def gradient(ledger: Ledger, use: ParamUse) -> bool:
    """The table's gradient rows reduced; False for any other parameter."""
    p, rules = use.p, ledger.rules
    if not (p.axes and p.axes[0] == Dim.POSITION):
        return False
    used_rows = p.shape[0] if ledger.reducer == "explicit" else ledger.seq_len
    rows = ledger.c * used_rows * shard_elems(p.shape[1:], PartitionSpec(*p.compute[1:]), ledger.sizes)
    seq_axes = use.reduce - set(rules.batch_axes)
    # (HSDP + ZeRO-1: XLA reduce-scatters them over fsdp and all-reduces that shard
    # over data; they are a few rows.)
    batch_scatter = use.first & set(rules.batch_axes)
    own = rows // rules.size(rules.active_axes(seq_axes))  # this sequence shard's rows
    ledger.add("reduce-scatter", batch_scatter, own, use.per_micro, f"{p.path}: gradient of the used rows")
    ledger.add("all-reduce", set(rules.batch_axes) - batch_scatter,
               own // rules.size(rules.active_axes(batch_scatter)), use.per_micro,
               f"{p.path}: gradient of the used rows (HSDP: their shard)")
    # (gathered whole where the model asks it to, vectors.gathers_rows; packed documents' rows
    # are looked up token by token, vectors.take_rows)
    whole = gathers_rows(rules, p.shape) and ledger.cfg.documents_eot is None
    cp_axes = seq_axes if whole else seq_axes & set(rules.activation_mesh_axes(Dim.LENGTH))
    ledger.add("all-gather", cp_axes, rows, use.per_micro, f"{p.path}: gradient rows held by sequence shards")
    T = rules.size(rules.active_axes(seq_axes - cp_axes))
    ledger.add("collective-permute", seq_axes - cp_axes, rows * (T - 1) // T, use.per_micro,
               f"{p.path}: gradient rows held by sequence-parallel shards")
    return True
