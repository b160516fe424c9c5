"""Tensor (and sequence) parallelism's collectives in the layers, per device per step
(``parallel.tensor``; Shoeybi et al. 2019, Megatron-LM; Korthikanti et al. 2022, sequence
parallelism).

Per layer and microbatch, Megatron's ``g`` after each row-parallel block output (attention's
and the MLP's: an all-reduce of the ``[B, L, D]`` activation, under SP a reduce-scatter after
an all-gather of the sequence into each block) and its ``f`` backward, the column-parallel
projections' input gradient (one per sublayer, summed over its projections). A recomputed
layer repeats the reductions the backward pass needs again. MoE layers under a capacity
reduce the experts' slots, ``[rows, E, C, D]``, not the tokens. With grouped-query kv
heads fewer than ``tensor``, every device computes the kv heads its query heads read, and
their gradients are summed over the query heads' devices and gathered.

The vocabulary's reductions under tensor are ``traffic.vocab``'s.
"""

from __future__ import annotations

from jaxshard.analysis.traffic.experts import moe_buffer
from jaxshard.analysis.traffic.ledger import Ledger
from jaxshard.axes import Dim
from jaxshard.remat import Kind


def layers(ledger: Ledger) -> None:
    """The attention and MLP blocks' reductions (and SP's gathers) over tensor."""
    cfg, rules, tensor, remat = ledger.cfg, ledger.rules, ledger.tensor, ledger.remat
    if not tensor:
        return
    act, micro, n_layers = ledger.act, ledger.grad_accum, cfg.n_layers
    n_fwd = 2 if remat.recomputes and remat.kind is not Kind.SELECTIVE else 1  # the layer runs twice
    # A recomputed layer repeats its row-parallel output reduction where the backward pass needs
    # the value: the attention block's (the MLP's input), unless the policy kept it; the MLP
    # block's output is dead in the recompute.
    kept_proj = remat.kind in (Kind.DOTS, Kind.DOTS_NO_BATCH) or "attn_proj" in remat.names
    n_out = 2 + (1 if n_fwd == 2 and not kept_proj else 0)
    T, K = rules.size(tensor), cfg.n_kv_heads
    # Backward, a column-parallel layer's input gradient is a partial sum over tensor:
    # summed over the sublayer's projections and reduced once per sublayer
    # (parallel.tensor.column_parallel, Megatron's f). Under context parallelism, or SP
    # with kv heads tensor does not split, the partitioner reduces each one's separately: q, k,
    # v (just q when the kv heads are replicated) and the MLP's one (GELU) or two (SwiGLU)
    # input projections.
    mlp_in = cfg.mlp_in
    cp = bool(rules.activation_mesh_axes(Dim.LENGTH))
    fused = not cp and not (ledger.sp and K % T)  # the attention block's; the MLP's: not cp
    bwd_inputs = (1 if fused or K % T else 3) + (1 if not cp else mlp_in)
    if ledger.sp:
        ledger.add("all-gather", tensor, act, micro * n_layers * 2 * n_fwd,
                   "SP: gather the sequence into attention/MLP")
        ledger.add("reduce-scatter", tensor, act, micro * n_layers * n_out,
                   "SP: reduce-scatter attention/MLP outputs")
        ledger.add("all-gather", tensor, act, micro * n_layers * 2, "SP backward: gather output gradients")
        if remat.kind in (Kind.NONE, Kind.SELECTIVE):
            # The sublayers' inputs are kept in their sequence split (parallel.tensor), as
            # Korthikanti et al.'s: gathered again for the weights' gradients.
            ledger.add("all-gather", tensor, act, micro * n_layers * 2,
                       "SP backward: gather the sequence again for the weights' gradients")
        ledger.add("reduce-scatter", tensor, act, micro * n_layers * bwd_inputs,
                   "SP backward: reduce-scatter the input gradient of each column-parallel projection")
    else:
        # MoE layers under a capacity (parallel.experts): their MLP's two reductions are of the
        # experts' slots, [rows, E, C, D], not of the tokens (dropless ones reduce the
        # tokens, as a dense MLP).
        moe = cfg.n_moe_layers if cfg.n_moe_layers and cfg.moe_capacity(ledger.length) else 0
        ledger.add("all-reduce", tensor, act, micro * (n_layers * n_out - moe),
                   "TP: row-parallel attention/MLP outputs")
        ledger.add("all-reduce", tensor, act, micro * (n_layers * bwd_inputs - moe),
                   "TP backward: input gradient of each column-parallel projection")
        if moe:
            ledger.add("all-reduce", tensor, moe_buffer(cfg, rules, ledger.rows, ledger.length, ledger.c),
                       micro * moe * 2,
                       "TP, MoE: the experts' row-parallel outputs, and backward their inputs' gradient")
    if not fused:
        ledger.allow("Under context parallelism (or SP with kv heads fewer than tensor), XLA reduces "
                     "the input gradients of the q, k and v projections (and of SwiGLU's two) "
                     "separately, where Megatron's fused projections have one collective.")


def kv_heads(ledger: Ledger) -> None:
    """Grouped-query attention with fewer kv heads than tensor: the kv heads replicated."""
    cfg, tensor = ledger.cfg, ledger.tensor
    if not tensor:
        return
    T, K = ledger.rules.size(tensor), cfg.n_kv_heads
    if not K % T:
        return
    kv = ledger.rows * ledger.length * cfg.d_head * ledger.c
    micro, n_layers = ledger.grad_accum, cfg.n_layers
    ledger.add("all-reduce", tensor, kv, micro * n_layers * 2,
               "GQA, kv heads replicated: sum each kv head's k, v gradient over its query heads", group=T // K)
    ledger.add("all-gather", tensor, kv * K, micro * n_layers * 2,
               "GQA, kv heads replicated: gather the k, v gradients of all kv heads", group=K)
    if ledger.sp:
        ledger.allow("GQA with kv heads replicated under SP: XLA moves one more activation per layer "
                     "(an all-gather for a reduce-scatter).")
