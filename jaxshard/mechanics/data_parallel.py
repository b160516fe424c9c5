"""PyTorch's single-process ``nn.DataParallel``, built explicitly, to set beside DDP.

The params and the AdamW state live on device 0 only (a ``SingleDeviceSharding``). Each step:

1. broadcast: the params (and the step counter, which seeds dropout) go from device 0 to
   every device -- ``jax.device_put`` into a replicated sharding of a 1-D ``data`` mesh;
2. scatter: the batch, on device 0 where a loader leaves it, goes out in rows, B/N to each;
3. each device computes the loss sums and gradients of its rows, in parallel: one compiled
   ``jax.shard_map`` program, the params entering replicated and made device-varying before
   the gradient, so nothing reduces them -- the program has no collectives;
4. gather: every device's loss sums and gradients go to device 0 (``jax.device_put``);
5. device 0 sums them, divides by the tokens, clips and applies AdamW (:mod:`jaxshard.training.optim`,
   the arithmetic of :func:`jaxshard.training.step.build_program`), in a program of its own.

The transfers are driven from the host, outside any compiled program, as PyTorch's are. Each
step counts them from the shardings of the arrays it moves (:func:`transfer`: the bytes that
land on a device that did not hold them, and who sent them) -- a model of what ``device_put``
moves, not a measurement: no compiled program holds these transfers -- and
:meth:`DataParallel.compiled_collectives` reads the collectives of its two programs from their
HLO (none; a test holds it to that).

Bytes per step. P: the params' bytes, N: devices, X: the batch's bytes (inputs and targets),
S: one device's loss sums (float32 scalars: 3 for a dense model); "per device" counts a
device's part in each transfer once, at its buffer size, as the report's ``collectives`` do::

    DataParallel, device k > 0:  (P + 4) broadcast in + X/N scatter in
                                 + P gradients out + S loss sums out       = 2P + X/N + S + 4
    DataParallel, device 0:      (N - 1) times the same, all through its own links
    DDP (--mesh data=N):         P, one all-reduce of the gradients (+ a few scalars)

So DataParallel moves one broadcast of the params per device more than DDP; and device 0
sends and receives (N - 1)(P + ...) where a ring all-reduce sends and receives 2(N-1)/N P on
every device. :func:`predict` evaluates these from the parameter count alone. (DDP's compiled
all-reduce can come out under P: XLA leaves out gradient entries that are zero whatever the
batch, such as a learned position table's rows beyond the sequence length. DataParallel
gathers whole gradients, as PyTorch's does.)
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jaxshard.analysis import hlo
from jaxshard.axes import MeshAxis
from jaxshard.data.synthetic import random_batches
from jaxshard.errors import ConfigError
from jaxshard.mesh import build_mesh
from jaxshard.model import LanguageModel
from jaxshard.training import optim
from jaxshard.training.state import TrainState, fresh_state

AXIS = str(MeshAxis.DATA)
LOSS_VALUES = 3  # a dense model's Loss: total, tokens, nll (float32 scalars)


# ---- counting transfers ---------------------------------------------------------------------

@dataclass(frozen=True)
class Transfer:
    """One host-driven move of a pytree: bytes each device received and sent."""

    phase: str
    received: dict[int, int]  # device id -> bytes
    sent: dict[int, int]
    seconds: float | None = None  # with ``timed`` steps: until the moved arrays were ready


def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape))


def _overlap(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> int:
    return math.prod(max(0, min(a1, b1) - max(a0, b0)) for (a0, a1), (b0, b1) in zip(a, b))


def moved_bytes(x: jax.Array, dst: jax.sharding.Sharding) -> tuple[dict[int, int], dict[int, int]]:
    """(received, sent) bytes per device id when ``x`` is put into ``dst``: every piece of a
    destination shard that its device does not already hold comes from the lowest-numbered
    device that does. Shardings tile an array (shards are equal or disjoint), so each piece
    has one source tile."""
    received: dict[int, int] = defaultdict(int)
    sent: dict[int, int] = defaultdict(int)
    holders: dict[tuple, list[int]] = defaultdict(list)  # source tile -> its devices
    for d, index in x.sharding.devices_indices_map(x.shape).items():
        holders[_box(index, x.shape)].append(d.id)
    for d, index in dst.devices_indices_map(x.shape).items():
        want = _box(index, x.shape)
        for tile, devices in holders.items():
            n = _overlap(want, tile) * x.dtype.itemsize
            if n and d.id not in devices:
                received[d.id] += n
                sent[min(devices)] += n
    return dict(received), dict(sent)


def transfer(phase: str, tree: Any, dst: Any, timed: bool = False) -> tuple[Any, Transfer]:
    """``jax.device_put(tree, dst)`` and what it moved between devices."""
    received: dict[int, int] = defaultdict(int)
    sent: dict[int, int] = defaultdict(int)
    leaves = jax.tree.leaves(tree)
    dsts = [dst] * len(leaves) if isinstance(dst, jax.sharding.Sharding) else jax.tree.leaves(dst)
    for x, s in zip(leaves, dsts, strict=True):
        r, t = moved_bytes(x, s)
        for d, n in r.items():
            received[d] += n
        for d, n in t.items():
            sent[d] += n
    start = time.perf_counter()
    out = jax.device_put(tree, dst)
    seconds = None
    if timed:
        jax.block_until_ready(out)
        seconds = time.perf_counter() - start
    return out, Transfer(phase, dict(received), dict(sent), seconds)


@dataclass(frozen=True)
class Traffic:
    """The transfers of one step."""

    transfers: tuple[Transfer, ...]
    compute_seconds: float | None = None  # with ``timed``: the parallel forward/backward
    update_seconds: float | None = None

    def phase(self, name: str) -> Transfer:
        return next(t for t in self.transfers if t.phase == name)

    def moved(self, device: int) -> int:
        """Bytes ``device`` received plus sent in the step."""
        return sum(t.received.get(device, 0) + t.sent.get(device, 0) for t in self.transfers)


# ---- the prediction -------------------------------------------------------------------------

@dataclass(frozen=True)
class Predicted:
    """Bytes per step from the parameter count and batch shape (see the module docstring)."""

    broadcast: int  # into each device k > 0: P + the step counter
    scatter: int  # into each device k > 0: its rows of inputs and targets
    gather_grads: int  # out of each device k > 0: P
    gather_loss: int  # out of each device k > 0: S
    n_devices: int
    param_bytes: int  # P
    ddp_all_reduce: int  # DDP's gradient all-reduce, per device (buffer): P
    ddp_ring_sent: float  # what a ring all-reduce of it sends per device: 2(N-1)/N P

    @property
    def data_parallel(self) -> int:
        """What a device k > 0 moves per step."""
        return self.broadcast + self.scatter + self.gather_grads + self.gather_loss

    @property
    def root(self) -> int:
        """What device 0 moves per step (sent and received)."""
        return (self.n_devices - 1) * self.data_parallel

    @property
    def excess(self) -> int:
        """DataParallel per device minus DDP's all-reduce: the broadcast, and the scatter and
        gather that DDP's compiled step does not count (its batch comes from the host)."""
        return self.data_parallel - self.ddp_all_reduce


def predict(n_params: int, n_devices: int, batch_size: int, seq_len: int, *, bytes_per_param: int = 4,
            token_bytes: int = 4, loss_values: int = LOSS_VALUES) -> Predicted:
    P_ = n_params * bytes_per_param
    N = n_devices
    return Predicted(broadcast=P_ + 4, scatter=2 * batch_size // N * seq_len * token_bytes,
                     gather_grads=P_, gather_loss=4 * loss_values, n_devices=N, param_bytes=P_,
                     ddp_all_reduce=P_ if N > 1 else 0, ddp_ring_sent=2 * (N - 1) / N * P_)


# ---- the program ----------------------------------------------------------------------------

@dataclass(frozen=True)
class DataParallel:
    """Jitted pieces of the DataParallel step; :meth:`step` runs them with the transfers."""

    mesh: jax.sharding.Mesh  # 1-D, ``data``, over the N devices
    root: SingleDeviceSharding  # device 0: where params and optimizer state live
    replicated: NamedSharding
    batch_sharding: NamedSharding  # rows over the devices; also the per-device results' stacking
    init: Callable[[int], TrainState]  # on device 0
    grads: Callable  # (params, step, inputs, targets) on the mesh -> (Loss, grads), stacked
    update: Callable  # (state, Loss, grads) on device 0 -> (state, metrics); donates state
    abstract: TrainState  # on device 0

    @property
    def n_devices(self) -> int:
        return self.mesh.size

    def check_batch(self, batch_size: int) -> None:
        if batch_size % self.n_devices:
            raise ConfigError(f"--batch-size {batch_size} is not divisible by the {self.n_devices} "
                              "devices DataParallel scatters it over")

    def step(self, state: TrainState, batch: dict,
             timed: bool = False) -> tuple[TrainState, dict, Traffic]:
        """One step. ``batch``: host arrays (placed on device 0 first, as a loader would -- a
        host-to-device copy, not counted, as DDP's is not) or arrays on device 0. ``timed``
        waits for each phase to finish and records its time."""
        self.check_batch(batch["inputs"].shape[0])
        batch = jax.device_put(batch, self.root)
        (params, step), sent = transfer("broadcast", (state.params, state.step), self.replicated, timed)
        batch, scattered = transfer("scatter", batch, self.batch_sharding, timed)
        start = time.perf_counter()
        sums, grads = self.grads(params, step, batch["inputs"], batch["targets"])
        compute = _wait((sums, grads), start) if timed else None
        grads, grads_in = transfer("gather grads", grads, self.root, timed)
        sums, sums_in = transfer("gather loss", sums, self.root, timed)
        start = time.perf_counter()
        state, metrics = self.update(state, sums, grads)
        update = _wait(state, start) if timed else None
        return state, metrics, Traffic((sent, scattered, grads_in, sums_in), compute, update)

    def compiled_collectives(self, batch_size: int, seq_len: int) -> list[hlo.Collective]:
        """Collectives XLA put into the two compiled programs (per device per step)."""
        tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=self.batch_sharding)
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.replicated),
                              self.abstract.params)
        step = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.replicated)
        sums, grads = jax.eval_shape(self.grads, params, step, tokens, tokens)
        on_root = lambda t: jax.tree.map(  # noqa: E731
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.root), t)
        found = []
        for compiled in (self.grads.lower(params, step, tokens, tokens).compile(),
                         self.update.lower(self.abstract, on_root(sums), on_root(grads)).compile()):
            found += hlo.parse(compiled.as_text())
        return found


def _wait(tree: Any, start: float) -> float:
    jax.block_until_ready(tree)
    return time.perf_counter() - start


def build(model: LanguageModel, devices: Sequence[jax.Device], optim_cfg: optim.OptimConfig,
          seed: int = 0) -> DataParallel:
    """DataParallel over ``devices`` (device 0 first) for ``model``: anything with
    ``init(key)``, ``loss(params, inputs, targets, key=)`` returning sums, ``param_axes()``
    and ``abstract_params()``. float32, no gradient accumulation. Each device computes its
    rows' loss as if they were the batch, as PyTorch's replicas do: a step equals one device's
    when the loss is a sum over rows -- not with dropout (masks drawn per device) nor with an
    MoE load-balancing loss (a product of batch averages, here each device's own)."""
    devices = list(devices)
    if not devices:
        raise ConfigError("DataParallel needs at least one device")
    mesh = build_mesh(f"{AXIS}={len(devices)}", devices)
    root = SingleDeviceSharding(devices[0])
    replicated, stacked = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    tx = optim.make(optim_cfg, model.param_axes())
    lr_schedule = optim.schedule(optim_cfg)

    def local(params, step, inputs, targets):
        # Varying copies: the gradient stays this device's own (differentiating the replicated
        # params themselves would all-reduce it -- DDP).
        params = jax.tree.map(lambda x: jax.lax.pcast(x, AXIS, to="varying"), params)
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), jax.lax.axis_index(AXIS))

        def total(p):
            sums = model.loss(p, inputs, targets, key=key)
            return sums.total, sums

        grads, sums = jax.grad(total, has_aux=True)(params)
        return jax.tree.map(lambda x: x[None], (sums, grads))

    grads = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(AXIS), P(AXIS)),
                                  out_specs=P(AXIS)),
                    in_shardings=(replicated, replicated, stacked, stacked), out_shardings=stacked)

    def update(state: TrainState, sums_N: Any, grads_N: Any) -> tuple[TrainState, dict]:
        sums = jax.tree.map(lambda x: x.sum(0), sums_N)
        count = sums.tokens
        grads = jax.tree.map(lambda g: g.sum(0).astype(jnp.float32) / count, grads_N)
        grad_norm = optim.global_norm(grads)
        grads = optim.clip(grads, grad_norm, optim_cfg.grad_clip)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optim.apply(state.params, updates, state.opt_state)
        metrics = {"loss": sums.nll / count, "grad_norm": grad_norm, "lr": lr_schedule(state.step),
                   **{k: v / count for k, v in sums.moe.items()}}
        return TrainState(state.step + 1, params, opt_state, None), metrics

    init = jax.jit(lambda s: fresh_state(tx, model.init(jax.random.key(s)), jnp.float32), out_shardings=root)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=root),
                            jax.eval_shape(init, 0))
    return DataParallel(mesh=mesh, root=root, replicated=replicated, batch_sharding=stacked, init=init,
                        grads=grads, update=jax.jit(update, donate_argnums=0), abstract=abstract)


def held_on(tree: Any) -> set[int]:
    """Ids of the devices holding any of ``tree``'s arrays."""
    return {d.id for x in jax.tree.leaves(tree) for d in x.sharding.device_set}


# ---- the comparison: one device, DDP and DataParallel ----------------------------------------

@dataclass
class Run:
    name: str
    losses: list[float]
    grad_norms: list[float]
    params: Any  # numpy, after the last step
    step_seconds: list[float]  # each step's, waited for; the first includes compiling

    @property
    def step_time(self) -> float:
        """Median step time after the first."""
        return float(np.median(self.step_seconds[1:] or self.step_seconds))


@dataclass
class Comparison:
    n_params: int
    n_devices: int
    runs: dict[str, Run]  # "one device", "DDP", "DataParallel"
    traffic: Traffic  # DataParallel's last step
    phase_seconds: dict[str, float]  # DataParallel's phases, median after the first step
    dp_collectives: list[hlo.Collective]  # in DataParallel's compiled programs
    ddp_collectives: list[hlo.Collective]  # in DDP's compiled step
    predicted: Predicted

    @property
    def ddp_bytes(self) -> int:
        """DDP's collective bytes per device per step (buffers), from the compiled step."""
        return sum(c.bytes * c.executions for c in self.ddp_collectives)

    @property
    def ddp_sent(self) -> float:
        return sum(c.sent_bytes * c.executions for c in self.ddp_collectives)

    def data_parallel_bytes(self, device: int) -> int:
        """What ``device`` moved in DataParallel's last step: transfers and compiled collectives."""
        return self.traffic.moved(device) + sum(c.bytes * c.executions for c in self.dp_collectives)

    def max_param_diff(self, name: str) -> float:
        """The largest absolute difference of any param from one device's."""
        ref = self.runs["one device"].params
        return max(float(np.abs(a - b).max()) for a, b in
                   zip(jax.tree.leaves(self.runs[name].params), jax.tree.leaves(ref)))


def _timed(fn: Callable, *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start


def compare(model: LanguageModel, devices: Sequence[jax.Device], optim_cfg: optim.OptimConfig, steps: int,
            batch_size: int, seq_len: int, seed: int = 0) -> Comparison:
    """Train ``model`` ``steps`` steps on the same random batches three ways: one device,
    GSPMD DDP (``data=N``) and DataParallel over ``devices``."""
    from jaxshard.analysis.inspect import compiled_collectives
    from jaxshard.rules import ShardingRules, Strategy
    from jaxshard.training.step import StepConfig, build_program

    devices = list(devices)
    data_parallel = build(model, devices, optim_cfg, seed)
    data_parallel.check_batch(batch_size)
    batches = random_batches(model.cfg.vocab_size, steps, batch_size, seq_len, seed)
    runs, ddp_collectives = {}, []
    for name, mesh_devices in (("one device", devices[:1]), ("DDP", devices)):
        rules = ShardingRules(build_mesh(f"{AXIS}={len(mesh_devices)}", mesh_devices), Strategy())
        program = build_program(model, rules, optim_cfg, StepConfig(seed=seed))
        state, losses, norms, seconds = program.init(seed), [], [], []
        for batch in batches:
            (state, metrics), t = _timed(program.step, state, jax.device_put(batch, program.batch_sharding))
            losses.append(float(metrics["loss"]))
            norms.append(float(metrics["grad_norm"]))
            seconds.append(t)
        runs[name] = Run(name, losses, norms, jax.tree.map(np.asarray, state.params), seconds)
        if name == "DDP":
            compiled = program.lower_step(batch_size, seq_len).compile()
            ddp_collectives = compiled_collectives(compiled, rules.mesh)
    state, losses, norms, seconds, phases = data_parallel.init(seed), [], [], [], defaultdict(list)
    for batch in batches:
        (state, metrics, traffic), t = _timed(data_parallel.step, state, batch, True)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
        seconds.append(t)
        for tr in traffic.transfers:
            phases[tr.phase].append(tr.seconds)
        phases["compute"].append(traffic.compute_seconds)
        phases["update"].append(traffic.update_seconds)
    runs["DataParallel"] = Run("DataParallel", losses, norms, jax.tree.map(np.asarray, state.params), seconds)
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(model.abstract_params()))
    rows = jax.ShapeDtypeStruct((batch_size // len(devices), seq_len), jnp.int32)
    loss = jax.eval_shape(lambda p, x: model.loss(p, x, x), model.abstract_params(), rows)
    return Comparison(
        n_params=n_params, n_devices=len(devices), runs=runs, traffic=traffic,
        phase_seconds={k: float(np.median(v[1:] or v)) for k, v in phases.items()},
        dp_collectives=data_parallel.compiled_collectives(batch_size, seq_len),
        ddp_collectives=ddp_collectives,
        predicted=predict(n_params, len(devices), batch_size, seq_len,
                          loss_values=len(jax.tree.leaves(loss))))


def format_comparison(c: Comparison) -> str:
    names = list(c.runs)
    lines = ["step  " + "".join(f"{n:>16}" for n in names)]
    for i in range(len(c.runs[names[0]].losses)):
        lines.append(f"{i + 1:>4}  " + "".join(f"{c.runs[n].losses[i]:>16.7f}" for n in names))
    lines.append("")
    for name in names[1:]:
        lines.append(f"max |param - one device's|, {name}: {c.max_param_diff(name):.2e}")
    p, N, other = c.predicted, c.n_devices, 1 if c.n_devices > 1 else 0
    lines += ["", f"Bytes per step ({c.n_params:,} params, P = {p.param_bytes:,} B, N = {N}). \"observed\": "
              "DataParallel's host-driven transfers counted from the moved arrays' shardings (modelled: "
              "a device_put compiles to no program whose transfers could be read) plus its compiled "
              f"programs' collectives ({len(c.dp_collectives)}, from their HLO); DDP's buffers from its "
              "compiled HLO (measured); a ring's sent bytes are the ring model's",
              f"  {'':<44}{'observed':>14}{'predicted':>14}"]

    def row(what, measured, predicted):
        lines.append(f"  {what:<44}{measured:>14,.0f}{predicted:>14,.0f}")

    if other:
        def into(phase):
            return c.traffic.phase(phase).received.get(other, 0)

        def out_of(phase):
            return c.traffic.phase(phase).sent.get(other, 0)

        row(f"DataParallel, device {other}: params broadcast in", into("broadcast"), p.broadcast)
        row("              batch rows scattered in", into("scatter"), p.scatter)
        row("              gradients gathered out", out_of("gather grads"), p.gather_grads)
        row("              loss sums gathered out", out_of("gather loss"), p.gather_loss)
        row("              total (each device k > 0)", c.data_parallel_bytes(other), p.data_parallel)
        row("DataParallel, device 0 (sent + received)", c.data_parallel_bytes(0), p.root)
    row("DDP, each device: collectives (buffers, compiled)", c.ddp_bytes, p.ddp_all_reduce)
    row("DDP, each device: sent by a ring (ring model)", c.ddp_sent, p.ddp_ring_sent)
    if other:
        row("DataParallel - DDP, per device", c.data_parallel_bytes(other) - c.ddp_bytes, p.excess)
    short = p.ddp_all_reduce - c.ddp_bytes
    if short > 0.01 * p.ddp_all_reduce:
        lines.append(f"  (DDP's compiled all-reduce is {short:,} B short of P: XLA leaves out gradient entries "
                     "that are zero whatever the batch -- e.g. a learned position table's rows beyond the "
                     "sequence length; DataParallel gathers whole gradients, as PyTorch's does)")
    lines += ["", "Step time (median after the first step; DataParallel waits for each of its phases)"]
    for name in names:
        lines.append(f"  {name:<14}{c.runs[name].step_time * 1e3:>10.1f} ms")
    phases = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in c.phase_seconds.items())
    lines.append(f"  DataParallel phases, each waited for (ms): {phases}")
    return "\n".join(lines)
