"""The vocabulary's collectives, per device per step: the token table's gradient and the
vocab-parallel lookup, projection and cross-entropy (``parallel.vocab``, Megatron's scheme).

* The table's gradient: the lookup kernel sums its share over all the batch and sequence
  axes at once. Given the table as per-batch-shard copies (``parallel.vocab.table_copies``:
  tied, or untied under HSDP), a tied table's projection share is summed with it first and
  the sum is reduced like any other gradient (``traffic.data_parallel``). Under context
  parallelism the projection's share is reduced separately.
* Under tensor parallelism each shard looks up the ids in its vocabulary range, so the
  lookup's ``[B, L, D]`` partial embeddings are summed (an all-reduce; under SP a
  reduce-scatter, and backward an all-gather of the output gradient), and so is the
  projection's input gradient (under SP the sequence is gathered for it first). The loss
  reduces three values per token over tensor: the logits' maximum, the sum of exponentials
  and the target logit (Megatron's vocab-parallel cross-entropy).
"""

from __future__ import annotations

from jaxshard.analysis.shards import F32
from jaxshard.analysis.traffic.ledger import Ledger, ParamUse
from jaxshard.axes import Dim
from jaxshard.parallel.vectors import two_stage
from jaxshard.parallel.vocab import reduces_tied_once


def table_gradient(ledger: Ledger, use: ParamUse) -> bool:
    """The lookup's own reduction of the table's gradient, where the table is not given as
    copies; True where that is all of it (untied), False where the rest is reduced as any
    gradient (the copies' sum, or a tied table's projection share) or for another parameter."""
    p, rules, cfg = use.p, ledger.rules, ledger.cfg
    if not (p.axes and p.axes[0] == Dim.VOCAB):
        return False
    if reduces_tied_once(rules) and (cfg.tie_embeddings or two_stage(rules)):
        return False  # copies
    ledger.add("reduce-scatter" if use.scatter else "all-reduce", use.reduce, use.used, use.per_micro,
               f"{p.path}: gradient of the lookup")
    if not cfg.tie_embeddings:
        return True
    ledger.allow("Tied embeddings under context parallelism: XLA reduces the table gradients of "
                 "the lookup and of the vocabulary projection separately (one table-sized "
                 "reduction more).")
    return False


def parallel(ledger: Ledger) -> None:
    """The vocab-parallel lookup, projection and cross-entropy over tensor."""
    tensor, act, micro = ledger.tensor, ledger.act, ledger.grad_accum
    if not tensor:
        return
    if ledger.sp:
        ledger.add("reduce-scatter", tensor, act, micro, "SP: vocab-parallel embedding, reduce-scattered")
        ledger.add("all-gather", tensor, act, micro, "SP backward: embedding output gradient")
        ledger.add("all-gather", tensor, act, micro, "SP: gather the sequence for the vocabulary projection")
        ledger.add("reduce-scatter", tensor, act, micro, "SP backward: vocabulary projection input gradient")
    else:
        ledger.add("all-reduce", tensor, act, micro, "TP: vocab-parallel embedding")
        ledger.add("all-reduce", tensor, act, micro, "TP backward: vocabulary projection input gradient")
    ledger.add("all-reduce", tensor, ledger.rows * ledger.length * F32, 3 * micro,
               "vocab-parallel cross-entropy: max, sum of exponentials, target logit per token")


def lookup_precision(ledger: Ledger) -> None:
    if ledger.c != F32:
        ledger.allow("On CPU the embedding lookup runs in float32 (XLA:CPU cannot promote its bf16 "
                     "gradient reduction), so that reduction moves twice the bytes listed.")
