"""What a configuration holds, sends and computes, per device per step, before compiling.

Everything is derived from the model's shapes and the sharding rules (which accept an
``AbstractMesh``, so a 512-device plan needs no devices):

* **memory** -- params, gradients and optimizer state at rest from each leaf's PartitionSpec
  (our precision policy: float32 params and Adam moments, gradients reduced in the compute
  dtype), the batch, and an estimate of saved activations per remat policy;
* **communication** -- the collectives each strategy implies, with the textbook reason for
  each (:class:`Transfer`), including the few places where XLA's choice differs from the
  textbook and why (``allowance``): each strategy's in its own module of ``traffic``
  (``traffic.tensor`` for tensor parallelism, ...), composed by :func:`communication`;
* **FLOPs** -- matmul FLOPs per token with the formula, attention counted as computed (the
  full square, what XLA executes) and as useful (causally halved, for MFU), embeddings as
  gathers (no FLOPs) and the vocabulary projection as a matmul; remat recompute separately
  (hardware vs model FLOPs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import jax

# The shapes' measure and the collectives (one module per strategy) live below; their names
# are the accounting's too.
from jaxshard.analysis import hlo
from jaxshard.analysis.shards import (  # noqa: F401
    F32, ParamInfo, dtype_bytes, local_tokens, param_infos, seq_split, shard_elems)
from jaxshard.analysis.traffic import Communication, Transfer, communication  # noqa: F401
from jaxshard.analysis.traffic.pipeline import pipeline_communication, pipeline_transfers  # noqa: F401
from jaxshard.axes import Dim
from jaxshard.model import LanguageModel, Stageable
from jaxshard.parallel import attention as attention_lib
from jaxshard.parallel import grouped
from jaxshard.parallel.pipeline import TICK_SCOPE
from jaxshard.parallel.staged import staged
from jaxshard.remat import Kind, Remat
from jaxshard.rules import ShardingRules, StateKind

if TYPE_CHECKING:
    from jaxshard.training.step import Program, StepConfig


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
    # The outer params' (embedding, head) gradient in compute layout: under ZeRO-3/FSDP it is
    # whole until its reduce-scatter, during the head's backward pass (the embedding's
    # scatter-add target lives as long).
    outer_grads: int = 0
    recompute: int = 0  # what a layer's backward pass holds beyond the saved activations (recompute_bytes)
    logits: int = 0  # the part of activations the head's backward pass frees (the float32 logits')

    @property
    def argument(self) -> int:
        return self.params + self.opt_state + self.batch + 4  # + the step counter

    @property
    def saved_for_backward(self) -> int:
        return self.activations + self.weights_saved

    @property
    def temp(self) -> int:
        """What is not an argument of the step: gradients, the layers' saved activations, extra
        weight copies, and the larger of what the head's backward pass holds (the logits' saved
        exponentials and the outer params' whole gradient) and what the layers' backward pass
        does once the head's is done (two gathered layers: the one in use and the next being
        fetched; and what a layer's backward pass holds beyond the saved activations,
        :func:`recompute_bytes`)."""
        return (self.grads + self.activations - self.logits + self.weights_extra
                + max(2 * self.gathered_layer + self.recompute, self.logits + self.outer_grads))

    @property
    def peak(self) -> int:
        """A planning estimate: the state at rest, the batch and :attr:`temp`."""
        return self.params + self.opt_state - self.host + self.batch + self.temp


OPT_COUNTERS = 8  # Adam's and the schedule's int32 step counts
LOSS_SCALE_BYTES = 12  # float16: the scale, its good-step and skipped-step counters


def memory(model: LanguageModel, rules: ShardingRules, batch_size: int, seq_len: int, *,
           compute_dtype: str = "float32", remat: Remat = Remat.NONE, grad_accum: int = 1,
           param_dtype: str = "float32", flash: bool = False) -> Memory:
    """2-byte ``param_dtype``: params and gradients in 2 bytes, a float32 master copy in the
    optimizer state beside the moments (the classic 2 + 2 + 12); float16 also keeps a loss scale.
    ``flash``: attention by a flash kernel (cuDNN's on GPUs), which keeps no probabilities."""
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
    tokens = local_tokens(rules, batch_size, seq_len)
    layers = model.cfg.n_layers
    layer_weights = sum(c * shard_elems(p.shape, p.compute, sizes) for p in infos if p.in_layers)
    layer_stored = sum(pb * shard_elems(p.shape, p.params, sizes) for p in infos if p.in_layers)
    outer_weights = sum(c * shard_elems(p.shape, p.compute, sizes) for p in infos if not p.in_layers)
    # Each layer's weights are cast (and, under ZeRO-3/FSDP, gathered) inside the layer loop,
    # one layer at a time. The backward pass keeps every layer's compute-layout copies only
    # where nothing recomputes them: under FSDP without reshard-after-forward, otherwise
    # without remat; else it keeps the params as stored (no copy) and casts or gathers a layer
    # again when it needs it. The outer params (embedding, head) are cast once for the step.
    gathers = rules.gathers_params
    keep = not rules.strategy.reshard_after_forward if gathers else remat.kind is Kind.NONE
    saved = outer_weights + (layer_weights if keep else layer_stored)
    copies = gathers or c != F32
    extra = outer_weights + (layer_weights if keep else 0) if copies else 0
    acts = activation_bytes(model.cfg, rules, batch_size // grad_accum, seq_len, c, remat, flash)
    again = recompute_bytes(model.cfg, rules, batch_size // grad_accum, seq_len, c, remat, flash)
    return Memory(params=params, grads=grads, opt_state=opt + scale, batch=2 * 4 * tokens,
                  activations=acts, weights_saved=saved, weights_extra=extra,
                  gathered_layer=layer_weights // layers if gathers else 0, host=host,
                  outer_grads=outer_weights if gathers else 0, recompute=again,
                  logits=logits_bytes(model.cfg, rules, batch_size // grad_accum, seq_len))


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


def activation_bytes(cfg: Any, rules: ShardingRules, batch_size: int, seq_len: int, c: int,
                     remat: Remat, flash: bool = False) -> int:
    """Activations saved for the backward pass per device, one microbatch. Per layer per
    token, as XLA keeps them (counted from ``print_saved_residuals``):

    * no remat: 4 D of the residual stream (each norm's input and output; split over tensor
      under SP, whose gathered copies are made again in the backward pass), 2 N H + 2 K H of
      q, k, v and the attention output (split by heads), N L of attention probabilities (split
      by heads), and the MLP's activation inputs and output, 2 F (GELU) or 3 F (SwiGLU) --
      Korthikanti et al. 2022's count, as the norms, activations and softmax are recomputed
      from their inputs (``remat.elementwise``);
    * dots: the matmul outputs (2 D, the projections, N L scores, 1 or 2 F MLP inputs);
      dots_no_batch: those without batch dims (not the scores nor the attention output);
    * full: the layer's input, D.

    With ``flash`` (a flash kernel) each row's float32 softmax statistic in place of the N L
    probabilities. Plus the final norm's input and output, and the float32 logits'
    exponentials ``[tokens, V / tensor]`` (:func:`logits_bytes`).
    """
    sp = rules.size(rules.activation_mesh_axes(Dim.RESIDUAL_LENGTH)) // seq_split(rules)
    tokens = local_tokens(rules, batch_size, seq_len)
    per_token_layer, moe = _layer_elements(cfg, rules, seq_len, c, Remat.parse(remat), flash)
    return int(c * (per_token_layer * cfg.n_layers + cfg.n_moe_layers * moe) * tokens
               + logits_bytes(cfg, rules, batch_size, seq_len) + 2 * cfg.d_model * tokens * c / sp)


def logits_bytes(cfg: Any, rules: ShardingRules, batch_size: int, seq_len: int) -> int:
    """The float32 logits' exponentials the loss keeps for its backward pass, ``[tokens, V /
    tensor]`` per device."""
    t = rules.size(rules.activation_mesh_axes(Dim.ACT_HEADS))
    return int(F32 * local_tokens(rules, batch_size, seq_len) * cfg.padded_vocab / t)


def recompute_bytes(cfg: Any, rules: ShardingRules, batch_size: int, seq_len: int, c: int,
                    remat: Remat, flash: bool = False) -> int:
    """What a layer's backward pass holds beyond the saved activations, of the largest layer (an
    MoE layer where the model has one): under remat the activations it makes again (as no remat
    keeps them, less what the policy kept); under any policy the cotangents of its MLP's hidden
    inputs (``mlp_in`` F per token, or per expert slot), each an operand of two matmuls (the
    weight gradient and the input gradient), so made whole, and for dropless experts split over
    n devices three of the dispatcher's ``[n T, D]`` buffers."""
    remat = Remat.parse(remat)
    none, none_moe = _layer_elements(cfg, rules, seq_len, c, Remat.NONE, flash)
    kept, kept_moe = _layer_elements(cfg, rules, seq_len, c, remat, flash)
    t = rules.size(rules.activation_mesh_axes(Dim.ACT_HEADS))
    hidden = cfg.mlp_in * cfg.d_mlp / t
    if cfg.n_moe_layers:
        # The all-gather dispatcher's rows, every token of the expert group D wide: the outputs
        # before their reduce-scatter and the cotangents of both them and the gathered tokens
        # (which are kept, or under full made again: counted above).
        dispatched = 3 * dispatcher_group(cfg, rules, seq_len) * cfg.d_model
        hidden = max(hidden, expert_rows(cfg, rules, seq_len) * cfg.mlp_in * (cfg.moe_d_mlp or cfg.d_mlp) / t
                     + dispatched)
        again = (none + none_moe) - (kept + kept_moe)
    else:
        again = none - kept
    return int(c * (max(again, 0.0) + hidden) * local_tokens(rules, batch_size, seq_len))


def _layer_elements(cfg: Any, rules: ShardingRules, seq_len: int, c: int, remat: Remat,
                    flash: bool) -> tuple[float, float]:
    """:func:`activation_bytes`' elements per token of a dense layer, and what an MoE layer
    keeps beyond it."""
    t = rules.size(rules.activation_mesh_axes(Dim.ACT_HEADS))
    sp = rules.size(rules.activation_mesh_axes(Dim.RESIDUAL_LENGTH)) // seq_split(rules)
    D, N, K, H, F, L = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_mlp, seq_len
    kv_t = t if K % t == 0 else 1
    projections = 2 * N * H / t + 2 * K * H / kv_t
    mlp_in = cfg.mlp_in
    named = {"qkv": N * H / t + 2 * K * H / kv_t, "attn_out": N * H / t, "attn_proj": D / sp,
             "mlp_in": mlp_in * F / t, "mlp_hidden": F / t}
    # A flash kernel keeps each row's float32 softmax statistic instead of the probabilities,
    # and so does a ring (its backward pass recomputes them from it, ``attention._ring_attention``).
    scores = N * F32 / c / t if flash or attention_lib.ring_size(rules) > 1 else N * L / t
    match remat.kind:
        case Kind.FULL | Kind.OFFLOAD:  # offload: the named ones are in host memory
            per_token_layer = D / sp
        case Kind.NAMES:  # the layer's input and the named activations
            per_token_layer = D / sp + sum(named[n] for n in set(remat.names))
        case Kind.DOTS:  # every matmul output: projections, scores, p v, MLP inputs/output
            per_token_layer = 2 * D / sp + projections + scores + mlp_in * F / t
        case Kind.DOTS_NO_BATCH:  # no batched matmuls: not the scores nor p v
            per_token_layer = 2 * D / sp + projections - N * H / t + mlp_in * F / t
        case Kind.SELECTIVE if attention_lib.ring_size(rules) == 1:  # no probabilities: recomputed
            per_token_layer = 4 * D / sp + projections + (mlp_in + 1) * F / t
        case _:
            per_token_layer = 4 * D / sp + projections + scores + (mlp_in + 1) * F / t
    moe = 0.0
    if cfg.n_moe_layers:  # an MoE layer's feed-forward in place of the dense one
        moe = _moe_ffn_saved(cfg, rules, remat, L, t, sp) - _dense_ffn_saved(remat, F, mlp_in, t)
    return per_token_layer, moe


def saved_library_outputs(cfg: Any, rules: ShardingRules, remat: Remat) -> float:
    """Of what a dense layer saves for its backward pass (:func:`activation_bytes`), the
    elements per token that library calls write -- the projections' matmuls (q, k, v, the
    attention and MLP output projections, the MLP's input projections) and, where the policy
    keeps it, the flash kernel's output and its float32 softmax statistic -- as opposed to
    XLA's own fusions (norms, activations), which can write into a slice of the layer scan's
    stacked buffer directly."""
    t = rules.size(rules.activation_mesh_axes(Dim.ACT_HEADS))
    sp = rules.size(rules.activation_mesh_axes(Dim.RESIDUAL_LENGTH)) // seq_split(rules)
    D, N, K, H, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_mlp
    kv_t = t if K % t == 0 else 1
    named = {"qkv": N * H / t + 2 * K * H / kv_t, "attn_proj": D / sp, "mlp_in": cfg.mlp_in * F / t}
    remat = Remat.parse(remat)
    match remat.kind:
        case Kind.FULL | Kind.OFFLOAD:
            return 0.0
        case Kind.NAMES:
            return sum(named.get(n, 0.0) for n in set(remat.names))
    dots = 2 * D / sp + named["qkv"] + named["mlp_in"]
    return dots + (N * H / t + 2 * N / t if remat.kind == Kind.NONE else 0.0)  # + the kernel's output, statistic


def _dense_ffn_saved(remat: Remat, F: int, mlp_in: int, t: int) -> float:
    """The MLP's part of :func:`activation_bytes`' per-token-per-layer elements."""
    match remat.kind:
        case Kind.NONE | Kind.SELECTIVE:
            return (mlp_in + 1) * F / t
        case Kind.DOTS | Kind.DOTS_NO_BATCH:
            return mlp_in * F / t
        case Kind.NAMES:
            return sum({"mlp_in": mlp_in * F / t, "mlp_hidden": F / t}.get(n, 0) for n in set(remat.names))
    return 0.0


def expert_slots(cfg: Any, seq_len: int) -> float:
    """Expert slots an MoE layer computes per token: E C / S under a capacity (every slot,
    filled or not), k dropless (the routed choices: a grouped matmul's tile padding aside,
    which the step reports as ``moe_computed``)."""
    cap = cfg.moe_capacity(seq_len)
    return cfg.moe_experts * cap / seq_len if cap else cfg.moe_top_k


def dispatcher_group(cfg: Any, rules: ShardingRules, seq_len: int) -> int:
    """n, the devices whose tokens the all-gather dispatcher gathers for each (dropless experts
    split over an ``expert`` group of n > 1); 0 where it does not run."""
    n = rules.size(rules.param_mesh_axes(Dim.EXPERTS))
    return n if cfg.moe_experts and not cfg.moe_capacity(seq_len) and n > 1 else 0


def expert_rows(cfg: Any, rules: ShardingRules, seq_len: int) -> float:
    """Expert rows an MoE layer holds per token of a device: its slots, but dropless with the
    experts split over n devices n min(k, E / n), the most its experts can receive (a
    token's k choices are different experts; the all-gather dispatcher's buffers have that
    static size; only the rows received are computed)."""
    if cfg.moe_capacity(seq_len):
        return expert_slots(cfg, seq_len)
    n = rules.size(rules.param_mesh_axes(Dim.EXPERTS))
    return n * min(cfg.moe_top_k, cfg.moe_experts // n)


def _moe_ffn_saved(cfg: Any, rules: ShardingRules, remat: Remat, L: int, t: int, sp: int) -> float:
    """An MoE layer's feed-forward, per token, as autodiff keeps it (counted from
    ``print_saved_residuals`` on moe-tiny): per expert slot a token fills -- r = E C / S under a
    capacity (every slot, filled or not) -- the expert MLP's intermediates and 1.5 D of
    dispatched rows and outputs (no remat), or its matmul outputs (dots; batched over experts,
    so dots_no_batch keeps neither); dropless, per row (k, or n min(k, E / n) with the
    experts over n devices: the dispatcher's buffers) the grouped kernel's pre-activations (which the dots
    policies keep by name) and the row's token, gate and expert, and with the experts split the
    n D of the gathered tokens (but under full); the router's logits and probabilities; shared
    experts as a dense MLP of their width."""
    E, D = cfg.moe_experts, cfg.d_model
    Fe = cfg.moe_d_mlp or cfg.d_mlp
    mlp_in = cfg.mlp_in
    cap = cfg.moe_capacity(L)
    slots = expert_rows(cfg, rules, L)
    shared = _dense_ffn_saved(remat, cfg.moe_shared_experts * Fe, mlp_in, t) if cfg.moe_shared_experts else 0.0
    if not cap:  # the grouped kernel: its pre-activations and each row's token, gate and expert
        # With the experts split over n devices, every policy but full keeps the all-gather
        # dispatcher's gathered tokens (``EXCHANGED``: recomputing them would send them again).
        exchanged = dispatcher_group(cfg, rules, L) * D if remat.kind is not Kind.FULL else 0.0
        match remat.kind:
            case Kind.NONE | Kind.SELECTIVE:
                return slots * (mlp_in * Fe / t + 3) + 12 * E + shared + exchanged
            case Kind.DOTS | Kind.DOTS_NO_BATCH:
                return slots * mlp_in * Fe / t + D + E + shared + exchanged
        return shared + exchanged
    match remat.kind:
        case Kind.NONE | Kind.SELECTIVE:
            return slots * ((mlp_in + 1) * Fe / t + 1.5 * D) + 12 * E + shared
        case Kind.DOTS:
            return slots * (mlp_in * Fe / t + D) + E + shared
        case Kind.DOTS_NO_BATCH:
            return E + shared
    return shared


# ---- a step's prediction -------------------------------------------------------------------

def pipeline_memory(model: Stageable, rules: ShardingRules, schedule: Any, batch_size: int, seq_len: int,
                    **kwargs: Any) -> Memory:
    """:func:`memory` of a pipelined step: the stored stack's state (a layout with chunks or
    empty slots stores more slots than layers), and as activations what a stage keeps for each
    of the ``schedule.slots`` chunk-microbatches it holds at once -- the residuals of ``depth``
    layers of one microbatch, and the chunk's input where the schedule keeps inputs
    (``Schedule.keeps_inputs``: GPipe) -- plus one microbatch's logits and
    per-token statistics, which the last stage holds in its backward slot. A recomputed
    layer's activations (``recompute``) are one microbatch's."""
    layout = schedule.layout
    mem = memory(staged(model, layout), rules, batch_size, seq_len, **kwargs)
    micro = batch_size // schedule.microbatches
    c = dtype_bytes(kwargs.get("compute_dtype", "float32"))
    remat, flash = kwargs.get("remat", Remat.NONE), kwargs.get("flash", False)

    def saved(n_layers: int) -> int:
        return activation_bytes(model.cfg.replace(n_layers=n_layers), rules, micro, seq_len, c, remat, flash)

    per_layer = saved(2) - saved(1)
    sp = rules.size(rules.activation_mesh_axes(Dim.RESIDUAL_LENGTH)) // seq_split(rules)
    stage_input = c * local_tokens(rules, micro, seq_len) * model.cfg.d_model // sp if schedule.keeps_inputs else 0
    return replace(mem, activations=schedule.slots * (layout.depth * per_layer + stage_input)
                   + saved(1) - per_layer,
                   recompute=recompute_bytes(model.cfg, rules, micro, seq_len, c, remat, flash),
                   logits=logits_bytes(model.cfg, rules, micro, seq_len))


def step_options(step: StepConfig, model: LanguageModel, program: Program) -> dict[str, Any]:
    """The options of :func:`predict` (and :func:`memory`, :func:`communication`) for the step
    ``program`` that ``build_program(model, rules, optim, step)`` made: the step's dtypes and
    accumulation, the model's remat policy, and the reducer -- 'explicit' where the program
    reduces the gradients in buckets itself."""
    return {"compute_dtype": step.compute_dtype, "remat": model.remat, "grad_accum": step.grad_accum,
            "param_dtype": step.param_dtype, "reducer": "explicit" if program.buckets else "gspmd",
            # XLA:CPU widens float8 collectives to float16 (its float normalization)
            "fp8_bytes": 2 if jax.default_backend() == "cpu" else 1}


def predict(model: Stageable, rules: ShardingRules, batch_size: int, seq_len: int, schedule: Any = None,
            **kwargs: Any) -> tuple[Memory, Communication]:
    """:func:`memory` and :func:`communication` of a step, or, under a pipeline ``schedule``,
    :func:`pipeline_memory` and :func:`pipeline_communication` (the collectives outside the
    schedule's slots). ``kwargs``: compute_dtype, remat, grad_accum, param_dtype (and reducer,
    without a schedule, and fp8_bytes), and ``flash``: attention by a flash kernel (cuDNN's on
    GPUs), which keeps no probabilities."""
    reducer, fp8_bytes = kwargs.pop("reducer", "gspmd"), kwargs.pop("fp8_bytes", 1)
    if schedule is None:
        return (memory(model, rules, batch_size, seq_len, **kwargs),
                communication(model, rules, batch_size, seq_len, reducer=reducer, fp8_bytes=fp8_bytes,
                              **{k: v for k, v in kwargs.items() if k != "flash"}))
    dtypes = {k: kwargs[k] for k in ("compute_dtype", "param_dtype") if k in kwargs}
    return (pipeline_memory(model, rules, schedule, batch_size, seq_len, **kwargs),
            pipeline_communication(model, rules, schedule, batch_size, seq_len, **dtypes))


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
    hardware: float  # what runs: attention as computed (the full square but for a balanced ring's or a flash kernel's share) and recompute, all devices
    formula: str
    recompute: float = 0.0  # of ``hardware``: the matmuls run again (the remat policy's; a ring's and a flash kernel's scores)
    devices: int = 1  # the devices the work splits over (a pipeline's stages included)

    def waste(self, compiled: float) -> dict[str, float]:
        """The matmul FLOPs one device's compiled step runs (``compiled``: hlo.dot_flops)
        against the useful ones (``model`` over the devices), split into what is expected
        beyond the useful -- the remat policy's recompute, and the rest of ``hardware``: the
        masked half of a causal attention computed whole, expert slots computed empty -- and
        what nothing explains."""
        useful, expected = self.model / self.devices, self.hardware / self.devices
        recompute = self.recompute / self.devices
        return {"compiled": compiled, "useful": useful, "recompute": recompute,
                "masked_or_padding": expected - useful - recompute, "expected": expected,
                "ratio": compiled / useful, "unexplained": compiled / expected}


def uncounted(hlo_text: str, schedule: Any = None) -> str | None:
    """Why :func:`matmul_waste` cannot count a compiled step's matmuls as they run, or None:
    a stage layout with empty layer slots skips them in branches under no tick op's scope
    (each would count as run); a program without the tick ops' names (``TICK_SCOPE``), as an
    executable from a compilation cache keeps the names it was compiled under."""
    if schedule is None:
        return None
    if schedule.layout is not None and schedule.layout.padded:
        return "a stage layout with empty layer slots skips them in branches the count does not tell apart"
    if TICK_SCOPE not in hlo_text:
        return ("the compiled pipeline carries no tick op names (an executable from the compilation cache, "
                "compiled before they were named?)")
    return None


def matmul_waste(fl: Flops, hlo_text: str, cfg: Any, rules: ShardingRules, batch_size: int, seq_len: int, *,
                 grad_accum: int = 1, computed: float | None = None, schedule: Any = None) -> dict[str, Any] | None:
    """:meth:`Flops.waste` of a compiled step (its HLO text), its loops counted by trip count.
    A loop whose trip count is known only at run time -- dropless experts' grouped matmuls on
    CPU, one tile an iteration, one loop a tile size (``parallel.grouped``) -- counts per row for
    ``computed`` k rows per token of a device per MoE layer: the step's ``moe_computed``
    where it ran, else 1 (the routed choices, the tiles' padding aside).
    ``data_dependent`` is their share of ``compiled``.
    Under a pipeline ``schedule`` every stage runs the same program, each op of a tick in a
    branch taken where the tables say: a stage's dots in an op's branch count as often as the
    tables run that op there (:meth:`Schedule.op_runs`), and ``compiled`` is the stages' mean
    (the useful work is the step's over all devices, stages included); ``stages`` has each.
    None where :func:`uncounted` says why not."""
    if uncounted(hlo_text, schedule):
        return None
    shares = [None]
    if schedule is not None:
        shares = [{op: n / schedule.ticks for op, n in schedule.op_runs(s).items()} for s in range(schedule.stages)]
        grad_accum *= schedule.microbatches
    tokens = batch_size * seq_len // rules.size(rules.batch_axes) // grad_accum  # a microbatch's
    n, k = rules.size(rules.param_mesh_axes(Dim.EXPERTS)), cfg.moe_top_k
    stages = []
    loops_mean = 0.0
    for share in shares:
        per_iteration = hlo.loop_dot_flops(hlo_text, share, TICK_SCOPE)
        loops = 0.0
        if per_iteration:
            # (An iteration of each of the kernel's loops, one a tile size, computes their sum's rows.)
            tiles = sum(grouped.tile_sizes(grouped.tile_rows(n * tokens * k / cfg.moe_experts)))
            loops = per_iteration / tiles * (1.0 if computed is None else computed) * k * tokens
        stages.append(hlo.dot_flops(hlo_text, share, TICK_SCOPE) + loops)
        loops_mean += loops / len(shares)
    out = {**fl.waste(sum(stages) / len(stages)), "data_dependent": loops_mean,
           "rows_measured": float(computed is not None)}
    return out | ({"stages": stages} if schedule is not None else {})


def waste_cell(waste: dict[str, Any] | None) -> str:
    """A table's cell for :func:`matmul_waste`: the compiled matmul FLOPs over the useful ones,
    and what the useful work, the policy's recompute and the kernels leave unexplained (x1.00:
    nothing wasted); '-' where they are not counted."""
    return "-" if waste is None else f"x{waste['ratio']:.2f} (x{waste['unexplained']:.2f} unexplained)"


ADAMW_FLOPS = 20  # per parameter element per step: clip, moments, bias correction, decay, update


def flops(cfg: Any, rules: ShardingRules, batch_size: int, seq_len: int, *,
          remat: Remat = Remat.NONE, model: LanguageModel | None = None, kernel: str = "xla") -> Flops:
    """FLOPs of one step. With ``model``, the optimizer's elementwise work is added too.
    ``kernel``: the dense attention path's (``attention.gpu_kernel``; CPU: "xla"), whose share
    of the square it computes counts where no ring runs (``attention.computed_share``)."""
    D, N, K, H, F, L = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_mlp, seq_len
    mlp_mats = cfg.mlp_in + 1
    attn_params = D * (N + 2 * K) * H + N * H * D
    # Matmul params a token passes through, summed over the layers: as the model counts them
    # (MoE: the router and k experts) and as the hardware runs them (under a capacity every
    # expert runs all its C slots per sequence, E C / S per token, filled or not).
    n_moe = cfg.n_moe_layers
    layer_params = hw_layer_params = cfg.n_layers * attn_params + (cfg.n_layers - n_moe) * mlp_mats * D * F
    # Grouped-query attention with fewer kv heads than tensor: the kv heads are replicated, so
    # every tensor device projects all of them (Megatron requires tensor to divide the kv heads).
    t = rules.size(rules.activation_mesh_axes(Dim.ACT_HEADS))
    if K % t:
        hw_layer_params += cfg.n_layers * 2 * D * K * H * (t - 1)
    moe_text = ""
    if n_moe:
        E, k = cfg.moe_experts, cfg.moe_top_k
        expert = mlp_mats * D * (cfg.moe_d_mlp or F)
        always = D * E + cfg.moe_shared_experts * expert  # router and shared experts
        layer_params += n_moe * (always + k * expert)
        hw_layer_params += n_moe * (always + expert_slots(cfg, L) * expert)
        moe_text = f", of which {n_moe} MoE layers count the router and {k} of {E} experts"
    head = D * cfg.padded_vocab
    square = 2 * 2 * L * N * H  # q k^T and p v, per token per layer, the full square
    ring = attention_lib.ring_size(rules)
    # As computed: the full square (the future masked) by the materialised softmax, the dense
    # path's on CPU, where the waste is counted; by a GPU's flash kernels (cuDNN's, and the
    # blockwise one) the blocks before the diagonal; a contiguous ring's full square; a
    # balanced ring's share of it. (Ulysses attends over the whole sequence by the dense path.)
    attention = int(square * attention_lib.computed_share(kernel, L)) if ring == 1 else square
    balanced = attention_lib.balances(cfg, ring, L)
    if balanced:
        attention = int(square * attention_lib.balanced_work(ring, L))
    matmul = 2 * (layer_params + head)
    fwd = 2 * (hw_layer_params + head) + cfg.n_layers * attention
    tokens = batch_size * seq_len
    remat = Remat.parse(remat)
    # Matmuls a policy recomputes: none under dots (every matmul output kept), the attention
    # core's under selective and dots_no_batch (scores and p v are batched), all of the layer's
    # otherwise but its last, the MLP's (the experts') down projection, whose output the
    # backward pass does not read (names/offload keep a few outputs; counted as full).
    last = (cfg.n_layers - n_moe) * D * F
    if n_moe:
        last += n_moe * (expert_slots(cfg, L) + cfg.moe_shared_experts) * D * (cfg.moe_d_mlp or F)
    # A ring's backward pass computes its scores (q k^T) again from the saved log-sum-exp:
    # counted under none and dots, and under selective, which leaves a ring's core alone
    # (remat.attention_core). Where the policy recomputes the attention's forward pass, XLA
    # shares those scores with it (but for the balanced ring's chosen pair of each later step:
    # 3/32 of its forward attention on 4 devices, left unexplained), except in the pairs folded
    # in key blocks, whose loops it cannot share (attention.blocked_share).
    unshared = cfg.n_layers * attention * attention_lib.blocked_share(ring, L, balanced) // 2 \
        if ring > 1 else 0
    match remat.kind:
        case Kind.NONE | Kind.DOTS:
            recompute = cfg.n_layers * attention // 2 if ring > 1 else 0
        case Kind.SELECTIVE if ring > 1:
            recompute = cfg.n_layers * attention // 2
        case Kind.SELECTIVE | Kind.DOTS_NO_BATCH:
            recompute = cfg.n_layers * attention + unshared
        case _:
            recompute = 2 * (hw_layer_params - last) + cfg.n_layers * attention + unshared
    # A flash kernel's backward pass (cuDNN's, the blockwise one) makes its scores again too,
    # under every policy: a forward pass that a policy runs again keeps none for it, but for
    # the blockwise kernel's single block, whose scores XLA shares with that pass's (one loop).
    shared = kernel == "blockwise" and L <= attention_lib.BLOCK and remat.kind not in (Kind.NONE, Kind.DOTS)
    if ring == 1 and kernel != "xla" and not shared:
        recompute += cfg.n_layers * attention // 2
    model_flops = tokens * (3 * matmul + 3 * cfg.n_layers * square // 2)
    # (Pipeline stages split the layers: each device computes 1/P of them, the bubble aside.)
    devices = rules.size(rules.batch_axes) * rules.size(rules.activation_mesh_axes(Dim.LENGTH)) * \
        rules.size(rules.activation_mesh_axes(Dim.ACT_HEADS)) * rules.size(rules.param_mesh_axes(Dim.LAYERS))
    computes = "a balanced ring computes" if balanced else f"the {kernel} kernel computes"
    share = f"; {computes} {attention / square:.0%} of it" if attention != square else ""
    formula = (f"forward per token = 2 x ({layer_params:,} matmul params in {cfg.n_layers} layers"
               f"{moe_text} + {head:,} vocabulary projection) + {cfg.n_layers} x 4 x L x heads x d_head "
               f"(attention, L = {L}{share}); step = 3 x forward (backward = 2 x){' + recompute' if recompute else ''}; "
               f"MFU counts causal attention at half")
    hardware = int(tokens * (3 * fwd + recompute))
    # Elementwise work (XLA counts it as FLOPs too): ~20 per residual element (two norms, adds),
    # ~5 per attention score (mask, max, subtract, sum, scale), ~10 per MLP hidden element.
    elementwise = cfg.n_layers * (20 * D + 5 * N * L * attention // square + 10 * F) + 10 * cfg.padded_vocab
    optimizer = 0
    if model is not None:
        optimizer = ADAMW_FLOPS * sum(shard_elems(p.shape, p.opt_state, rules.sizes)
                                      for p in param_infos(model, rules))
    return Flops(matmul_per_token=matmul, attention_per_token=cfg.n_layers * square,
                 elementwise_per_token=elementwise, tokens=tokens,
                 per_device=(hardware + 3 * tokens * elementwise) / devices + optimizer,
                 model=model_flops, hardware=hardware, formula=formula, recompute=tokens * recompute,
                 devices=devices)
