"""The collectives a configuration implies, per device per step, each strategy's in a module
named after it -- ``data_parallel`` (DDP, ZeRO, FSDP, HSDP), ``tensor`` (and sequence
parallelism), ``context``, ``experts``, ``vocab``, ``position``, ``pipeline`` -- written into
one :class:`~jaxshard.analysis.traffic.ledger.Ledger` by :func:`communication`.
"""

from __future__ import annotations

from jaxshard.analysis.traffic import context, data_parallel, experts, position, tensor, vocab
from jaxshard.analysis.traffic.ledger import Communication, Ledger, Transfer
from jaxshard.model import LanguageModel
from jaxshard.remat import Remat
from jaxshard.rules import ShardingRules

__all__ = ["Communication", "Transfer", "communication"]

# After each parameter's gathers and gradient: the collectives of the activations, then the
# step's scalars (the order of the transfers is the order they are listed in).
STEP = (tensor.layers, vocab.parallel, tensor.kv_heads, experts.dispatch, context.ring,
        data_parallel.scalars, vocab.lookup_precision)


def communication(model: LanguageModel, rules: ShardingRules, batch_size: int, seq_len: int, *,
                  compute_dtype: str = "float32", remat: Remat = Remat.NONE,
                  grad_accum: int = 1, param_dtype: str = "float32", reducer: str = "gspmd",
                  fp8_bytes: int = 1) -> Communication:
    """The collectives one step needs, per device, with the textbook reason for each.
    ``reducer`` 'explicit' (jaxshard.training.reducer) reduces every gradient whole, as DDP
    does: a learned position table's too, where GSPMD reduces only the rows the step used."""
    ledger = Ledger(model, rules, batch_size, seq_len, compute_dtype=compute_dtype, remat=remat,
                    grad_accum=grad_accum, param_dtype=param_dtype, reducer=reducer, fp8_bytes=fp8_bytes)
    for p in ledger.params:
        use = ledger.use(p)
        data_parallel.gathers(ledger, use)
        # The tables' kernels reduce their own gradients (all of it, or a share of it).
        if not (position.gradient(ledger, use) or vocab.table_gradient(ledger, use)):
            data_parallel.gradient(ledger, use)
    for strategy in STEP:
        strategy(ledger)
    return ledger.communication()
