"""Expert parallelism's collectives, per device per step (``parallel.experts``).

Under a capacity (GShard, Lepikhin et al. 2020): each device's dispatch buffer
``[rows, E, C, D]`` goes to the experts' devices with an all-to-all and comes back with a
second; backward, the two transpose into two more: four per MoE layer per microbatch, each of
the buffer's bytes once. ``--remat full`` recomputes the forward pair (six); every other
policy keeps their results.

Dropless (Megatron's all-gather dispatcher): forward, the tokens ``[T, D]``, their choices
and gates ``[T, 2k]`` (in one float32 buffer where the tokens are float32) are all-gathered
over ``expert`` (n devices) and the outputs ``[n T, D]`` reduce-scattered back; backward,
the outputs' gradient is all-gathered and the tokens' and gates' gradients reduce-scattered.
``--remat full`` gathers the tokens, choices and gates again (the recomputed output is not
needed, so neither is its scatter).
"""

from __future__ import annotations

from typing import Any

from jaxshard.analysis.traffic.ledger import Ledger
from jaxshard.axes import Dim
from jaxshard.remat import Kind
from jaxshard.rules import ShardingRules


def moe_buffer(cfg: Any, rules: ShardingRules, rows: int, seq_len: int, c: int) -> int:
    """Bytes of a device's MoE dispatch buffer ``[rows, E, C, D]`` (under a capacity)."""
    return rows * cfg.moe_experts * cfg.moe_capacity(seq_len) * cfg.d_model * c


def dispatch(ledger: Ledger) -> None:
    """The tokens to their experts' devices and back, forward and backward."""
    cfg, rules = ledger.cfg, ledger.rules
    experts = rules.param_mesh_axes(Dim.EXPERTS)
    if not (experts and cfg.n_moe_layers):
        return
    layers = ledger.grad_accum * cfg.n_moe_layers
    full = ledger.remat.kind is Kind.FULL
    if not cfg.moe_capacity(ledger.length):
        n = rules.size(experts)
        tokens = n * ledger.rows * ledger.length  # every device's, gathered
        x, choices = tokens * cfg.d_model * ledger.c, tokens * 2 * cfg.moe_top_k * 4  # f32 ids and gates
        again = 2 if full else 1
        # One float32 buffer where the tokens travel in float32 (parallel.experts._gathered).
        for buf, what in ([(x + choices, "the tokens, their choices and gates")] if ledger.c == 4 else
                          [(x, "the tokens"), (choices, "the tokens' choices and gates")]):
            ledger.add("all-gather", experts, buf, layers * again, f"MoE dropless: gather {what}")
            ledger.add("reduce-scatter", experts, buf, layers, f"MoE dropless backward: the gradient of {what}")
        ledger.add("reduce-scatter", experts, x, layers, "MoE dropless: the experts' outputs to their tokens")
        ledger.add("all-gather", experts, x, layers, "MoE dropless backward: gather the outputs' gradient")
        return
    buf = moe_buffer(cfg, rules, ledger.rows, ledger.length, ledger.c)
    ledger.add("all-to-all", experts, buf, layers * (6 if full else 4),
               "MoE: tokens to their experts' devices and back, forward and backward")
