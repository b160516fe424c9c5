"""What a step's collectives are written in: one expected collective (:class:`Transfer`), a
step's list of them (:class:`Communication`), and the :class:`Ledger` each strategy's
accounting adds its own to, with the quantities several strategies read (the compute dtype's
bytes, the tensor axes, a device's activation, where a parameter's gradient is reduced).

A transfer's ``bytes`` is the full buffer of one execution, as XLA's HLO names it
(``analysis.hlo.Collective.bytes``); what a device sends of it on a ring follows from its kind
and group (``hlo.ring_sent_bytes``: 2 (n - 1) / n of the buffer for an all-reduce, (n - 1) / n
for a gather, scatter or all-to-all, all of it for a permute).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxshard.analysis import hlo
from jaxshard.analysis.shards import ParamInfo, dtype_bytes, param_infos, seq_split, shard_elems
from jaxshard.axes import Dim
from jaxshard.fp8 import gathers_as_float8
from jaxshard.model import LanguageModel
from jaxshard.remat import Remat
from jaxshard.rules import ShardingRules, spec_axes


@dataclass(frozen=True)
class Transfer:
    """One expected collective (or a group of identical ones), per device per step."""

    kind: str
    axes: tuple[str, ...]
    bytes: int  # the full buffer of one execution (as hlo.Collective.bytes)
    executions: int
    what: str
    group: int = 0
    # After the optimizer update (ZeRO-1/2's gather of the updated params): nothing of the
    # step is left to overlap it with.
    after_update: bool = False

    @property
    def total(self) -> int:
        return self.bytes * self.executions

    @property
    def sent_bytes(self) -> float:
        return hlo.ring_sent_bytes(self.kind, self.total, self.group)


@dataclass(frozen=True)
class Communication:
    transfers: list[Transfer]
    allowances: list[str] = field(default_factory=list)

    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.transfers:
            out[t.kind] = out.get(t.kind, 0) + t.total
        return out

    def by_kind_and_axes(self) -> dict[tuple[str, tuple[str, ...]], int]:
        out: dict[tuple[str, tuple[str, ...]], int] = {}
        for t in self.transfers:
            out[(t.kind, t.axes)] = out.get((t.kind, t.axes), 0) + t.total
        return out


@dataclass(frozen=True)
class ParamUse:
    """How a step uses one parameter: the bytes of one use in compute layout, how many uses,
    and the axes its gradient is reduced over (``reduce``), scattered into its at-rest shard
    over (``scatter``: under ZeRO-1 the optimizer's), and scattered first over (``first``:
    the gradient's own layout, HSDP + ZeRO-1's reduce-scatter over fsdp)."""

    p: ParamInfo
    used: int  # one layer's for the layer stack: the scan gathers and reduces a layer at a time
    per_micro: int  # uses per step: microbatches, times the layers for the stack
    model_axes: set[str]  # the axes that split it in compute (tensor, expert)
    reduce: set[str]
    scatter: set[str]
    first: set[str]
    gathered: int  # the bytes of one FSDP gather of it (float8 weights: 1 an element; else ``used``)


class Ledger:
    """One step's collectives per device, as each strategy's accounting adds them."""

    def __init__(self, model: LanguageModel, rules: ShardingRules, batch_size: int, seq_len: int, *,
                 compute_dtype: str = "float32", remat: Remat = Remat.NONE, grad_accum: int = 1,
                 param_dtype: str = "float32", reducer: str = "gspmd", fp8_bytes: int = 1):
        """``fp8_bytes``: what a float8 element takes in a collective (1; 2 on XLA:CPU, which
        widens float8 collectives to float16)."""
        self.model, self.cfg, self.rules, self.sizes = model, model.cfg, rules, rules.sizes
        self.fp8_bytes = fp8_bytes
        self.seq_len, self.grad_accum, self.reducer = seq_len, grad_accum, reducer
        self.c, self.pb = dtype_bytes(compute_dtype), dtype_bytes(param_dtype)
        self.remat = Remat.parse(remat)
        self.params = param_infos(model, rules)
        self.tensor = rules.activation_mesh_axes(Dim.ACT_HEADS)
        # Sequence parallelism: the residual stream's length split over tensor too.
        self.sp = set(self.tensor) <= set(rules.activation_mesh_axes(Dim.RESIDUAL_LENGTH)) and bool(self.tensor)
        self.split = set(rules.batch_axes) | set(rules.activation_mesh_axes(Dim.LENGTH))  # the tokens'
        # One microbatch's rows and sequence shard on a device, and its residual stream's bytes.
        self.rows = batch_size // rules.size(rules.batch_axes) // grad_accum
        self.length = seq_len // seq_split(rules)
        self.act = self.rows * self.length * self.cfg.d_model * self.c
        self.transfers: list[Transfer] = []
        self.allowances: list[str] = []

    def add(self, kind: str, axes, nbytes: float, executions: int, what: str, group: int | None = None,
            after_update: bool = False) -> None:
        """A collective over the active ones of ``axes`` (none if none is, or nothing is sent)."""
        axes = self.rules.active_axes(axes)
        if axes and nbytes and executions:
            self.transfers.append(Transfer(kind, axes, int(nbytes), executions, what,
                                           group or self.rules.size(axes), after_update))

    def allow(self, text: str) -> None:
        """A known difference between what XLA compiles and the textbook's collectives."""
        self.allowances.append(text)

    def use(self, p: ParamInfo) -> ParamUse:
        rules, tensor = self.rules, self.tensor
        model_axes = spec_axes(p.compute)
        used = self.c * shard_elems(p.shape, p.compute, self.sizes)
        per_micro = self.grad_accum
        # --fp8 tensorwise gathers a block's matrices as float8 (rules._gather_fp8).
        float8 = p.in_layers and gathers_as_float8(getattr(self.cfg, "fp8", None), p.axes[1:])
        gathered = self.fp8_bytes * used // self.c if float8 else used
        if p.in_layers:
            used //= p.shape[0]
            gathered //= p.shape[0]
            per_micro *= p.shape[0]
        # (Not over the axes that split the param itself: an expert's tokens come to its device.)
        reduce = set(self.split) - model_axes
        kv_replicated = Dim.KV_HEADS in p.axes and tensor and self.cfg.n_kv_heads % rules.size(tensor)
        if (self.sp or kv_replicated) and not (model_axes & set(tensor)):
            reduce |= set(tensor)  # computed on tensor-split activations
        scatter = (spec_axes(p.reduced) - model_axes) & reduce
        first = (spec_axes(p.grads) - model_axes) & scatter or scatter
        return ParamUse(p, used, per_micro, model_axes, reduce, scatter, first, gathered)

    def communication(self) -> Communication:
        return Communication(self.transfers, self.allowances)
