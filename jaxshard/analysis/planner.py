"""Rank meshes and strategies for a model on a cluster, from the accounting and the time model.

For every way to split the devices into ``stage`` x ``data`` x ``fsdp`` x ``tensor`` (tensor
within a host; a pipeline's stages outermost, so they are what crosses hosts first), ZeRO
stage, sequence parallelism, remat policy and gradient accumulation (the other way to keep
fewer activations than recomputing them), the planner predicts per-device memory
(:func:`jaxshard.analysis.accounting.memory`) and the step time of the time model
(:mod:`jaxshard.analysis.timing`: compute, the pipeline bubble, and the communication the
software does not hide, each collective priced at the bandwidth of the link it crosses --
within a host, or across hosts for an axis whose groups span hosts; mesh axes nest outermost
first, so the outermost axes cross hosts). Plans that do not fit are marked; among those that
do, the fastest wins and, within 7% (finer than the time model can tell: ``TIE``), the simpler one.

A pipeline plan runs 1F1B with the most microbatches up to 4P that split the batch (at least
P). Its model: each device holds 1/P of the layers and keeps at most 2P - 1 microbatches'
activations; its compute is a stage's, idle for the bubble, (P - 1) / M of it; its
collectives are a stage's: 1/P of the layers' activation collectives, its own params'
gathers and reductions (FSDP's once per microbatch, data replicas' once per step, as the
executor does them), plus one microbatch's activations and their gradients sent across
``stage`` every tick.
"""

from __future__ import annotations

import itertools
import math
import resource
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import jax

from jaxshard import runtime
from jaxshard.analysis import accounting, timing
from jaxshard.analysis.devices import GB, Device
from jaxshard.errors import ConfigError
from jaxshard.mesh import abstract_mesh
from jaxshard.model import Stageable
from jaxshard.parallel.pipeline import StageLayout, make_schedule
from jaxshard.parallel.staged import staged
from jaxshard.remat import Remat
from jaxshard.rules import ShardingRules, Strategy

if TYPE_CHECKING:
    from jaxshard.training.step import Program

# Plans whose step times differ by less than this are ties (the simpler wins): the time
# model's own spread. Over jaxshard's six steps measured on one H100 (docs/bench/gpu.json),
# predicted over measured runs from 0.945 to 1.008, so two plans 6.6% apart can be in the
# wrong order (tests/test_timing.py holds TIE to that spread).
TIE = 0.07


@dataclass
class Plan:
    mesh: dict[str, int]  # nesting order, outermost first
    strategy: Strategy
    remat: Remat
    name: str
    memory: accounting.Memory
    fits: bool
    compute_s: float
    comm_s: float
    inter_host_bytes: float  # sent per device per step across hosts
    host_axes: tuple[str, ...]  # axes whose groups span hosts
    microbatches: int | None = None  # a pipeline's (1F1B), with a stage axis
    grad_accum: int = 1
    time: timing.StepTime | None = None  # the time model's parts
    compute_dtype: str = "bfloat16"
    flash: bool = False  # attention by a flash kernel (memory counted without probabilities)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def mesh_flag(self) -> str:
        return ",".join(f"{a}={s}" for a, s in self.mesh.items() if s > 1) or "data=1"

    @property
    def flags(self) -> str:
        """The train.py flags beyond --mesh that the plan needs."""
        parts = [f"--zero {self.strategy.zero}"] if self.strategy.zero else []
        parts += ["--sequence-parallel"] if self.strategy.sequence_parallel else []
        parts += [f"--context-parallel {self.strategy.context_parallel}"] if self.strategy.context_parallel != "ring" \
            else []
        parts += [f"--microbatches {self.microbatches}"] if self.microbatches else []
        parts += [f"--grad-accum {self.grad_accum}"] if self.grad_accum > 1 else []
        return " ".join(parts)

    @property
    def complexity(self) -> int:
        """Fewer kinds of sharding first: DDP < ZeRO < FSDP < HSDP < + EP < + TP < + SP, + remat."""
        data, fsdp, tensor = (self.mesh.get(a, 1) for a in ("data", "fsdp", "tensor"))
        rank = self.strategy.zero + (4 if fsdp > 1 else 0) + (1 if data > 1 and fsdp > 1 else 0)
        rank += (6 if tensor > 1 else 0) + (1 if self.strategy.sequence_parallel else 0)
        rank += 3 if self.mesh.get("expert", 1) > 1 else 0
        rank += 8 if self.microbatches else 0
        return 2 * rank + (self.remat != Remat.NONE) + (self.grad_accum > 1)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def host_spanning_axes(mesh: dict[str, int], per_host: int) -> tuple[str, ...]:
    """Axes whose groups include devices of different hosts (devices fill hosts in order)."""
    spanning, stride = [], 1
    for axis, size in reversed(list(mesh.items())):
        if size > 1 and stride * size > per_host:
            spanning.append(axis)
        stride *= size
    return tuple(reversed(spanning))


def pipeline_microbatches(stages: int, batch_size: int, shards: int) -> int | None:
    """1F1B's microbatches for a plan: the most, up to 4P, that split the batch evenly over the
    batch shards; at least P (None: the batch is too small to pipeline)."""
    return next((m for m in range(4 * stages, stages - 1, -1)
                 if batch_size % m == 0 and (batch_size // m) % shards == 0), None)


def candidates(model: Stageable, devices: int, per_host: int,
               batch_size: int) -> list[tuple[dict, Strategy, Remat, int | None, int]]:
    """(mesh, strategy, remat, microbatches, grad_accum) of every plan to weigh: without stages
    (with gradient accumulation over 2, 4 or 8 microbatches where the batch splits, instead of
    recomputing), and with each stage count that divides the layers evenly, outermost."""
    out = []
    for mesh, strategy, remat in _splits(model, devices, per_host, batch_size):
        shards = mesh["data"] * mesh["fsdp"] * mesh.get("expert", 1)
        for accum in (1, 2, 4, 8) if remat == Remat.NONE else (1,):
            if batch_size % accum == 0 and (batch_size // accum) % shards == 0:
                out.append((mesh, strategy, remat, None, accum))
    for stages in _divisors(devices):
        if stages == 1 or model.cfg.n_layers % stages or model.moe_layers:
            continue  # (MoE pipelines: the pipeline cost model does not count the all-to-alls yet)
        for mesh, strategy, remat in _splits(model, devices // stages, per_host, batch_size):
            if strategy.zero > 1 or remat != Remat.NONE:
                continue  # the pipeline keeps few microbatches; ZeRO-2/3 within stages: FSDP's
            shards = mesh["data"] * mesh["fsdp"]
            m = pipeline_microbatches(stages, batch_size, shards)
            if m is not None:
                out.append(({"stage": stages, **mesh}, strategy, remat, m, 1))
    return out


def _splits(model: Stageable, devices: int, per_host: int, batch_size: int) -> list[tuple[dict, Strategy, Remat]]:
    """Meshes over data, fsdp, expert (an MoE model's; it splits the batch too) and tensor."""
    out = []
    cfg = model.cfg
    moe = bool(model.moe_layers)
    for tensor in _divisors(min(devices, per_host)):
        if cfg.n_heads % tensor or cfg.d_mlp % tensor or cfg.padded_vocab % tensor:
            continue
        if moe and (cfg.moe_d_mlp or cfg.d_mlp) % tensor:
            continue
        if tensor > 1 and cfg.n_kv_heads % tensor and tensor % cfg.n_kv_heads:
            continue
        for expert in _divisors(devices // tensor) if moe else (1,):
            if moe and cfg.moe_experts % expert:
                continue
            rest = devices // tensor // expert
            for data in _divisors(rest):
                fsdp = rest // data
                if batch_size % (data * fsdp * expert):
                    continue
                orders = [("data", "fsdp")] if data == 1 or fsdp == 1 else [("data", "fsdp"), ("fsdp", "data")]
                zeros = (0, 1, 2, 3) if data > 1 and fsdp == 1 else (0, 1) if data > 1 else (0,)
                # (MoE layers do not run under sequence parallelism yet.)
                sps = (False, True) if tensor > 1 and not moe else (False,)
                for order, zero, sp, remat in itertools.product(orders, zeros, sps, (Remat.NONE, Remat.FULL)):
                    sizes = {"data": data, "fsdp": fsdp, "expert": expert, "tensor": tensor}
                    mesh = {a: sizes[a] for a in (*order, *(("expert",) if moe else ()), "tensor")}
                    out.append((mesh, Strategy(zero=zero, sequence_parallel=sp), remat))
    return out


def evaluate(model: Stageable, mesh: dict[str, int], strategy: Strategy, remat: Remat, device: Device,
             batch_size: int, seq_len: int, compute_dtype: str = "bfloat16",
             usable: float = runtime.GPU_MEMORY_FRACTION,
             microbatches: int | None = None, grad_accum: int = 1, virtual_stages: int = 1,
             software: timing.Software = timing.SOFTWARE["jaxshard"]) -> Plan:
    """One plan: its memory per device (the accounting's; a pipeline's as 1F1B keeps it) and
    its step time by the time model (:mod:`jaxshard.analysis.timing`): compute (with the
    pipeline bubble) and the communication it does not hide."""
    rules = ShardingRules(abstract_mesh(mesh), strategy)
    kw = dict(compute_dtype=compute_dtype, remat=remat)
    flash = software.attention != "materialized"  # keeps no probabilities
    mem = plan_memory(model, rules, batch_size, seq_len, compute_dtype, remat, flash, microbatches, grad_accum,
                      virtual_stages)
    if microbatches is None:
        transfers = [(t, 1.0) for t in accounting.communication(
            model, rules, batch_size, seq_len, grad_accum=grad_accum, **kw).transfers]
    else:
        stages, m = mesh["stage"], microbatches
        accumulate = m if rules.gathers_params or strategy.zero > 1 else 1
        transfers = [(t, timing.stage_share(t, stages)) for t in accounting.communication(
            model, rules, batch_size, seq_len, grad_accum=accumulate, **kw).transfers]
        schedule = make_schedule("1f1b", stages, m)
        transfers += [(t, 1.0) for t in accounting.pipeline_transfers(
            model, rules, schedule, batch_size, seq_len, compute_dtype)]
    spanning = host_spanning_axes(mesh, device.per_host)
    inter = sum(share * t.sent_bytes for t, share in transfers if set(t.axes) & set(spanning))
    time = timing.step_time(model, rules, device, batch_size, seq_len, software=software,
                            compute_dtype=compute_dtype, remat=remat, microbatches=microbatches or 1,
                            virtual_stages=virtual_stages, grad_accum=grad_accum)
    return Plan(mesh=mesh, strategy=strategy, remat=remat, name=rules.name, memory=mem,
                fits=mem.peak <= usable * device.memory, compute_s=time.compute + time.bubble,
                comm_s=sum(time.exposed.values()), inter_host_bytes=inter, host_axes=spanning,
                microbatches=microbatches, grad_accum=grad_accum, time=time, compute_dtype=compute_dtype,
                flash=flash)


def plan_memory(model: Stageable, rules: ShardingRules, batch_size: int, seq_len: int, compute_dtype: str,
                remat: Remat, flash: bool, microbatches: int | None = None, grad_accum: int = 1,
                virtual_stages: int = 1) -> accounting.Memory:
    """A plan's memory per device: the accounting's, or under a pipeline of ``microbatches``
    (1F1B, interleaved with ``virtual_stages``) :func:`accounting.pipeline_memory` of that
    schedule: the stored stack split over stage, and the residuals and stage inputs of the
    microbatches a stage holds at once."""
    kw = dict(compute_dtype=compute_dtype, remat=remat, flash=flash)
    if microbatches is None:
        return accounting.memory(model, rules, batch_size, seq_len, grad_accum=grad_accum, **kw)
    stages = rules.sizes["stage"]
    layout = StageLayout.make(model.cfg.n_layers, stages, virtual_stages)
    schedule = make_schedule("interleaved" if virtual_stages > 1 else "1f1b", stages, microbatches,
                             virtual_stages, layout)
    return accounting.pipeline_memory(model, rules, schedule, batch_size, seq_len, **kw)


def _check_lengths(model: Stageable, batch_size: int, seq_len: int) -> None:
    if batch_size < 1 or seq_len < 1:
        raise ConfigError(f"--batch and --seq-len must be >= 1, got {batch_size} and {seq_len}")
    if seq_len > model.cfg.max_seq_len:
        raise ConfigError(f"--seq-len {seq_len} exceeds model {model.cfg.name}'s max_seq_len "
                          f"{model.cfg.max_seq_len}")


def _on_hosts(device: Device, devices: int, hosts: int) -> Device:
    """``device`` with ``devices / hosts`` a host. More than a host of a known device holds is
    an error: every collective would be priced at the links within a host."""
    per_host = devices // hosts
    if device.name != "custom" and per_host > device.per_host:
        raise ConfigError(f"{devices} devices on {hosts} host(s) is {per_host} a host, where a {device.name} host "
                          f"holds {device.per_host}: give --hosts {-(-devices // device.per_host)} or more")
    return replace(device, per_host=per_host)


def given(model: Stageable, mesh: dict[str, int], strategy: Strategy, device: Device, batch_size: int,
          seq_len: int, *, hosts: int = 1, compute_dtype: str = "bfloat16", microbatches: int = 1,
          virtual_stages: int = 1, software: timing.Software = timing.SOFTWARE["jaxshard"]) -> Plan:
    """One configuration, exactly (:func:`evaluate`). ``microbatches``: a pipeline's with a
    stage axis, gradient accumulation's without one."""
    devices = math.prod(mesh.values())
    if devices % hosts:
        raise ConfigError(f"--mesh {_flag(mesh)} has {devices} devices: not a multiple of --hosts {hosts}")
    _check_lengths(model, batch_size, seq_len)
    stages = mesh.get("stage", 1)
    if virtual_stages < 1 or microbatches < 1:
        raise ConfigError("--microbatches and --virtual-stages must be >= 1")
    if virtual_stages > 1 and stages == 1:
        raise ConfigError("--virtual-stages needs a stage axis in --mesh")
    if stages > 1 and (model.cfg.n_layers % (stages * virtual_stages) or microbatches < stages):
        raise ConfigError(f"--mesh {_flag(mesh)}: {model.cfg.n_layers} layers must split into {stages} x "
                          f"{virtual_stages} stages, with --microbatches at least {stages}")
    shards = mesh.get("data", 1) * mesh.get("fsdp", 1) * mesh.get("expert", 1)
    if batch_size % (shards * microbatches):
        raise ConfigError(f"--batch {batch_size} does not split into {microbatches} microbatch(es) over "
                          f"{shards} batch shard(s)")
    device = _on_hosts(device, devices, hosts)
    pipelined = stages > 1
    return evaluate(model, mesh, strategy, model.remat, device, batch_size, seq_len, compute_dtype,
                    microbatches=microbatches if pipelined else None, grad_accum=1 if pipelined else microbatches,
                    virtual_stages=virtual_stages, software=software)


def _flag(mesh: dict[str, int]) -> str:
    return ",".join(f"{a}={n}" for a, n in mesh.items())


def prediction(model: Stageable, plan: Plan, device: Device, batch_size: int, seq_len: int) -> dict[str, Any]:
    """What ``plan.py --json`` writes: the step time and its parts, throughput, the model
    TFLOP/s per device under both published counts, and the memory per device by part."""
    devices, time = math.prod(plan.mesh.values()), plan.time
    tokens = batch_size * seq_len / devices / time.total  # per device per second
    m = plan.memory
    return {
        "model": model.cfg.name, "params": model.n_params(), "device": device.name, "devices": devices,
        "mesh": plan.mesh, "strategy": plan.name, "flags": plan.flags, "remat": str(plan.remat),
        "batch": batch_size, "seq_len": seq_len,
        "step_s": time.total, "tokens_per_s_per_device": tokens,
        "model_tflops_per_device": {k: v * tokens / 1e12
                                    for k, v in timing.model_flops_per_token(model.cfg, seq_len).items()},
        "memory": {"params": m.params, "grads": m.grads, "optimizer": m.opt_state, "activations": m.activations,
                   "temporaries": m.temp - m.grads - m.activations + m.batch, "peak": m.peak,
                   "device": device.memory, "fits": plan.fits},
        "time": time.as_dict(),
    }


def format_given(prediction: dict[str, Any], t: timing.StepTime) -> str:
    """A given plan's step time, throughput and memory by part (:func:`prediction`'s figures)."""
    mem = prediction["memory"]
    parts = ", ".join(f"{k} {v:.3f}" for k, v in t.exposed.items()) or "none"
    hidden = f" (hidden behind compute: {', '.join(f'{k} {v:.3f}' for k, v in t.hidden.items())})" if t.hidden else ""
    return "\n".join([
        f"step {t.total:.3f} s: matmul {t.matmul:.3f}, attention {t.attention:.3f}, memory-bound "
        f"{t.memory_bound:.3f}, optimizer {t.optimizer:.3f}, bubble {t.bubble:.3f}, exposed communication "
        f"{parts}{hidden}",
        f"{prediction['tokens_per_s_per_device']:,.0f} tokens/s per device; model TFLOP/s per device: "
        + ", ".join(f"{v:,.1f} ({k})" for k, v in prediction["model_tflops_per_device"].items()),
        f"memory per device: params {mem['params'] / GB:.2f} GB, grads {mem['grads'] / GB:.2f}, optimizer "
        f"{mem['optimizer'] / GB:.2f}, activations {mem['activations'] / GB:.2f}, temporaries "
        f"{mem['temporaries'] / GB:.2f}: peak {mem['peak'] / GB:.2f} of {mem['device'] / GB:g} GB "
        + ("(fits)" if mem["fits"] else "(does NOT fit)")])


def _with_remat(model: Stageable, remat: Remat) -> Any:
    if model.remat == remat:
        return model
    other = type(model)(model.cfg, remat=remat)
    other._abstract = model.abstract_params()  # same params, shapes known
    return other


def plan(model: Stageable, devices: int, device: Device, batch_size: int, seq_len: int, *,
         hosts: int = 1, compute_dtype: str = "bfloat16",
         software: timing.Software = timing.SOFTWARE["jaxshard"]) -> list[Plan]:
    """Every candidate, fitting ones first, fastest first (within ``TIE``: simplest first)."""
    if devices < 1 or hosts < 1 or devices % hosts:
        raise ConfigError(f"--devices {devices} must be a positive multiple of --hosts {hosts}")
    _check_lengths(model, batch_size, seq_len)
    per_host = devices // hosts
    device = _on_hosts(device, devices, hosts)
    variants = {r: _with_remat(model, r) for r in (Remat.NONE, Remat.FULL)}
    found = [evaluate(variants[remat], mesh, strategy, remat, device, batch_size, seq_len, compute_dtype,
                      microbatches=m, grad_accum=k, software=software)
             for mesh, strategy, remat, m, k in candidates(model, devices, per_host, batch_size)]
    if not found:
        raise ConfigError(f"no mesh splits --batch {batch_size} over {devices} devices; "
                          "use a batch divisible by the device count")
    fastest = min((p.step_s for p in found if p.fits), default=None)

    def key(p: Plan):
        if not p.fits:  # the nearest to fitting first
            return (True, 0, p.memory.peak, 0)
        return (False, math.floor(math.log(p.step_s / fastest, 1 + TIE)), p.complexity, p.step_s)

    return sorted(found, key=key)


def explain(model: Stageable, plans: list[Plan], device: Device, hosts: int, compute_dtype: str) -> list[str]:
    """The classic guidance, checked against the numbers of this model and cluster."""
    n = model.n_params()
    state = 16 * n  # float32 params, gradients and two Adam moments per parameter
    c = accounting.dtype_bytes(compute_dtype)
    params = model.abstract_params()
    layer = c * max(sum(math.prod(x.shape[1:]) for x in jax.tree.leaves(params[stack]))  # the largest kind
                    for stack in ("blocks", "moe_blocks") if stack in params)
    lines = [f"Model state: {n:,} params x 16 B (float32 params, grads, Adam m and v) = "
             f"{state / GB:,.1f} GB; the classic mixed-precision count 2+2+12 B gives the same 16 B."]
    if state <= runtime.GPU_MEMORY_FRACTION * device.memory:
        lines.append(f"It fits one {device.name} ({device.memory / GB:.0f} GB): data parallelism (DDP) "
                     "needs no sharding, and ZeRO/FSDP only pay more communication.")
    else:
        lines.append(f"It does not fit one {device.name} ({device.memory / GB:.0f} GB): shard the "
                     "optimizer state, gradients and params (ZeRO-1/2/3, FSDP) across data-parallel devices.")
    if 2 * layer > 0.5 * device.memory:
        lines.append(f"One layer's weights ({layer / GB:,.2f} GB in {compute_dtype}) are too big to "
                     "gather whole (FSDP holds the layer in use and the next): split layers with "
                     "tensor parallelism within a host.")
    if hosts > 1:
        lines.append(f"{hosts} hosts: links between hosts ({device.inter / GB:g} GB/s per device) are "
                     f"~{device.intra / device.inter:.0f}x slower than within one "
                     f"({device.intra / GB:g} GB/s, as NCCL's rings measure them): keep data parallelism on "
                     "the axis that crosses hosts (it sends each gradient once per step) and FSDP/TP inside a host.")
    top = next((p for p in plans if p.fits), None)
    if top is None:
        lines.append("No plan fits: more devices, more memory, a smaller batch per device or a "
                     "smaller model.")
    else:
        lines.append(f"Chosen: {top.name} on {top.mesh_flag}" + (f" {top.flags}" if top.flags else "")
                     + (f", remat {top.remat}" if top.remat != Remat.NONE else "")
                     + f": {top.memory.peak / GB:,.1f} GB per device, {top.step_s * 1e3:,.1f} ms per step "
                     f"(compute {top.compute_s * 1e3:,.1f} + communication {top.comm_s * 1e3:,.1f}); "
                     + (f"crossing hosts: {', '.join(top.host_axes)}." if top.host_axes else "all within one host."))
        if top.microbatches:
            stages, m = top.mesh["stage"], top.microbatches
            lines.append(f"Pipelined over {stages} stages (1F1B, {m} microbatches): between stages only a "
                         f"microbatch's activations and their gradients move, instead of gradients of the "
                         f"whole model, for an idle share of (P-1)/(M+P-1) = {(stages - 1) / (m + stages - 1):.0%}.")
    return lines


def format_plans(plans: list[Plan], device: Device) -> str:
    lines = [f"{'#':>3} {'strategy':<20} {'--mesh':<28} {'remat':<6} {'GB/device':>10} "
             f"{'step ms':>9} {'compute':>8} {'comm':>8} {'across hosts':>14}  fits  flags"]
    for i, p in enumerate(plans, 1):
        lines.append(f"{i:>3} {p.name:<20} {p.mesh_flag:<28} {str(p.remat):<6} "
                     f"{p.memory.peak / GB:>10,.1f} {p.step_s * 1e3:>9,.1f} {p.compute_s * 1e3:>8,.1f} "
                     f"{p.comm_s * 1e3:>8,.1f} {','.join(p.host_axes) or '-':>14}  {'yes' if p.fits else 'NO ':<3}"
                     f"  {p.flags}".rstrip())
    return "\n".join(lines)


def confirm(model: Stageable, p: Plan, batch_size: int, seq_len: int) -> str:
    """Compile ``p``'s training step for ``model`` on as many (fake CPU) devices and compare with
    the prediction: arguments, temporaries and, without a pipeline, every collective. Params
    are float32 (the default). A plan priced with a flash kernel compiles with the blockwise
    one (:func:`jaxshard.parallel.attention.blockwise`), which keeps what a flash kernel keeps.

    In the plan's compute dtype, and, when that is a 2-byte one, in float32 as well: XLA:CPU
    runs bfloat16 and float16 arithmetic and collectives in float32 (its float normalization),
    so the 2-byte compile shows what the program's structure keeps (a whole-stack cast would
    show there) with CPU-sized buffers, and only the float32 compile compares like with like."""
    dtypes = dict.fromkeys((p.compute_dtype, "float32"))
    return "\n".join(_confirm_in(model, replace(p, compute_dtype=d), batch_size, seq_len) for d in dtypes)


def _confirm_in(model: Stageable, p: Plan, batch_size: int, seq_len: int) -> str:
    from jaxshard.analysis import inspect
    from jaxshard.mesh import MeshSpec, build_mesh
    from jaxshard.parallel import attention
    from jaxshard.training.optim import OptimConfig
    from jaxshard.training.step import StepConfig, build_program

    spec = MeshSpec(tuple(p.mesh.items()))
    rules = ShardingRules(build_mesh(spec), p.strategy)
    model = type(model)(model.cfg, remat=p.remat)
    pipelined = dict(pipeline_schedule="1f1b", microbatches=p.microbatches) if p.microbatches else {}
    step = StepConfig(compute_dtype=p.compute_dtype, grad_accum=p.grad_accum, **pipelined)
    program = build_program(model, rules, OptimConfig(), step)
    start = time.perf_counter()
    with attention.kernel("blockwise" if p.flash else "auto"):
        compiled = program.lower_step(batch_size, seq_len).compile()
    # What the confirmation itself cost: its compile time and this process's peak memory.
    cost = (f"compiled in {time.perf_counter() - start:.1f} s, peak memory of this process "
            f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    predicted = plan_memory(model, rules, batch_size, seq_len, p.compute_dtype, p.remat, p.flash,
                            p.microbatches, p.grad_accum)
    xla = inspect.xla_memory(compiled)
    temp = (f"  temporaries per device predicted {predicted.temp:,} B, XLA {xla['temp']:,} B "
            f"(x{xla['temp'] / predicted.temp:.2f})")
    what = f"{rules.mesh.devices.size} fake CPU devices, {p.compute_dtype}"
    if p.microbatches:
        return "\n".join([_confirm_pipeline(model, p, program, compiled, batch_size, seq_len, what), temp,
                          f"  {cost}"])
    v = inspect.verify(model, program, compiled, batch_size, seq_len, step=step)
    head = (f"Confirmed by compiling {p.name} on --mesh {p.mesh_flag} ({what}): argument bytes per device "
            f"predicted {v.memory[2][1]:,}, XLA {v.memory[2][2]:,}")
    if p.compute_dtype != "float32":
        return "\n".join([head, temp, "  collectives: compared in float32 (XLA:CPU sends 2-byte ones as "
                                      "float32)", f"  {cost}"])
    rows = [f"  {k:<16} predicted {pr:>16,} B   compiled {m:>16,} B" for k, pr, m in v.by_kind]
    verdict = [f"  FLAG: {f}" for f in v.flags] or ["  " + v.agreement()]
    return "\n".join([head, temp, *rows, *verdict, f"  {cost}"])


def _confirm_pipeline(model: Stageable, p: Plan, program: Program, compiled: Any, batch_size: int, seq_len: int,
                      what: str) -> str:
    """What the accounting predicts of a pipelined step, against the compiled one: the state
    each device holds and the stages' sends (the rest of a pipelined step is not predicted
    collective by collective yet)."""
    from jaxshard.analysis import inspect

    rules = program.rules
    predicted = accounting.memory(staged(model, program.schedule.layout), rules, batch_size, seq_len,
                                  compute_dtype=p.compute_dtype, remat=p.remat)
    xla = inspect.xla_memory(compiled)
    sends = sum(c.bytes * c.executions for c in inspect.compiled_collectives(compiled, rules.mesh)
                if c.kind == "collective-permute" and "stage" in c.axes)
    expected = sum(t.total for t in accounting.pipeline_transfers(model, rules, program.schedule, batch_size,
                                                                  seq_len, p.compute_dtype))
    head = (f"Confirmed by compiling {p.name} on --mesh {p.mesh_flag} {p.flags} ({what}): argument bytes "
            f"per device predicted {predicted.argument:,}, XLA {xla['argument']:,}")
    if p.compute_dtype != "float32":
        return head + " (sends compared in float32: XLA:CPU sends 2-byte ones as float32)"
    return (f"{head}; stage-to-stage sends predicted {expected:,} B, compiled {sends:,} B (the other "
            "collectives of a pipelined step are not predicted one by one yet)")
