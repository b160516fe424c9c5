"""Data parallelism's collectives, per device per step: DDP, ZeRO-1/2/3, FSDP and HSDP.

Each parameter's state lies in its at-rest layout (``rules.Strategy``: ZeRO's stage over
``data``, FSDP over ``fsdp``, both for HSDP) and the step moves it (Rajbhandari et al. 2020,
ZeRO; Zhao et al. 2023, PyTorch FSDP):

* ZeRO-3/FSDP: each layer's weights all-gathered into their compute layout where the layer
  scan uses them, once per microbatch and layer, again for the backward pass under
  reshard-after-forward (FSDP's default: ``3 Psi`` per step with the gradient's
  reduce-scatter);
* the gradient reduced over the axes that split the tokens into the layout the update
  uses (``rules.reduced_into``): an all-reduce where it stays replicated (DDP: ``2 Psi``), a
  reduce-scatter into its shard (ZeRO-1: the optimizer's; ZeRO-2/3, FSDP: the gradient's;
  ``Psi``); under HSDP + ZeRO-1 first over fsdp into the gradient's shard, then into the
  optimizer's over data. Over the model-parallel axes that also split the tokens (sequence;
  tensor under SP) XLA reduces in a separate collective, but for a shard left by a
  reduce-scatter over fsdp, which it reduces over every axis still to sum in one;
* ZeRO-1/2: each device updates its optimizer shard, then the updated params are
  all-gathered (``Psi``);
* the two scalars every step sums: the loss and the gradient norm.

A learned position table's and the vocabulary table's gradients are reduced as their own
kernels make them (``traffic.position``, ``traffic.vocab``).
"""

from __future__ import annotations

from jaxshard.analysis.shards import F32, shard_elems
from jaxshard.analysis.traffic.ledger import Ledger, ParamUse
from jaxshard.axes import Dim
from jaxshard.rules import spec_axes


def gathers(ledger: Ledger, use: ParamUse) -> None:
    """ZeRO-1/2's gather of the updated params, ZeRO-3/FSDP's of the weights for compute."""
    p, rules = use.p, ledger.rules
    ledger.add("all-gather", spec_axes(p.opt_state) - spec_axes(p.params),
               ledger.pb * shard_elems(p.shape, p.params, ledger.sizes), 1,
               f"{p.path}: ZeRO-1/2 all-gather of the updated params", after_update=True)
    # FSDP/ZeRO-3 gathers a layer's weights again for its backward pass, unless they are kept.
    regather = rules.strategy.reshard_after_forward and p.in_layers
    ledger.add("all-gather", spec_axes(p.params) - use.model_axes, use.gathered,
               use.per_micro * (2 if regather else 1),
               f"{p.path}: ZeRO-3/FSDP all-gather of the weights for compute"
               + (" (float8)" if use.gathered != use.used else ""))


def gradient(ledger: Ledger, use: ParamUse) -> None:
    """The gradient reduced into its at-rest layout (ZeRO-1: into the optimizer's shard)."""
    p, rules = use.p, ledger.rules
    scatter, first, used, per_micro = use.scatter, use.first, use.used, use.per_micro
    # XLA reduces over the batch axes and over the model-parallel ones (sequence, and tensor
    # under SP) in separate collectives, but for a shard left by a first reduce-scatter, which
    # it reduces over every axis still to sum in one: into the optimizer's shard under ZeRO-1,
    # else an all-reduce.
    shard = used // rules.size(rules.active_axes(scatter))
    batch_axes = set(rules.batch_axes)
    second = scatter - first
    batch, split = (use.reduce & batch_axes) - scatter, use.reduce - batch_axes - scatter
    if first and split and second:
        second, split = second | split, set()
    elif first and split and batch:
        batch, split = batch | split, set()
    ledger.add("reduce-scatter", first, used, per_micro,
               f"{p.path}: gradient reduce-scatter into its ZeRO shard")
    ledger.add("reduce-scatter", second, used // rules.size(rules.active_axes(first)), per_micro,
               f"{p.path}: ZeRO-1: the gradient shard reduce-scattered into the optimizer's")
    ledger.add("all-reduce", batch, shard, per_micro, f"{p.path}: gradient all-reduce over the batch")
    ledger.add("all-reduce", split, shard, per_micro, f"{p.path}: gradient all-reduce over the sequence / tensor split")


def scalars(ledger: Ledger) -> None:
    """The loss summed over the devices that split the tokens, and the gradient norm: each
    device's sum of squares of its shards added up in one reduction (optim.global_norm)."""
    rules = ledger.rules
    ledger.add("all-reduce", set(rules.batch_axes) | set(rules.activation_mesh_axes(Dim.LENGTH)), F32, 1,
               "the loss: the devices' sums of their tokens' losses")
    ledger.add("all-reduce", set().union(*(spec_axes(p.reduced) for p in ledger.params)), F32, 1,
               "the gradient norm: the devices' sums of squares of their gradient shards")
