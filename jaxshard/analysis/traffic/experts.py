"""Expert parallelism's collectives, per device per step (``parallel.experts``; GShard,
Lepikhin et al. 2020).

Each device's dispatch buffer ``[rows, E, C, D]`` goes to the experts' devices with an
all-to-all and comes back with a second; backward, the two transpose into two more: four per
MoE layer per microbatch, each of the buffer's bytes once. ``--remat full`` recomputes the
forward pair (six); every other policy keeps their results.
"""

from __future__ import annotations

from typing import Any

from jaxshard.analysis.shards import run_capacity
from jaxshard.analysis.traffic.ledger import Ledger
from jaxshard.axes import Dim
from jaxshard.remat import Kind
from jaxshard.rules import ShardingRules


def moe_buffer(cfg: Any, rules: ShardingRules, rows: int, seq_len: int, c: int) -> int:
    """Bytes of a device's MoE dispatch buffer ``[rows, E, C, D]`` (experts split over devices)."""
    return rows * cfg.moe_experts * run_capacity(cfg, rules, seq_len) * cfg.d_model * c


def dispatch(ledger: Ledger) -> None:
    """The tokens to their experts' devices and back, forward and backward."""
    cfg, rules = ledger.cfg, ledger.rules
    experts = rules.param_mesh_axes(Dim.EXPERTS)
    if not (experts and cfg.n_moe_layers):
        return
    buf = moe_buffer(cfg, rules, ledger.rows, ledger.length, ledger.c)
    passes = 6 if ledger.remat.kind is Kind.FULL else 4
    ledger.add("all-to-all", experts, buf, ledger.grad_accum * cfg.n_moe_layers * passes,
               "MoE: tokens to their experts' devices and back, forward and backward")
