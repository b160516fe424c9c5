"""What each device holds and sends: live array shards, the compiled step's memory analysis,
and the collectives XLA inserted into it."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxshard.analysis import accounting, hlo
from jaxshard.mesh import build_mesh
from jaxshard.model import Stageable
from jaxshard.parallel.staged import staged
from jaxshard.rules import HOST_MEMORY, ShardingRules, Strategy
from jaxshard.training.optim import OptimConfig
from jaxshard.training.step import Program, StepConfig, build_program


def bytes_per_device(tree: Any, where: str | None = None) -> dict[int, int]:
    """Bytes of ``tree``'s arrays that each device holds, measured from the live shards;
    ``where``: "host" counts only those in host memory (``--offload``), "device" the rest."""
    held: dict[int, int] = defaultdict(int)
    for x in jax.tree.leaves(tree):
        if where is not None and (x.sharding.memory_kind == HOST_MEMORY) != (where == "host"):
            continue
        for shard in x.addressable_shards:
            held[shard.device.id] += shard.data.nbytes
    return dict(held)


def max_bytes_per_device(tree: Any, where: str | None = None) -> int:
    """The most any one device holds of ``tree`` (what decides whether it fits)."""
    return max(bytes_per_device(tree, where).values(), default=0)


def stored_bytes(program: Program, state: Any) -> tuple[int, int]:
    """(device, host) bytes of params, gradients and optimizer state that the most loaded
    device holds, measured from live arrays: ``state`` as it lies, and a params-shaped tree
    materialised in the layout the step reduces the gradients to (inside the step they are
    transient; their values do not change their bytes, so they are zeros: no backward pass is
    traced to count them)."""
    layout = program.layout
    g = materialize(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), layout.abstract.params),
                    layout.grad_shardings)
    held = [bytes_per_device(t, "device") for t in (state.params, state.opt_state, g)]
    device = max(sum(h.get(d, 0) for h in held) for d in set().union(*held))
    host = max(bytes_per_device(state, "host").values(), default=0)
    return device, host


def materialize(abstract: Any, shardings: Any) -> Any:
    """Zeros shaped like ``abstract`` (a tree of ShapeDtypeStruct), each array created in its
    sharding (host memory included): the live layout of a state without initialising it."""
    return jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract),
                   out_shardings=shardings)()


# The classic table's rows: name, mesh over N devices, ZeRO stage (FSDP is stage 3 over fsdp).
CLASSIC_STRATEGIES = {"DDP": ("data={n}", 0), "ZeRO-1": ("data={n}", 1), "ZeRO-2": ("data={n}", 2),
                      "ZeRO-3": ("data={n}", 3), "FSDP": ("fsdp={n}", 3)}


@dataclass(frozen=True)
class BytesPerParam:
    """One row of the bytes-per-parameter table: the textbook's and the live arrays'."""

    strategy: str
    mesh: str
    param_dtype: str
    offload: tuple[str, ...]
    predicted: accounting.ClassicBytes
    device: float  # measured, per device
    host: float


def bytes_per_param(model: Stageable, strategy: str, n: int, param_dtype: str = "float32") -> list[BytesPerParam]:
    """``strategy`` (a :data:`CLASSIC_STRATEGIES` name) on the first ``n`` devices, without and
    with each offload it supports, measured with :func:`stored_bytes`."""
    mesh_t, stage = CLASSIC_STRATEGIES[strategy]
    mesh = build_mesh(mesh_t.format(n=n), jax.devices()[:n])
    zero = stage if mesh_t.startswith("data") else 0
    offloads = [(), ("optimizer",)] + ([("params",), ("optimizer", "params")] if stage == 3 else [])
    rows = []
    for offload in offloads:
        rules = ShardingRules(mesh, Strategy(zero=zero, offload=offload))
        program = build_program(model, rules, OptimConfig(),
                                StepConfig(param_dtype=param_dtype, compute_dtype=param_dtype))
        state = materialize(program.layout.abstract, program.layout.shardings)  # the layout init writes
        device, host = stored_bytes(program, state)
        rows.append(BytesPerParam(
            strategy, mesh_t.format(n=n), param_dtype, offload,
            accounting.classic_bytes_per_param(stage, n, accounting.dtype_bytes(param_dtype), offload),
            device / model.n_params(), host / model.n_params()))
    return rows


def xla_memory(compiled: jax.stages.Compiled) -> dict[str, int]:
    """Per-device bytes XLA planned for the compiled step."""
    m = compiled.memory_analysis()
    if m is None:  # some backends do not report
        return {}
    return {"argument": int(m.argument_size_in_bytes), "output": int(m.output_size_in_bytes),
            "temp": int(m.temp_size_in_bytes), "alias": int(m.alias_size_in_bytes),
            "generated_code": int(m.generated_code_size_in_bytes),
            "host_argument": int(getattr(m, "host_argument_size_in_bytes", 0)),
            "host_temp": int(getattr(m, "host_temp_size_in_bytes", 0))}


def saved_residual_bytes(program: Program, batch_size: int, seq_len: int) -> int:
    """Bytes per device that the forward pass saves for the backward pass (activations under
    the remat policy, and what else autodiff keeps), from the shardings XLA gives them."""

    def residuals(params, batch):
        return jax.vjp(lambda p: program.loss(p, batch, None)[0], params)[1]

    abstract = program.layout.abstract.params
    compiled = jax.jit(residuals, in_shardings=(program.layout.shardings.params, program.batch_sharding)) \
        .lower(abstract, program.abstract_batch(batch_size, seq_len)).compile()
    return sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
               for x, s in zip(jax.tree.leaves(compiled.out_info), jax.tree.leaves(compiled.output_shardings)))


def layer_activation_bytes(build: Callable[[int], Program], batch_size: int, seq_len: int) -> float:
    """Bytes per device one layer keeps for the backward pass for ``batch_size`` sequences,
    from the compiled residuals (:func:`saved_residual_bytes`) of ``build(n_layers)``'s
    program at 1 and 2 layers and at ``batch_size`` and twice that: the differences cancel
    what does not grow with layers (the ends, the logits) or with the batch (the weights'
    compute-dtype copies autodiff keeps too)."""
    saved = {(n, b): saved_residual_bytes(build(n), b, seq_len) for n in (1, 2) for b in (batch_size, 2 * batch_size)}
    return (saved[2, 2 * batch_size] - saved[1, 2 * batch_size]) - (saved[2, batch_size] - saved[1, batch_size])


def compiled_collectives(compiled: jax.stages.Compiled, mesh: jax.sharding.Mesh) -> list[hlo.Collective]:
    """The collectives of a compiled step, with the mesh axes each one spans."""
    return hlo.attribute(hlo.parse(compiled.as_text()), tuple(mesh.axis_names),
                         tuple(mesh.devices.shape))


_HLO_DTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def gathered_weights_kept(compiled: jax.stages.Compiled, model: Stageable, rules: Any,
                          compute_dtype: str = "float32") -> int:
    """Bytes per device of ZeRO-3/FSDP-gathered layer weights that the compiled step keeps
    for the backward pass, read from the compiled (scanned) step's loop states.

    A layer weight gathered in the forward loop and kept reaches the backward loop stacked
    over the layers, as ``[layers, *gathered shard]``; with reshard-after-forward the loops
    carry the at-rest shards only and the backward loop gathers again. Counted per distinct
    shape, at most as many buffers as there are weights of that shape."""
    want: dict[tuple[str, tuple[int, ...]], int] = defaultdict(int)
    for p in accounting.param_infos(model, rules):
        if p.in_layers and p.params != p.compute:
            want[(_HLO_DTYPE[compute_dtype], rules.named(p.compute).shard_shape(p.shape))] += 1
    kept = 0
    for state in hlo.loop_states(compiled.as_text()):
        found = sum(min(state.count(k), n) * math.prod(k[1]) * hlo.DTYPE_BYTES[k[0]]
                    for k, n in want.items())
        kept = max(kept, found)
    return kept


# ---- the verifier: accounting against the compiled step ------------------------------------

TOLERANCE = 0.05  # relative, per collective kind


WASTE_TOLERANCE = 0.10  # compiled matmul FLOPs beyond what the accounting explains, flagged past this
ON_GPU = "a GPU's matmuls are library calls"  # why the waste figure is not counted there


@dataclass
class Verification:
    """Predicted against measured, per device, for one compiled step."""

    memory: list[tuple[str, int, int | None]]  # (what, predicted, measured)
    collectives: list[tuple[str, tuple[str, ...], int, int]]  # (kind, axes, predicted, compiled)
    by_kind: list[tuple[str, int, int]]  # (kind, predicted, compiled)
    params: list[accounting.ParamInfo]
    sizes: dict[str, int]
    allowances: list[str]
    flags: list[str] = field(default_factory=list)
    # The compiled step's matmul FLOPs against the useful ones (accounting.matmul_waste; a
    # pipeline's has each stage's too); None where they are not counted (``uncounted``).
    waste: dict[str, Any] | None = None
    uncounted: str = ON_GPU
    # A pipelined step's collectives inside the schedule's slots: (kind, axes, bytes if every
    # tick ran them -- an upper bound; they run as often as a stage has work), not compared.
    in_slots: list[tuple[str, tuple[str, ...], int]] = field(default_factory=list)
    pipelined: bool = False
    slack: int = 0  # bytes a kind may differ by beyond the 5% (scalars: max(4 KiB, 1% of all))
    buckets: tuple[list[int], list[int]] | None = None  # --strategy explicit: (planned, compiled) bytes

    def agreement(self) -> str:
        """What an unflagged comparison means: within 5%, and any kind apart by more only within
        the slack for scalars, said with its bytes."""
        loose = [k for k, p, m in self.by_kind if abs(m - p) > TOLERANCE * p]
        said = "every collective kind within 5% of the prediction"
        return said + (f" but {', '.join(loose)}, within the {self.slack:,} B allowed for scalars" if loose else "")


def verify(model: Stageable, program: Program, compiled: jax.stages.Compiled, batch_size: int, seq_len: int,
           *, step: StepConfig = StepConfig(), expected: Any = None) -> Verification:
    """Compare the accounting of ``expected`` rules (default: the program's) with ``compiled``,
    the step of ``program`` that ``build_program(model, rules, optim, step)`` made.

    Flags a collective kind/axes the strategy does not explain, a kind whose bytes differ from
    the prediction by more than 5% (plus a small slack for scalars), and argument bytes that
    differ from the prediction at all.
    """
    rules = expected or program.rules
    schedule = program.schedule
    mem, comm = accounting.predict(model, rules, batch_size, seq_len, schedule,
                                   **accounting.step_options(step, model, program))
    fl = accounting.flops(model.cfg, rules, batch_size, seq_len, remat=model.remat, model=model)
    found = compiled_collectives(compiled, program.rules.mesh)
    in_slots: dict[tuple[str, tuple[str, ...]], int] = defaultdict(int)
    if schedule is not None:  # what runs in the slots is not predicted (see pipeline_communication)
        for c in found:
            if c.conditional:
                in_slots[(c.kind, c.axes)] += c.bytes * c.executions
        found = [c for c in found if not c.conditional]
    xla = xla_memory(compiled)
    flags: list[str] = []
    counted = jax.default_backend() == "cpu"
    waste = accounting.matmul_waste(fl, compiled.as_text(), model.cfg, program.rules, batch_size, seq_len,
                                    grad_accum=step.grad_accum, schedule=schedule) if counted else None
    why_not = (accounting.uncounted(compiled.as_text(), schedule) if counted else None) or ON_GPU
    if waste and waste["unexplained"] > 1 + WASTE_TOLERANCE:
        flags.append(f"matmul FLOPs: the compiled step runs {waste['compiled']:,.0f} per device, "
                     f"{waste['unexplained']:.2f}x what the useful work, recompute and kernels explain")

    measured: dict[tuple[str, tuple[str, ...]], int] = defaultdict(int)
    for c in found:
        measured[(c.kind, c.axes)] += c.bytes * c.executions
    predicted = comm.by_kind_and_axes()
    total = sum(predicted.values()) + sum(measured.values())
    slack = max(4096, 0.01 * total)
    for (kind, axes), b in sorted(measured.items()):
        near = [a for k, a in predicted if k == kind and (set(a) <= set(axes) or set(axes) <= set(a))]
        if not near and b > slack:
            flags.append(f"unexplained {kind} over {','.join(axes) or '?'}: {b:,} B per step "
                         "(the strategy predicts none)")
    kinds = sorted({k for k, _ in predicted} | {k for k, _ in measured})
    by_kind = [(k, sum(v for (kk, _), v in predicted.items() if kk == k),
                sum(v for (kk, _), v in measured.items() if kk == k)) for k in kinds]
    for k, p, m in by_kind:
        if abs(m - p) > TOLERANCE * p + slack:
            flags.append(f"{k}: compiled {m:,} B vs predicted {p:,} B per step")
    buckets = bucket_check(program, found)
    if buckets and buckets[0] != buckets[1]:
        flags.append(f"buckets: the compiled step reduces the gradients in {len(buckets[1])} collectives "
                     f"of {buckets[1]} B, the plan in {len(buckets[0])} of {buckets[0]} B")
    # Backends with a separate host memory space report offloaded arguments apart. Exact: the
    # arguments are the state and the batch, whose shapes and shardings leave nothing to estimate.
    argument = xla["argument"] + xla["host_argument"] if xla else None
    if xla and argument != mem.argument:
        flags.append(f"argument bytes: XLA {argument:,} vs predicted {mem.argument:,}")
    host = hlo.host_argument_bytes(compiled.as_text())
    if host != mem.host:
        flags.append(f"host memory: the compiled step places {host:,} B of arguments there, "
                     f"predicted {mem.host:,} B")
    return Verification(
        memory=[("params", mem.params, max_bytes_abstract(program.layout.abstract.params)),
                ("optimizer state", mem.opt_state, max_bytes_abstract(program.layout.abstract.opt_state)),
                ("argument (XLA)", mem.argument, argument),
                ("  of it in host memory (compiled layout)", mem.host, host),
                ("output (XLA)", mem.params + mem.opt_state + 4, xla.get("output")),
                ("gradients (transient)", mem.grads, None),
                ("activations saved for backward (estimate)", mem.activations, None),
                ("weights kept for backward, extra copies", mem.weights_extra, None),
                ("temp (XLA)", None, xla.get("temp"))],
        collectives=[(k, a, predicted.get((k, a), 0), measured.get((k, a), 0))
                     for k, a in sorted(set(predicted) | set(measured))],
        by_kind=by_kind,
        params=accounting.param_infos(model if schedule is None else staged(model, schedule.layout), rules),
        sizes=rules.sizes,
        allowances=comm.allowances, flags=flags, waste=waste, uncounted=why_not,
        pipelined=schedule is not None, in_slots=[(k, a, b) for (k, a), b in sorted(in_slots.items())],
        buckets=buckets, slack=int(slack))


def format_waste(waste: dict[str, Any] | None, why_not: str = "") -> list[str]:
    """The matmul FLOPs per device: compiled, useful, and what explains the difference (a
    pipeline's: the stages' mean, each stage's after)."""
    if waste is None:
        return [f"Matmul FLOPs per device: not counted ({why_not})"]
    compiled = "compiled (stages' mean; tick ops as run)" if "stages" in waste else \
        "compiled (every dot; loops by trip count)"
    rows = [(compiled, waste["compiled"]),
            *([(f"  of which grouped-matmul tiles ({'as run' if waste['rows_measured'] else 'k rows a token'})",
                waste["data_dependent"])] if waste.get("data_dependent") else []),
            ("useful (6N + causal attention)", waste["useful"]),
            ("+ remat recompute", waste["recompute"]),
            ("+ masked attention computed, empty expert slots", waste["masked_or_padding"]),
            ("= expected", waste["expected"])]
    return (["Matmul FLOPs per device per step"] + [f"  {what:<50} {x:>18,.0f}" for what, x in rows]
            + [f"  waste: compiled / useful x{waste['ratio']:.3f}; compiled / expected x{waste['unexplained']:.3f}"]
            + ([f"  by stage, compiled / expected: "
                + " ".join(f"x{x / waste['expected']:.3f}" for x in waste["stages"])] if "stages" in waste else []))


def bucket_check(program: Program, found: list[hlo.Collective]) -> tuple[list[int], list[int]] | None:
    """``--strategy explicit``: (the planned buckets' bytes, the compiled step's gradient
    collectives' bytes), in order of size; the gradient collectives are the step's non-scalar
    all-reduces and reduce-scatters (the loss sums and the norm are scalars)."""
    if not program.buckets:
        return None
    compiled = sorted(c.bytes for c in found if c.kind in ("all-reduce", "reduce-scatter")
                      and any(math.prod(s) > 1 for s in c.shapes))
    return sorted(b.bytes for b in program.buckets), compiled


def max_bytes_abstract(tree: Any) -> int:
    """Bytes one device holds of abstract arrays with shardings (no allocation)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def format_verification(v: Verification) -> str:
    def mb(x):
        return "-" if x is None else f"{x / 2**20:,.3f} MiB"

    lines = ["Memory per device                          predicted        measured"]
    for what, p, m in v.memory:
        lines.append(f"  {what:<40} {mb(p):>14} {mb(m):>15}")
    lines.append("")
    lines.append("Collectives per device per step     predicted bytes  compiled bytes")
    for kind, axes, p, m in v.collectives:
        lines.append(f"  {kind:<16} {','.join(axes):<16} {p:>14,} {m:>15,}")
    if v.in_slots:
        lines.append("  in the pipeline's slots (not predicted; bytes if every tick ran them, an upper bound):")
        for kind, axes, b in v.in_slots:
            lines.append(f"  {kind:<16} {','.join(axes):<16} {'-':>14} {b:>15,}")
    if v.buckets:
        lines.append(f"  gradient buckets: {len(v.buckets[0])} planned, {len(v.buckets[1])} compiled "
                     f"({'the same sizes' if v.buckets[0] == v.buckets[1] else 'sizes differ'})")
    lines.append("  by kind:")
    for kind, p, m in v.by_kind:
        ratio = f"{m / p:.3f}" if p else "-"
        lines.append(f"  {kind:<33} {p:>14,} {m:>15,}   x{ratio}")
    lines.append("")
    lines += format_waste(v.waste, v.uncounted)
    lines.append("")
    lines.append("Parameters: logical dims -> mesh axes at rest -> bytes per device (params / grads / Adam)")
    for p in v.params:
        dims = " ".join(f"{d}:{_entry(e)}" for d, e in zip(p.axes, list(p.params) + [None] * len(p.axes)))
        sizes = [accounting.F32 * accounting.shard_elems(p.shape, s, v.sizes) for s in (p.params, p.grads, p.opt_state)]
        lines.append(f"  {p.path:<28} {dims:<60} {sizes[0]:>10,} {sizes[1]:>10,} {2 * sizes[2]:>10,}")
    if v.allowances:
        lines.append("")
        lines.append("Known differences from the textbook (allowed for):")
        lines += [f"  - {a}" for a in v.allowances]
    lines.append("")
    lines += [f"FLAG: {f}" for f in v.flags] or ["No unexplained collectives; " + v.agreement() + "."]
    return "\n".join(lines)


def _entry(e) -> str:
    return "-" if e is None else e if isinstance(e, str) else "+".join(e)


def jaxpr_saved_bytes(fn: Any, *args: Any) -> int:
    """Bytes of the residuals autodiff saves for ``fn(*args)``'s backward pass, at the traced
    (global) shapes, from ``jax.ad_checkpoint.print_saved_residuals``."""
    import contextlib
    import io
    import re

    from jax.ad_checkpoint import print_saved_residuals

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(fn, *args)
    total = 0
    for dtype, dims in re.findall(r"^(\w+)\[([\d,]*)\]", out.getvalue(), flags=re.M):
        itemsize = 1 if dtype == "bool" else int(re.sub(r"\D", "", dtype) or 32) // 8
        total += itemsize * math.prod(int(d) for d in dims.split(",") if d)
    return total
