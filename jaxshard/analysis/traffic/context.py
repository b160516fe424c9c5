"""Context parallelism's collectives, per device per step: ring attention over ``sequence``
(``parallel.attention``; Liu et al. 2023, Ring Attention).

With the sequence split into S chunks, each attention passes its key and value chunks S - 1
hops around the ring, and the backward pass sends their gradients back the same way. Any
remat policy recomputes the ring (selective's attention core is the ring). Where ``tensor``
splits the kv heads, each device passes only its heads. In the balanced layout
(``attention.balances``) the token ids and targets are gathered once per microbatch to put
them in that order.
"""

from __future__ import annotations

from jaxshard.analysis.traffic.ledger import Ledger
from jaxshard.axes import Dim
from jaxshard.parallel import attention


def ring(ledger: Ledger) -> None:
    cfg, rules, tensor = ledger.cfg, ledger.rules, ledger.tensor
    seq = rules.activation_mesh_axes(Dim.LENGTH)
    if not seq:
        return
    S = rules.size(seq)
    kv_local = ledger.rows * ledger.length * cfg.n_kv_heads * cfg.d_head * ledger.c
    kv_t = rules.size(tensor) if tensor and cfg.n_kv_heads % rules.size(tensor) == 0 else 1
    ring_fwd = 2 if ledger.remat.recomputes else 1
    ledger.add("collective-permute", seq, kv_local // kv_t,
               ledger.grad_accum * cfg.n_layers * 2 * (S - 1) * (ring_fwd + 1),
               "CP: pass key and value chunks around the ring (forward and backward)")
    if attention.balances(cfg, S, ledger.seq_len):
        ledger.add("all-gather", seq, ledger.rows * ledger.seq_len * 4, 2 * ledger.grad_accum,
                   "CP, balanced: gather the token ids and targets to put them in the balanced order")
