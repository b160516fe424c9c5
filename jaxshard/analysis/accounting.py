"""What a configuration holds, sends and computes, per device per step, before compiling.

Everything is derived from the model's shapes and the sharding rules (which accept an
``AbstractMesh``, so a 512-device plan needs no devices):

* **memory** -- params, gradients and optimizer state at rest from each leaf's PartitionSpec
  (our precision policy: float32 params and Adam moments, gradients reduced in the compute
  dtype), the batch, and an estimate of saved activations per remat policy;
* **communication** -- the collectives each strategy implies, with the textbook reason for
  each (:class:`Transfer`), including the few places where XLA's choice differs from the
  textbook and why (``allowance``);
* **FLOPs** -- matmul FLOPs per token with the formula, attention counted as computed (the
  full square, what XLA executes) and as useful (causally halved, for MFU), embeddings as
  gathers (no FLOPs) and the vocabulary projection as a matmul; remat recompute separately
  (hardware vs model FLOPs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import jax
from jax.sharding import PartitionSpec

from jaxshard.analysis import hlo
from jaxshard.axes import Dim, MeshAxis
from jaxshard.model import LanguageModel, Stageable
from jaxshard.parallel.staged import staged
from jaxshard.parallel.vectors import two_stage
from jaxshard.parallel.vocab import reduces_tied_once
from jaxshard.pytree import named_leaves
from jaxshard.remat import Kind, Remat
from jaxshard.rules import ShardingRules, StateKind, spec_axes

F32 = 4


def dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def shard_elems(shape: tuple[int, ...], spec: PartitionSpec, sizes: dict[str, int]) -> int:
    n = 1
    for i, d in enumerate(shape):
        entry = spec[i] if i < len(spec) else None
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        n *= d // math.prod(sizes[a] for a in axes)
    return n


@dataclass(frozen=True)
class ParamInfo:
    """One parameter: its logical dims and where each state of it lives."""

    path: str
    axes: tuple
    shape: tuple[int, ...]
    params: PartitionSpec  # at rest
    grads: PartitionSpec  # at rest, after reduction
    opt_state: PartitionSpec  # each Adam moment
    reduced: PartitionSpec  # where the step reduces the gradient into (ZeRO-1: opt_state's)
    compute: PartitionSpec  # as a layer uses it

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def in_layers(self) -> bool:
        return bool(self.axes) and self.axes[0] == Dim.LAYERS


def param_infos(model: LanguageModel, rules: ShardingRules) -> list[ParamInfo]:
    named_axes = named_leaves(model.param_axes(), is_leaf=lambda x: isinstance(x, tuple))
    shapes = jax.tree.leaves(model.abstract_params())
    out = []
    for (path, ax), x in zip(named_axes, shapes):
        shape = tuple(x.shape)
        out.append(ParamInfo(
            path=path, axes=ax, shape=shape,
            params=rules.param_spec(ax, shape, StateKind.PARAMS),
            grads=rules.param_spec(ax, shape, StateKind.GRADS),
            opt_state=rules.param_spec(ax, shape, StateKind.OPT_STATE),
            reduced=rules.param_spec(ax, shape, rules.reduced_into),
            compute=rules.compute_param_spec(ax, shape)))
    return out


# ---- memory -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Memory:
    """Bytes per device. ``argument`` is what the jitted step takes in (XLA's argument size)."""

    params: int
    grads: int  # transient, at their reduced layout
    opt_state: int
    batch: int
    activations: int  # saved for the backward pass (estimate)
    weights_saved: int  # weights in compute layout that the backward pass keeps (may alias params)
    weights_extra: int  # the part of weights_saved that is not the params themselves
    gathered_layer: int  # one layer's weights in compute layout (FSDP holds this transiently)
    host: int = 0  # the part of params and opt_state kept in host memory (--offload)

    @property
    def argument(self) -> int:
        return self.params + self.opt_state + self.batch + 4  # + the step counter

    @property
    def saved_for_backward(self) -> int:
        return self.activations + self.weights_saved

    @property
    def peak(self) -> int:
        """A planning estimate: state, gradients, activations and extra weight copies, and two
        gathered layers (the one in use and the next being fetched)."""
        return (self.params + self.opt_state - self.host + self.grads + self.activations
                + self.weights_extra + 2 * self.gathered_layer + self.batch)


OPT_COUNTERS = 8  # Adam's and the schedule's int32 step counts
LOSS_SCALE_BYTES = 12  # float16: the scale, its good-step and skipped-step counters


def memory(model: LanguageModel, rules: ShardingRules, batch_size: int, seq_len: int, *,
           compute_dtype: str = "float32", remat: Remat = Remat.NONE, grad_accum: int = 1,
           param_dtype: str = "float32") -> Memory:
    """2-byte ``param_dtype``: params and gradients in 2 bytes, a float32 master copy in the
    optimizer state beside the moments (the classic 2 + 2 + 12); float16 also keeps a loss scale."""
    sizes = rules.sizes
    c = dtype_bytes(compute_dtype)
    pb = dtype_bytes(param_dtype)
    opt_copies = 2 if pb == F32 else 3  # Adam's two moments (+ the master copy)
    remat = Remat.parse(remat)
    infos = param_infos(model, rules)
    params = sum(pb * shard_elems(p.shape, p.params, sizes) for p in infos)
    grads = sum(pb * shard_elems(p.shape, p.grads, sizes) for p in infos)
    moments = sum(opt_copies * F32 * shard_elems(p.shape, p.opt_state, sizes) for p in infos)
    host = ((params if rules.offloaded(StateKind.PARAMS) else 0)
            + (moments if rules.offloaded(StateKind.OPT_STATE) else 0))
    opt = moments + OPT_COUNTERS
    scale = LOSS_SCALE_BYTES if "float16" in (compute_dtype, param_dtype) else 0
    tokens = _local_tokens(rules, batch_size, seq_len)
    layers = model.cfg.n_layers
    layer_weights = sum(c * shard_elems(p.shape, p.compute, sizes) for p in infos if p.in_layers)
    layer_rest = sum(c * shard_elems(p.shape, p.params, sizes) for p in infos if p.in_layers)
    outer_weights = sum(c * shard_elems(p.shape, p.compute, sizes) for p in infos if not p.in_layers)
    # Under ZeRO-3/FSDP the backward pass keeps every layer's gathered weights only without
    # reshard-after-forward; with it (the default) it keeps them as stored and gathers a layer
    # again when it needs it. Otherwise the weights as the forward used them (compute-dtype
    # copies) without remat, as stored with it.
    gathers = rules.gathers_params
    keep = not rules.strategy.reshard_after_forward if gathers else remat.kind is Kind.NONE
    saved = outer_weights + (layer_weights if keep else layer_rest)
    copies = gathers or c != F32
    acts = activation_bytes(model.cfg, rules, batch_size // grad_accum, seq_len, c, remat)
    return Memory(params=params, grads=grads, opt_state=opt + scale, batch=2 * 4 * tokens,
                  activations=acts, weights_saved=saved, weights_extra=saved if copies else 0,
                  gathered_layer=layer_weights // layers if gathers else 0, host=host)


@dataclass(frozen=True)
class ClassicBytes:
    """The textbook's bytes per parameter on each device (ZeRO, Rajbhandari et al. 2020, Fig. 1)."""

    device: float
    host: float
    formula: str  # e.g. "2 + 2 + 12/N", offloaded terms after "host:"


def classic_bytes_per_param(stage: int, n: int, param_bytes: int = 4,
                            offload: tuple[str, ...] = ()) -> ClassicBytes:
    """Params and gradients of ``param_bytes`` each and the optimizer's K bytes (Adam's two
    float32 moments, plus a float32 master copy when params are 2-byte: the paper's K = 12),
    each divided by ``n`` from the ZeRO stage that shards it (1: optimizer, 2: + gradients,
    3/FSDP: + params); ``offload`` moves the optimizer's or the params' term to the host."""
    k = 2 * F32 if param_bytes == F32 else 3 * F32
    terms = [(param_bytes, stage >= 3, "params" in offload), (param_bytes, stage >= 2, False),
             (k, stage >= 1, "optimizer" in offload)]
    device = [(b, sharded) for b, sharded, host in terms if not host]
    host = [(b, sharded) for b, sharded, on_host in terms if on_host]

    def text(ts):
        return " + ".join(f"{b}/N" if sharded else f"{b}" for b, sharded in ts) or "0"

    def value(ts):
        return float(sum(b / n if sharded else b for b, sharded in ts))

    return ClassicBytes(device=value(device), host=value(host),
                        formula=text(device) + (f", host: {text(host)}" if host else ""))


def _local_tokens(rules: ShardingRules, batch_size: int, seq_len: int) -> int:
    return (batch_size // rules.size(rules.batch_axes)) * (seq_len // _seq_split(rules))


def _seq_split(rules: ShardingRules) -> int:
    return rules.size(rules.activation_mesh_axes(Dim.LENGTH))


def activation_bytes(cfg: Any, rules: ShardingRules, batch_size: int, seq_len: int, c: int,
                     remat: Remat) -> int:
    """Activations saved for the backward pass per device, one microbatch. Per layer per
    token, as XLA keeps them (counted from ``print_saved_residuals``):

    * no remat: 6 D of the residual stream (norm inputs, normalised values, sums; split over
      tensor under SP), 2 N H + 2 K H of q, k, v and the attention output (split by heads),
      2 N L of attention scores and probabilities (split by heads), 6 F of MLP intermediates
      (GELU's tanh pieces or SwiGLU's gate/up/products; split over tensor);
    * dots: the matmul outputs (2 D, the projections, N L scores, 1 or 2 F MLP inputs);
      dots_no_batch: those without batch dims (not the scores nor the attention output);
    * full: the layer's input, D.

    Plus the float32 logits' exponentials ``[tokens, V / tensor]`` and a few per-token stats.
    """
    t = rules.size(rules.activation_mesh_axes(Dim.ACT_HEADS))
    sp = rules.size(rules.activation_mesh_axes(Dim.RESIDUAL_LENGTH)) // _seq_split(rules)
    tokens = _local_tokens(rules, batch_size, seq_len)
    D, N, K, H, F, L = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_mlp, seq_len
    kv_t = t if K % t == 0 else 1
    projections = 2 * N * H / t + 2 * K * H / kv_t
    mlp_in = 2 if getattr(cfg.mlp, "value", cfg.mlp) == "swiglu" else 1
    named = {"qkv": N * H / t + 2 * K * H / kv_t, "attn_out": N * H / t, "attn_proj": D / sp,
             "mlp_in": mlp_in * F / t, "mlp_hidden": F / t}
    remat = Remat.parse(remat)
    match remat.kind:
        case Kind.FULL | Kind.OFFLOAD:  # offload: the named ones are in host memory
            per_token_layer = D / sp
        case Kind.NAMES:  # the layer's input and the named activations
            per_token_layer = D / sp + sum(named[n] for n in set(remat.names))
        case Kind.DOTS:  # every matmul output: projections, scores, p v, MLP inputs/output
            per_token_layer = 2 * D / sp + projections + N * L / t + mlp_in * F / t
        case Kind.DOTS_NO_BATCH:  # no batched matmuls: not the scores nor p v
            per_token_layer = 2 * D / sp + projections - N * H / t + mlp_in * F / t
        case Kind.SELECTIVE:  # no attention scores or probabilities: they are recomputed
            per_token_layer = 6 * D / sp + projections + 6 * F / t
        case _:
            per_token_layer = 6 * D / sp + projections + 2 * N * L / t + 6 * F / t
    n_moe = cfg.n_moe_layers
    moe = 0.0
    if n_moe:  # an MoE layer's feed-forward in place of the dense one
        moe = n_moe * (_moe_ffn_saved(cfg, rules, remat, L, t, sp) - _dense_ffn_saved(remat, F, mlp_in, t))
    logits = F32 * tokens * cfg.padded_vocab / t
    return int(c * (per_token_layer * cfg.n_layers + moe) * tokens + logits + 4 * D * tokens * c / sp)


def _dense_ffn_saved(remat: Remat, F: int, mlp_in: int, t: int) -> float:
    """The MLP's part of :func:`activation_bytes`' per-token-per-layer elements."""
    match remat.kind:
        case Kind.NONE | Kind.SELECTIVE:
            return 6 * F / t
        case Kind.DOTS | Kind.DOTS_NO_BATCH:
            return mlp_in * F / t
        case Kind.NAMES:
            return sum({"mlp_in": mlp_in * F / t, "mlp_hidden": F / t}.get(n, 0) for n in set(remat.names))
    return 0.0


def _moe_ffn_saved(cfg: Any, rules: ShardingRules, remat: Remat, L: int, t: int, sp: int) -> float:
    """An MoE layer's feed-forward, per token, as autodiff keeps it (counted from
    ``print_saved_residuals`` on moe-tiny): per expert slot a token fills -- r = E C / S under a
    capacity (every slot, filled or not), k dropless (ragged rows) -- the expert MLP's
    intermediates and 1.5 D of dispatched rows and outputs (no remat), or its matmul outputs
    (dots; the ragged path's are not dots, the capacity path's are batched over experts, so
    dots_no_batch keeps neither); the router's logits and probabilities; shared experts as a
    dense MLP of their width."""
    E, D = cfg.moe_experts, cfg.d_model
    Fe = cfg.moe_d_mlp or cfg.d_mlp
    mlp_in = 2 if getattr(cfg.mlp, "value", cfg.mlp) == "swiglu" else 1
    cap = run_capacity(cfg, rules, L)
    slots = E * cap / L if cap else cfg.moe_top_k
    shared = _dense_ffn_saved(remat, cfg.moe_shared_experts * Fe, mlp_in, t) if cfg.moe_shared_experts else 0.0
    match remat.kind:
        case Kind.NONE | Kind.SELECTIVE:
            return slots * (6 * Fe / t + 1.5 * D) + 12 * E + shared
        case Kind.DOTS:
            return (slots * (mlp_in * Fe / t + D) if cap else 0) + E + shared
        case Kind.DOTS_NO_BATCH:
            return E + shared
    return shared


# ---- communication ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Transfer:
    """One expected collective (or a group of identical ones), per device per step."""

    kind: str
    axes: tuple[str, ...]
    bytes: int  # the full buffer of one execution (as hlo.Collective.bytes)
    executions: int
    what: str
    group: int = 0

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


def pipeline_transfers(model: Stageable, rules: ShardingRules, schedule: Any, batch_size: int, seq_len: int,
                       compute_dtype: str = "float32") -> list[Transfer]:
    """What a pipeline's stages send each other per step, per device: every tick one stage
    input (a microbatch's residual stream, in its layout: SP splits its length) to the next
    stage and one gradient of it to the previous. In lockstep SPMD a tick's send runs whether
    or not the stage has a microbatch to pass, so it is ``ticks`` sends per direction where the
    textbook's is M (the executor's idle ticks carry zeros)."""
    rows = batch_size // schedule.microbatches // rules.size(rules.batch_axes)
    length = seq_len // rules.size(rules.activation_mesh_axes(Dim.RESIDUAL_LENGTH))
    one = rows * length * model.cfg.d_model * dtype_bytes(compute_dtype)
    stage = rules.active_axes((MeshAxis.STAGE,))
    return [Transfer("collective-permute", stage, one, schedule.ticks, "stage inputs to the next stage", 2),
            Transfer("collective-permute", stage, one, schedule.ticks, "their gradients to the previous stage", 2)]


def pipeline_memory(model: Stageable, rules: ShardingRules, schedule: Any, batch_size: int, seq_len: int,
                    **kwargs: Any) -> Memory:
    """:func:`memory` of a pipelined step: the stored stack's state (a layout with chunks or
    empty slots stores more slots than layers), and as activations what a stage keeps for each
    of the ``schedule.slots`` chunk-microbatches it holds at once -- the residuals of ``depth``
    layers of one microbatch and the chunk's input -- plus one microbatch's logits and
    per-token statistics, which the last stage holds in its backward slot."""
    layout = schedule.layout
    mem = memory(staged(model, layout), rules, batch_size, seq_len, **kwargs)
    micro = batch_size // schedule.microbatches
    c = dtype_bytes(kwargs.get("compute_dtype", "float32"))

    def saved(n_layers: int) -> int:
        return activation_bytes(model.cfg.replace(n_layers=n_layers), rules, micro, seq_len, c,
                                kwargs.get("remat", Remat.NONE))

    per_layer = saved(2) - saved(1)
    sp = rules.size(rules.activation_mesh_axes(Dim.RESIDUAL_LENGTH)) // _seq_split(rules)
    stage_input = c * _local_tokens(rules, micro, seq_len) * model.cfg.d_model // sp
    return replace(mem, activations=schedule.slots * (layout.depth * per_layer + stage_input)
                   + saved(1) - per_layer)


def pipeline_communication(model: Stageable, rules: ShardingRules, schedule: Any, batch_size: int,
                           seq_len: int, *, compute_dtype: str = "float32",
                           param_dtype: str = "float32") -> Communication:
    """The collectives of a pipelined step outside the schedule's slots, per device: the stage
    sends of every tick (:func:`pipeline_transfers`), the gradients' reductions once at the end
    -- over the data replicas the stage's layers' (an all-reduce; ZeRO-1: a reduce-scatter and
    the updated params' all-gather), over the stages and replicas the outer params' (the
    embedding's from stage 0, the head's from the last) -- and the loss and gradient norm.
    What runs inside the slots (FSDP's gathers and reduce-scatters, tensor parallelism's
    reductions) runs as often as the schedule gives each stage work, which the compiled
    step's loop does not record; it is not predicted here."""
    from jaxshard.parallel.pipeline import replica_axes

    stored = staged(model, schedule.layout)
    pb, sizes = dtype_bytes(param_dtype), rules.sizes
    replicas = replica_axes(rules)
    stage = rules.active_axes((MeshAxis.STAGE,))
    infos = param_infos(stored, rules)
    layers = sum(pb * shard_elems(p.shape, p.params, sizes) for p in infos if p.in_layers)
    outer = sum(pb * shard_elems(p.shape, p.params, sizes) for p in infos
                if not p.in_layers and p.axes[:1] != (Dim.POSITION,))
    # A learned position table's gradient: its first L rows (the executor is given only those),
    # under sequence parallelism split over tensor by row, reduced, then gathered.
    position = [p for p in infos if p.axes[:1] == (Dim.POSITION,)]
    rows = sum(pb * seq_len * shard_elems(p.shape[1:], PartitionSpec(*p.params[1:]), sizes) for p in position)
    tensor = rules.activation_mesh_axes(Dim.ACT_HEADS)
    sp = tuple(a for a in tensor if a in rules.activation_mesh_axes(Dim.RESIDUAL_LENGTH))
    zero1 = bool(replicas) and rules.strategy.zero == 1
    reduce = "reduce-scatter" if zero1 else "all-reduce"
    out = list(pipeline_transfers(model, rules, schedule, batch_size, seq_len, compute_dtype))

    def add(kind, axes, nbytes, what):
        axes = rules.active_axes(axes)
        if axes and nbytes:
            out.append(Transfer(kind, axes, int(nbytes), 1, what, rules.size(axes)))

    add(reduce, replicas, layers, "the stage's layer gradients over the data replicas, once a step")
    add(reduce, stage + replicas, outer + rows // rules.size(sp) + 4,
        "the outer params' gradients (both ends; the used position rows) and the loss, once")
    add("all-gather", sp, rows, "the used position rows' gradient, from the sequence-parallel shards")
    if zero1:
        table = sum(pb * shard_elems(p.shape, p.params, sizes) for p in position)
        add("all-gather", replicas, layers + outer + table, "ZeRO-1: the updated params")
    # The gradient norm: one scalar over every axis that splits some gradient.
    split = set(stage) | {a for p in infos for a in spec_axes(p.grads)}
    add("all-reduce", tuple(split), 4, "the gradient norm")
    return Communication(out)


def predict(model: Stageable, rules: ShardingRules, batch_size: int, seq_len: int, schedule: Any = None,
            **kwargs: Any) -> tuple[Memory, Communication]:
    """:func:`memory` and :func:`communication` of a step, or, under a pipeline ``schedule``,
    :func:`pipeline_memory` and :func:`pipeline_communication` (the collectives outside the
    schedule's slots). ``kwargs``: compute_dtype, remat, grad_accum, param_dtype (and reducer,
    without a schedule)."""
    reducer = kwargs.pop("reducer", "gspmd")
    if schedule is None:
        return (memory(model, rules, batch_size, seq_len, **kwargs),
                communication(model, rules, batch_size, seq_len, reducer=reducer, **kwargs))
    dtypes = {k: kwargs[k] for k in ("compute_dtype", "param_dtype") if k in kwargs}
    return (pipeline_memory(model, rules, schedule, batch_size, seq_len, **kwargs),
            pipeline_communication(model, rules, schedule, batch_size, seq_len, **dtypes))


def run_capacity(cfg: Any, rules: ShardingRules, seq_len: int) -> int:
    """The slots per expert per sequence an MoE layer runs (0: dropless, ragged rows): the
    config's capacity, or with the experts split over devices and dropless S, which
    ``models/moe.py`` runs because the all-to-all needs fixed sizes."""
    return cfg.moe_capacity(seq_len) or (seq_len if rules.param_mesh_axes(Dim.EXPERTS) else 0)


def moe_buffer(cfg: Any, rules: ShardingRules, rows: int, seq_len: int, c: int) -> int:
    """Bytes of a device's MoE dispatch buffer ``[rows, E, C, D]`` (experts split over devices)."""
    return rows * cfg.moe_experts * run_capacity(cfg, rules, seq_len) * cfg.d_model * c


def communication(model: LanguageModel, rules: ShardingRules, batch_size: int, seq_len: int, *,
                  compute_dtype: str = "float32", remat: Remat = Remat.NONE,
                  grad_accum: int = 1, param_dtype: str = "float32", reducer: str = "gspmd") -> Communication:
    """The collectives one step needs, per device, with the textbook reason for each.
    ``reducer`` 'explicit' (jaxshard.training.reducer) reduces every gradient whole, as DDP does: a learned
    position table's too, where GSPMD reduces only the rows the step used."""
    cfg, sizes = model.cfg, rules.sizes
    c = dtype_bytes(compute_dtype)
    pb = dtype_bytes(param_dtype)
    out: list[Transfer] = []
    allowances: list[str] = []

    def add(kind, axes, nbytes, executions, what, group=None):
        axes = rules.active_axes(axes)
        if axes and nbytes and executions:
            out.append(Transfer(kind, axes, int(nbytes), executions, what, group or rules.size(axes)))

    remat = Remat.parse(remat)
    recompute = remat.recomputes
    # FSDP/ZeRO-3 gathers a layer's weights again for its backward pass, unless they are kept.
    regather = rules.strategy.reshard_after_forward
    tensor = rules.activation_mesh_axes(Dim.ACT_HEADS)
    sp = set(tensor) <= set(rules.activation_mesh_axes(Dim.RESIDUAL_LENGTH)) and bool(tensor)
    split = set(rules.batch_axes) | set(rules.activation_mesh_axes(Dim.LENGTH))

    # Parameters: gathered where a layer uses them, gradients reduced into their at-rest layout.
    for p in param_infos(model, rules):
        model_axes = spec_axes(p.compute)
        used = c * shard_elems(p.shape, p.compute, sizes)
        per_micro = grad_accum
        if p.in_layers:  # the scan gathers and reduces one layer at a time
            used //= p.shape[0]
            per_micro *= p.shape[0]
        # ZeRO-1/2: each device updates its optimizer shard, then the params are re-assembled.
        add("all-gather", spec_axes(p.opt_state) - spec_axes(p.params),
            pb * shard_elems(p.shape, p.params, sizes), 1,
            f"{p.path}: ZeRO-1/2 all-gather of the updated params")
        gather_axes = spec_axes(p.params) - model_axes
        add("all-gather", gather_axes, used, per_micro * (2 if regather and p.in_layers else 1),
            f"{p.path}: ZeRO-3/FSDP all-gather of the weights for compute")
        # (Not over the axes that split the param itself: an expert's tokens come to its device.)
        reduce_axes = set(split) - model_axes
        kv_replicated = Dim.KV_HEADS in p.axes and tensor and cfg.n_kv_heads % rules.size(tensor)
        if (sp or kv_replicated) and not (model_axes & set(tensor)):
            reduce_axes |= set(tensor)  # computed on tensor-split activations
        # Reduced into the at-rest gradient layout; under ZeRO-1 into the optimizer's shard,
        # first into the gradient's own layout (HSDP + ZeRO-1: each layer's over fsdp, then
        # that shard over data).
        scatter = (spec_axes(p.reduced) - model_axes) & reduce_axes
        first = (spec_axes(p.grads) - model_axes) & scatter or scatter
        if p.axes and p.axes[0] == Dim.POSITION:
            # A slice of the first L rows: only those rows have a gradient. They are disjoint
            # across the sequence shards, so those gather rather than sum.
            used_rows = p.shape[0] if reducer == "explicit" else seq_len
            rows = c * used_rows * shard_elems(p.shape[1:], PartitionSpec(*p.compute[1:]), sizes)
            seq_axes = reduce_axes - set(rules.batch_axes)
            # (HSDP + ZeRO-1: XLA reduce-scatters them over fsdp and all-reduces that shard
            # over data; they are a few rows.)
            batch_scatter = first & set(rules.batch_axes)
            own = rows // rules.size(rules.active_axes(seq_axes))  # this sequence shard's rows
            add("reduce-scatter", batch_scatter, own, per_micro, f"{p.path}: gradient of the used rows")
            add("all-reduce", set(rules.batch_axes) - batch_scatter,
                own // rules.size(rules.active_axes(batch_scatter)), per_micro,
                f"{p.path}: gradient of the used rows (HSDP: their shard)")
            cp_axes = seq_axes & set(rules.activation_mesh_axes(Dim.LENGTH))
            add("all-gather", cp_axes, rows, per_micro, f"{p.path}: gradient rows held by sequence shards")
            # Under SP, XLA sends them between the tensor shards with collective-permutes: an
            # all-gather's bytes.
            T = rules.size(rules.active_axes(seq_axes - cp_axes))
            add("collective-permute", seq_axes - cp_axes, rows * (T - 1) // T, per_micro,
                f"{p.path}: gradient rows held by sequence-parallel shards")
            continue
        if p.axes and p.axes[0] == Dim.VOCAB:
            # The lookup kernel sums its share of the table gradient over all the batch and
            # sequence axes at once. Given the table as per-batch-shard copies
            # (parallel.vocab.table_copies: tied, or untied under HSDP), a tied table's
            # projection share is summed with it first and the sum is reduced like any other
            # gradient (below: under HSDP a reduce-scatter over fsdp, then an all-reduce of the
            # shard over data). Under context parallelism the projection's share is reduced
            # separately.
            copies = reduces_tied_once(rules) and (cfg.tie_embeddings or two_stage(rules))
            if not copies:
                add("reduce-scatter" if scatter else "all-reduce", reduce_axes, used, per_micro,
                    f"{p.path}: gradient of the lookup")
                if not cfg.tie_embeddings:
                    continue
                allowances.append("Tied embeddings under context parallelism: XLA reduces the "
                                  "table gradients of the lookup and of the vocabulary projection "
                                  "separately (one table-sized reduction more).")
        # XLA reduces over the batch axes and over the model-parallel ones (sequence, and tensor
        # under SP) in separate collectives.
        shard = used // rules.size(rules.active_axes(scatter))
        batch_axes = set(rules.batch_axes)
        add("reduce-scatter", first, used, per_micro,
            f"{p.path}: gradient reduce-scatter into its ZeRO shard")
        add("reduce-scatter", scatter - first, used // rules.size(rules.active_axes(first)), per_micro,
            f"{p.path}: ZeRO-1: the gradient shard reduce-scattered into the optimizer's")
        add("all-reduce", (reduce_axes & batch_axes) - scatter, shard, per_micro,
            f"{p.path}: gradient all-reduce over the batch")
        add("all-reduce", reduce_axes - batch_axes - scatter, shard, per_micro,
            f"{p.path}: gradient all-reduce over the sequence / tensor split")

    L_local = seq_len // _seq_split(rules)
    B_local = batch_size // rules.size(rules.batch_axes) // grad_accum
    act = B_local * L_local * cfg.d_model * c
    n_fwd = 2 if recompute and remat.kind is not Kind.SELECTIVE else 1  # the layer runs twice
    # A recomputed layer repeats its row-parallel output reduction where the backward pass needs
    # the value: the attention block's (the MLP's input), unless the policy kept it; the MLP
    # block's output is dead in the recompute.
    kept_proj = remat.kind in (Kind.DOTS, Kind.DOTS_NO_BATCH) or "attn_proj" in remat.names
    n_out = 2 + (1 if n_fwd == 2 and not kept_proj else 0)
    if tensor:
        T = rules.size(tensor)
        layers, micro = cfg.n_layers, grad_accum
        K = cfg.n_kv_heads
        # Backward, a column-parallel layer's input gradient is a partial sum over tensor:
        # summed over the sublayer's projections and reduced once per sublayer
        # (parallel.tensor.column_parallel, Megatron's f). Under context parallelism, or SP
        # with kv heads tensor does not split, the partitioner reduces each one's separately: q, k, v (just q when the kv heads are replicated) and the MLP's one
        # (GELU) or two (SwiGLU) input projections.
        mlp_in = 2 if getattr(cfg.mlp, "value", cfg.mlp) == "swiglu" else 1
        cp = bool(rules.activation_mesh_axes(Dim.LENGTH))
        fused = not cp and not (sp and K % T)  # the attention block's; the MLP's: not cp
        bwd_inputs = (1 if fused or K % T else 3) + (1 if not cp else mlp_in)
        if sp:
            add("all-gather", tensor, act, micro * layers * 2 * n_fwd, "SP: gather the sequence into attention/MLP")
            add("reduce-scatter", tensor, act, micro * layers * n_out, "SP: reduce-scatter attention/MLP outputs")
            add("all-gather", tensor, act, micro * layers * 2, "SP backward: gather output gradients")
            add("reduce-scatter", tensor, act, micro * layers * bwd_inputs,
                "SP backward: reduce-scatter the input gradient of each column-parallel projection")
            add("reduce-scatter", tensor, act, micro, "SP: vocab-parallel embedding, reduce-scattered")
            add("all-gather", tensor, act, micro, "SP backward: embedding output gradient")
            add("all-gather", tensor, act, micro, "SP: gather the sequence for the vocabulary projection")
            add("reduce-scatter", tensor, act, micro, "SP backward: vocabulary projection input gradient")
        else:
            # MoE layers with the experts split (parallel.experts): their MLP's two reductions
            # are of the experts' slots, [rows, E, C, D], not of the tokens.
            moe = cfg.n_moe_layers if rules.param_mesh_axes(Dim.EXPERTS) else 0
            add("all-reduce", tensor, act, micro * (layers * n_out - moe), "TP: row-parallel attention/MLP outputs")
            add("all-reduce", tensor, act, micro * (layers * bwd_inputs - moe),
                "TP backward: input gradient of each column-parallel projection")
            if moe:
                add("all-reduce", tensor, moe_buffer(cfg, rules, B_local, L_local, c), micro * moe * 2,
                    "TP, MoE: the experts' row-parallel outputs, and backward their inputs' gradient")
            add("all-reduce", tensor, act, micro, "TP: vocab-parallel embedding")
            add("all-reduce", tensor, act, micro, "TP backward: vocabulary projection input gradient")
        add("all-reduce", tensor, B_local * L_local * F32, 3 * micro,
            "vocab-parallel cross-entropy: max, sum of exponentials, target logit per token")
        if not fused:
            allowances.append("Under context parallelism (or SP with kv heads fewer than tensor), "
                              "XLA reduces the input "
                              "gradients of the q, k and v projections (and of SwiGLU's two) "
                              "separately, where Megatron's fused projections have one collective.")
        if K % T:
            kv = B_local * L_local * cfg.d_head * c
            add("all-reduce", tensor, kv, micro * layers * 2,
                "GQA, kv heads replicated: sum each kv head's k, v gradient over its query heads",
                group=T // K)
            add("all-gather", tensor, kv * K, micro * layers * 2,
                "GQA, kv heads replicated: gather the k, v gradients of all kv heads", group=K)
            if sp:
                allowances.append("GQA with kv heads replicated under SP: XLA moves one more "
                                  "activation per layer (an all-gather for a reduce-scatter).")
    experts = rules.param_mesh_axes(Dim.EXPERTS)
    if experts and cfg.n_moe_layers:
        # Each device's dispatch buffer [rows, E, C, D] to the experts' devices and back, and
        # the two again backward (parallel.experts); --remat full sends the forward pair twice.
        buf = moe_buffer(cfg, rules, B_local, L_local, c)
        add("all-to-all", experts, buf, grad_accum * cfg.n_moe_layers * (6 if remat.kind is Kind.FULL else 4),
            "MoE: tokens to their experts' devices and back, forward and backward")
    seq = rules.activation_mesh_axes(Dim.LENGTH)
    if seq:
        S = rules.size(seq)
        kv_local = B_local * L_local * cfg.n_kv_heads * cfg.d_head * c
        kv_t = rules.size(tensor) if tensor and cfg.n_kv_heads % rules.size(tensor) == 0 else 1
        # S - 1 hops of k and v per attention; the backward pass sends the gradients back the
        # same way. Any remat recomputes the ring (selective's attention core is the ring).
        ring_fwd = 2 if recompute else 1
        add("collective-permute", seq, kv_local // kv_t,
            grad_accum * cfg.n_layers * 2 * (S - 1) * (ring_fwd + 1),
            "CP: pass key and value chunks around the ring (forward and backward)")
    # Two scalars: the loss summed over the devices that split the tokens, and the gradient
    # norm, each device's sum of squares of its shards added up in one reduction (optim.global_norm).
    add("all-reduce", set(rules.batch_axes) | set(rules.activation_mesh_axes(Dim.LENGTH)), F32, 1,
        "the loss: the devices' sums of their tokens' losses")
    add("all-reduce", set().union(*(spec_axes(p.reduced) for p in param_infos(model, rules))), F32, 1,
        "the gradient norm: the devices' sums of squares of their gradient shards")
    if c != F32:
        allowances.append("On CPU the embedding lookup runs in float32 (XLA:CPU cannot promote its "
                          "bf16 gradient reduction), so that reduction moves twice the bytes listed.")
    return Communication(out, allowances)


# ---- FLOPs ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Flops:
    """Per step. ``per_device`` is what one device executes (XLA's cost analysis counts this);
    ``model`` is the useful work for MFU (causal attention halved, no recompute)."""

    matmul_per_token: int  # forward, layers + vocabulary projection, attention as computed
    attention_per_token: int  # forward, the full L x L square per layer
    elementwise_per_token: int  # forward, an estimate: norms, softmax, activations, adds
    tokens: int
    per_device: float  # forward + backward (+ recompute) + optimizer, what one device runs
    model: float  # 6 N_matmul + causal attention, whole step, all devices
    hardware: float  # what runs: full attention squares and remat recompute, all devices
    formula: str


ADAMW_FLOPS = 20  # per parameter element per step: clip, moments, bias correction, decay, update


def flops(cfg: Any, rules: ShardingRules, batch_size: int, seq_len: int, *,
          remat: Remat = Remat.NONE, model: LanguageModel | None = None) -> Flops:
    """FLOPs of one step. With ``model``, the optimizer's elementwise work is added too."""
    D, N, K, H, F, L = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_mlp, seq_len
    mlp_mats = 3 if getattr(cfg.mlp, "value", cfg.mlp) == "swiglu" else 2
    attn_params = D * (N + 2 * K) * H + N * H * D
    # Matmul params a token passes through, summed over the layers: as the model counts them
    # (MoE: the router and k experts) and as the hardware runs them (under a capacity every
    # expert runs all its C slots per sequence, E C / S per token, filled or not).
    n_moe = cfg.n_moe_layers
    layer_params = hw_layer_params = cfg.n_layers * attn_params + (cfg.n_layers - n_moe) * mlp_mats * D * F
    moe_text = ""
    if n_moe:
        E, k = cfg.moe_experts, cfg.moe_top_k
        expert = mlp_mats * D * (cfg.moe_d_mlp or F)
        always = D * E + cfg.moe_shared_experts * expert  # router and shared experts
        cap = run_capacity(cfg, rules, L)
        layer_params += n_moe * (always + k * expert)
        hw_layer_params += n_moe * (always + (E * cap / L if cap else k) * expert)
        moe_text = f", of which {n_moe} MoE layers count the router and {k} of {E} experts"
    head = D * cfg.padded_vocab
    attention = 2 * 2 * L * N * H  # q k^T and p v, per token per layer, full square
    matmul = 2 * (layer_params + head)
    fwd = 2 * (hw_layer_params + head) + cfg.n_layers * attention
    tokens = batch_size * seq_len
    remat = Remat.parse(remat)
    # Matmuls a policy recomputes: none under dots (every matmul output kept), the attention
    # core's under selective and dots_no_batch (scores and p v are batched), all of the layer's
    # otherwise (names/offload keep a few outputs; counted as full).
    match remat.kind:
        case Kind.NONE | Kind.DOTS:
            recompute = 0
        case Kind.SELECTIVE | Kind.DOTS_NO_BATCH:
            recompute = cfg.n_layers * attention
        case _:
            recompute = 2 * hw_layer_params + cfg.n_layers * attention
    model_flops = tokens * (3 * matmul + 3 * cfg.n_layers * attention // 2)
    # (Pipeline stages split the layers: each device computes 1/P of them, the bubble aside.)
    devices = rules.size(rules.batch_axes) * rules.size(rules.activation_mesh_axes(Dim.LENGTH)) * \
        rules.size(rules.activation_mesh_axes(Dim.ACT_HEADS)) * rules.size(rules.param_mesh_axes(Dim.LAYERS))
    formula = (f"forward per token = 2 x ({layer_params:,} matmul params in {cfg.n_layers} layers"
               f"{moe_text} + {head:,} vocabulary projection) + {cfg.n_layers} x 4 x L x heads x d_head "
               f"(attention, L = {L}); step = 3 x forward (backward = 2 x){' + recompute' if recompute else ''}; "
               f"MFU counts causal attention at half")
    hardware = int(tokens * (3 * fwd + recompute))
    # Elementwise work (XLA counts it as FLOPs too): ~20 per residual element (two norms, adds),
    # ~5 per attention score (mask, max, subtract, sum, scale), ~10 per MLP hidden element.
    elementwise = cfg.n_layers * (20 * D + 5 * N * L + 10 * F) + 10 * cfg.padded_vocab
    optimizer = 0
    if model is not None:
        optimizer = ADAMW_FLOPS * sum(shard_elems(p.shape, p.opt_state, rules.sizes)
                                      for p in param_infos(model, rules))
    return Flops(matmul_per_token=matmul, attention_per_token=cfg.n_layers * attention,
                 elementwise_per_token=elementwise, tokens=tokens,
                 per_device=(hardware + 3 * tokens * elementwise) / devices + optimizer,
                 model=model_flops, hardware=hardware, formula=formula)
