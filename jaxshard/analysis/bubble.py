"""Measuring a pipeline's bubble: the share of device time the stages spend waiting.

The bubble cannot be read off one step's time: what a stage does per microbatch is not known
apart from its waiting. So each stage's own work is timed with the same executor running a
*packed* table -- the schedule's M x V forward and backward slots back to back on that stage
only, one per tick, nothing waiting -- less the same table with every slot idle (the optimizer
and the per-tick sends, which the real step pays too). Then

    bubble = idle device time / all device time = 1 - sum_s W_s / (P (T - T_idle))

with T the real step and W_s stage s's work. Devices that share hardware (fake CPU devices
on a few cores) slow each other down when all work at once, which this counts as idle time;
so the packed table with every stage busy every tick (A) is timed too, and the bubble against
it, 1 - A / (T - T_idle), credits a stage with the speed it gains while the others idle. On
independent accelerators the two agree.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable

import jax
import numpy as np

from jaxshard.parallel.pipeline import Schedule

if TYPE_CHECKING:
    from jaxshard.training.step import Program


def packed(schedule: Schedule, stage: int | str | None) -> Schedule:
    """``schedule``'s M V forward + backward slots on every tick, on ``stage`` only ("all": on
    every stage at once; None: no stage works), with no waiting; a zero-bubble schedule's
    backward as its B and its W, the W in the same tick's weight slot. The data dependencies
    are ignored: only its time means anything."""
    n = schedule.virtual * schedule.microbatches
    t = np.arange(n)
    i = np.tile((t % schedule.microbatches)[:, None], (1, schedule.stages)).astype(np.int32)
    v = np.tile((t // schedule.microbatches)[:, None], (1, schedule.stages)).astype(np.int32)
    active = np.full(schedule.stages, stage == "all")
    if isinstance(stage, int):
        active[stage] = True
    i = np.where(active, i, -1)
    zero = np.zeros_like(i)
    split = {}
    if schedule.split:  # all in slot 0: F writes it, B reads and rewrites it, W reads it
        none = np.full_like(i, -1)
        split = dict(wgt=i, wgt_chunk=v, wgt_slot=zero, bwd_wslot=zero, wgt_wslot=zero, fwgt=none,
                     fwgt_slot=zero, fwgt_wslot=zero, w_slots=1, fwd_bslot=zero, bwd_bslot=zero, b_slots=1,
                     fwd_in=none, fwd_from=none, bwd_in=none, bwd_from=none, in_slots=0, bwd_in_slots=0)
    return dataclasses.replace(schedule, kind="packed", fwd=i, bwd=i, fwd_chunk=v, bwd_chunk=v,
                               fwd_slot=zero, bwd_slot=zero, slots=1, **split)


def step_seconds(program: Program, batch_size: int, seq_len: int, vocab: int, steps: int) -> float:
    """Fastest wall time of ``steps`` steps of ``program`` (from its own initial state) on one
    random batch, after two warm-up steps (the first compiles); each step waits for its loss.
    The minimum, not the median: other work on the machine only ever adds time, and the
    differences taken from these times (a stage's work less the idle table) must not carry it."""
    state, batch = _state_and_batch(program, batch_size, seq_len, vocab)
    times = []
    for _ in range(steps + 2):
        t = time.perf_counter()
        state, metrics = program.step(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t)
    return min(times[2:])


def _state_and_batch(program: Program, batch_size: int, seq_len: int, vocab: int) -> tuple[Any, Any]:
    """``program``'s initial state and one random batch on its devices."""
    rng = np.random.default_rng(0)
    return program.init(0), jax.device_put({k: rng.integers(0, vocab, (batch_size, seq_len), dtype=np.int32)
                                            for k in ("inputs", "targets")}, program.batch_sharding)


def traced_parts(program: Program, batch_size: int, seq_len: int, vocab: int) -> dict[str, Any]:
    """One step of ``program`` (after two warm-up steps) under ``jax.profiler``: its wall time
    traced and, per device, its seconds by the part of the pipeline step each op is in
    (:func:`jaxshard.analysis.profile.tick_parts`: F, B, W, the tick loop's own work, the sends
    with their waiting, the step around the loop), read from the trace's thunks (CPU) or
    kernels, tied to the compiled step's instructions."""
    import tempfile

    from jaxshard.analysis import profile

    state, batch = _state_and_batch(program, batch_size, seq_len, vocab)
    for _ in range(2):
        state, metrics = program.step(state, batch)
        jax.block_until_ready(metrics["loss"])
    sources = profile.hlo_sources(program.lower_step(batch_size, seq_len).compile().as_text())
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            t = time.perf_counter()
            state, metrics = program.step(state, batch)
            jax.block_until_ready(metrics["loss"])
            wall = time.perf_counter() - t
        parts = profile.tick_parts(profile.kernels(profile.latest_xplane(trace_dir)), sources)
    return {"step_s": wall, "devices": parts}


@dataclasses.dataclass(frozen=True)
class Bubble:
    step_s: float  # the real schedule's step
    idle_s: float  # the packed table with every slot idle
    stage_work_s: list[float]  # each stage's packed work alone, less idle_s
    all_stages_s: float  # every stage's packed work at once, less idle_s
    theory: float

    @property
    def measured(self) -> float:
        return 1 - sum(self.stage_work_s) / (len(self.stage_work_s) * (self.step_s - self.idle_s))

    @property
    def vs_all_busy(self) -> float:
        return 1 - self.all_stages_s / (self.step_s - self.idle_s)

    @property
    def slowdown(self) -> float:
        """How much longer all stages at once take than the slowest alone (1: independent)."""
        return self.all_stages_s / max(self.stage_work_s)

    def as_dict(self) -> dict[str, Any]:
        return {"step_s": self.step_s, "idle_s": self.idle_s, "stage_work_s": self.stage_work_s,
                "all_stages_s": self.all_stages_s, "concurrency_slowdown": self.slowdown,
                "bubble_measured": self.measured, "bubble_vs_all_busy": self.vs_all_busy,
                "bubble_theory": self.theory}

    def line(self) -> str:
        return (f"bubble measured {self.measured:.3f} (against all stages busy {self.vs_all_busy:.3f}; "
                f"theory {self.theory:.3f}): step {self.step_s * 1e3:.1f} ms, stage work "
                + " + ".join(f"{w * 1e3:.1f}" for w in self.stage_work_s)
                + f" ms alone, {self.all_stages_s * 1e3:.1f} ms all at once")


def measure(program_for: Callable[[Schedule | None], Any], schedule: Schedule, batch_size: int,
            seq_len: int, vocab: int, steps: int) -> Bubble:
    """Time ``schedule``'s step and its packed tables, each built by ``program_for(table)``
    (None: the real schedule): P + 3 compiled programs."""
    def time_of(table):
        return step_seconds(program_for(table), batch_size, seq_len, vocab, steps)

    step = time_of(None)
    idle = time_of(packed(schedule, None))
    work = [time_of(packed(schedule, s)) - idle for s in range(schedule.stages)]
    return Bubble(step, idle, work, time_of(packed(schedule, "all")) - idle, schedule.bubble())


def priced_step(schedule: Schedule, devices: dict[str, dict[str, float]]) -> float:
    """``schedule``'s step with its tables' ops priced at their traced cost instead of a unit
    each: per tick, the slowest stage's ops plus its share of the tick loop's own work, summed
    over the ticks, and the slowest stage's step around the loop. ``devices``: per stage
    (``"0"``, ``"1"``, ...), its traced seconds by part (:func:`traced_parts`, whose device
    ordinals are the stages on a mesh of the stage axis alone); an op's cost on a stage is its
    part over the times the stage's table runs it, the embedding's counted with F and B and
    the head's with B. What a traced step holds beyond this is the runtime's and the sends'
    own time. Tables of one chunk a stage (no ``interleaved``)."""
    if schedule.virtual != 1:
        raise ValueError("priced_step prices tables of one chunk a stage")
    P, split = schedule.stages, schedule.split
    if set(devices) != {str(s) for s in range(P)}:
        raise ValueError(f"priced_step needs each of the {P} stages' parts, got {sorted(devices)}")
    runs = lambda table: (table >= 0).astype(float) if table is not None else np.zeros_like(schedule.fwd, float)  # noqa: E731
    fwd, bwd, wgt, fwgt = runs(schedule.fwd), runs(schedule.bwd), runs(schedule.wgt), runs(schedule.fwgt)
    per_tick = np.zeros(fwd.shape)
    around = []
    for s in range(P):
        part = devices[str(s)]
        get = lambda *names: sum(part.get(n, 0.0) for n in names)  # noqa: E731
        each = lambda seconds, table: seconds / max(table[:, s].sum(), 1)  # noqa: E731
        tick = get("tick") / schedule.ticks
        if split or s < P - 1:
            f = each(get("F", "embed"), fwd)
            b = each(get("B", "head", "embed_grad"), bwd)
            w = each(get("W", "W_first"), wgt + fwgt)
            per_tick[:, s] = fwd[:, s] * f + bwd[:, s] * b + (wgt[:, s] + fwgt[:, s]) * w + tick
        else:  # 1F1B's last chunk: its forward and backward in the backward slot
            per_tick[:, s] = bwd[:, s] * each(get("last", "embed", "embed_grad"), bwd) + tick
        around.append(get("outside", "xla"))
    return float(per_tick.max(axis=1).sum() + max(around))
