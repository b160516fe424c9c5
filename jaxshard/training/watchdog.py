"""A hang watchdog: a training step that has not finished within ``--step-timeout`` stops the
process with one line and exit status :data:`EXIT_STATUS`, so that a launcher's restart (or the
scheduler's requeue) takes over instead of a job that hangs until its wall-time limit.

A hung step is usually a collective waiting for a peer that died or stalled: the main thread is
then blocked inside XLA and cannot notice, so the watch runs on a thread of its own and ends the
process with ``os._exit`` (nothing to unwind that would not also hang). Evaluation and
checkpoint writes are not steps and pause the watch; the time before the first step (start-up,
compilation) is not watched either.

The automatic limit (no ``--step-timeout``): :data:`FACTOR` times the median of the last
:data:`RECENT` steps once :data:`WARMUP` steps have finished (the first carry one-off costs),
and never less than :data:`FLOOR_S`, which is also the limit until then. The first step gets
at least :data:`FLOOR_S` under any limit: the processes' start-ups (compiling, restoring) end
at different times, and it waits for the slowest."""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import threading
import time
from typing import IO, Callable, Iterator

EXIT_STATUS = 124  # as coreutils' timeout(1): "the command timed out"
FACTOR = 10.0
WARMUP = 3
RECENT = 100  # the steps whose median sets the automatic limit
FLOOR_S = 300.0


class Watchdog:
    """Watches the time since the last finished step. ``timeout``: seconds (fixed), 0 (off), or
    None (automatic, see the module). ``stop`` ends the process (tests replace it)."""

    def __init__(self, timeout: float | None, *, out: IO[str] | None = None,
                 stop: Callable[[int], None] = os._exit, clock: Callable[[], float] = time.monotonic,
                 poll_s: float | None = None):
        self.fixed, self.out, self._stop, self.clock = timeout, out or sys.stderr, stop, clock
        self.times: list[float] = []
        self._auto = FLOOR_S
        self.step = 0  # the last finished step; the one in flight is the next
        self.last = clock()
        self._paused = 0
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._poll = poll_s
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.fixed != 0

    def limit(self) -> float:
        """Seconds the step in flight may take. The first step gets at least :data:`FLOOR_S`
        whatever the limit: it also waits for the slowest process's start-up."""
        if self.fixed:
            return float(self.fixed) if self.step else max(float(self.fixed), FLOOR_S)
        return self._auto

    def beat(self, step: int, step_time_s: float | None = None) -> None:
        """Step ``step`` finished (in ``step_time_s``): the watch restarts from now."""
        with self._lock:
            self.step, self.last = step, self.clock()
            if step_time_s is not None:
                self.times.append(step_time_s)
                del self.times[:-(WARMUP + RECENT)]  # the warm-up's, then the recent steps'
                if len(self.times) > WARMUP:
                    self._auto = max(FLOOR_S, FACTOR * statistics.median(self.times[WARMUP:]))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Not a step (evaluation, a checkpoint write): unwatched, and the watch restarts after."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                self.last = self.clock()

    def check(self) -> bool:
        """Stops the process if the step in flight is over its limit; else False."""
        with self._lock:
            if self._paused:
                return False
            waited, limit, step = self.clock() - self.last, self.limit(), self.step
        if waited <= limit:
            return False
        how = "--step-timeout" if self.fixed else (
            f"{FACTOR:g}x the median step, at least {FLOOR_S:g} s; set --step-timeout")
        since = f"since step {step}" if step else "since the first step started"
        self.out.write(f"error: no training step has finished for {waited:.0f} s {since} (limit {limit:.0f} s: "
                       f"{how}); a peer process may have died or a collective hung; exiting with status "
                       f"{EXIT_STATUS} for a restart to take over\n")
        self.out.flush()
        self._stop(EXIT_STATUS)
        return True

    def _watch(self) -> None:
        while not self._done.wait(self._poll or min(1.0, self.limit() / 20)):
            if self.check():
                return

    def __enter__(self) -> Watchdog:
        if self.enabled:
            self.last = self.clock()
            self._thread = threading.Thread(target=self._watch, name="jaxshard-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
