"""Context parallelism's collectives, per device per step: ring attention over ``sequence``
(``parallel.attention``; Liu et al. 2023, Ring Attention), or Ulysses' all-to-alls (Jacobs et
al. 2023, DeepSpeed-Ulysses).

With the sequence split into S chunks, each attention passes its key and value chunks S - 1
hops around the ring; the backward pass passes them around again with their gradients' running
sums (four chunks a hop; the sums in float32), and one hop more brings the gradients home. A remat policy that
recomputes the attention sends nothing more: XLA merges the recomputed forward pass's hops
with the backward pass's, which pass the same chunks. Where ``tensor`` splits the kv heads,
each device passes only its heads. In the balanced layout
(``attention.balances``) the token ids and targets are gathered once per microbatch to put
them in that order. Packed documents' segment ids, positions and loss flags are made from the
whole row of token ids on every device (``models.transformer``): the balanced layout's gather
of the ids serves, and otherwise (the contiguous ring, Ulysses) the ids are gathered for them;
no id travels with a chunk.

Ulysses sends each attention's query, key and value chunks to the devices of their heads and
the output back, four all-to-alls of a device's own ``[rows, L/S, heads, d_head]`` each way
(the kv heads repeated :func:`attention.kv_copies` times where S does not divide them); the
backward pass sends their gradients the same way. A remat policy that recomputes the attention
core sends q, k and v again, and the output too unless the policy keeps it (selective, whose
recompute is the core alone, or a ``names``/``offload`` policy keeping ``attn_out``): the output
projection's backward pass reads it.
"""

from __future__ import annotations

from jaxshard.analysis.shards import F32
from jaxshard.analysis.traffic.ledger import Ledger
from jaxshard.axes import Dim
from jaxshard.parallel import attention
from jaxshard.remat import Kind


def ring(ledger: Ledger) -> None:
    cfg, rules, tensor = ledger.cfg, ledger.rules, ledger.tensor
    seq = rules.activation_mesh_axes(Dim.LENGTH)
    if not seq:
        return
    S = rules.size(seq)
    ulysses = rules.strategy.context_parallel == "ulysses"
    if attention.balances(cfg, S, ledger.seq_len) and not ulysses:
        ledger.add("all-gather", seq, ledger.rows * ledger.seq_len * 4, 2 * ledger.grad_accum,
                   "CP, balanced: gather the token ids and targets to put them in the balanced order")
    elif cfg.documents_eot is not None:
        ledger.add("all-gather", seq, ledger.rows * ledger.seq_len * 4, ledger.grad_accum,
                   "CP, packed documents: gather the token ids to find the documents in the whole row")
    if ulysses:
        _ulysses(ledger, seq, S)
        return
    kv_t = rules.size(tensor) if tensor and cfg.n_kv_heads % rules.size(tensor) == 0 else 1
    kv_local = ledger.rows * ledger.length * cfg.n_kv_heads * cfg.d_head // kv_t  # elements
    layers = ledger.grad_accum * cfg.n_layers
    ledger.add("collective-permute", seq, kv_local * ledger.c, layers * 4 * (S - 1),
               "CP: pass key and value chunks around the ring (forward, and again backward)")
    ledger.add("collective-permute", seq, kv_local * F32, layers * 2 * S,
               "CP: pass the key and value chunks' gradient sums (float32) with them, and home (backward)")


def _ulysses(ledger: Ledger, seq: tuple[str, ...], S: int) -> None:
    cfg, rules, tensor = ledger.cfg, ledger.rules, ledger.tensor
    t = rules.size(tensor)
    q_heads = cfg.n_heads // t
    kv_heads = cfg.n_kv_heads // t if cfg.n_kv_heads % t == 0 else 1  # else one whole kv head each
    kv_heads *= attention.kv_copies(kv_heads, q_heads // kv_heads, S)
    token = ledger.rows * ledger.length * cfg.d_head * ledger.c
    remat = ledger.remat
    again = 1 if remat.recomputes else 0
    output_kept = remat.kind is Kind.SELECTIVE or "attn_out" in remat.names
    layers = ledger.grad_accum * cfg.n_layers
    for what, heads, n in (("queries", q_heads, 2 + again), ("keys", kv_heads, 2 + again),
                           ("values", kv_heads, 2 + again), ("outputs", q_heads, 2 + again * (not output_kept))):
        ledger.add("all-to-all", seq, token * heads, layers * n,
                   f"CP, Ulysses: {what} between the sequence split and the head split (forward and backward)")
