"""Goodput: how a run's wall time was spent, each part timed where it happens.

The wall time runs from the command's start (after Python's imports) to the report. Its parts:

* ``startup``: joining the processes, reading the data, building the model, making or restoring
  the state, the step's analysis -- everything before the first step but its compilation;
* ``compile``: compiling the training step;
* ``steps``: the training steps, each from the completion of the one before it (the metrics'
  ``step_time_s``, which a step that waits for its evaluation or checkpoint starts at its own
  dispatch);
* ``recomputed``: of those, the steps a resumed run trains again because the run before it had
  done them after its last checkpoint (the metrics file's steps beyond it): lost to the restart;
* ``evaluation`` and ``checkpoint`` (the blocking part of a save: orbax writes the rest in the
  background while training goes on; and at the end, the wait for the last save's write);
* ``finish``: after the last step, exports, the sample and the report's own measurements.

What no part covers is reported as ``unaccounted`` (host work between the parts, e.g. writing
logs); a test holds it under 2% of the wall time. ``goodput`` is ``steps`` over the wall time."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

PARTS = ("startup", "compile", "steps", "recomputed", "evaluation", "checkpoint", "finish")


class Goodput:
    def __init__(self, start: float | None = None, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.start = clock() if start is None else start
        self.seconds = dict.fromkeys(PARTS, 0.0)

    def add(self, part: str, seconds: float) -> None:
        if part not in self.seconds:
            raise ValueError(f"unknown goodput part {part!r}: {', '.join(PARTS)}")
        self.seconds[part] += seconds

    @contextlib.contextmanager
    def timed(self, part: str) -> Iterator[None]:
        t = self.clock()
        try:
            yield
        finally:
            self.add(part, self.clock() - t)

    def summary(self) -> dict[str, Any]:
        wall = self.clock() - self.start
        accounted = sum(self.seconds.values())
        parts = {**self.seconds, "unaccounted": wall - accounted}
        return {"wall_s": wall, "seconds": parts, "fractions": {k: v / wall for k, v in parts.items()},
                "goodput": self.seconds["steps"] / wall}

    def line(self, summary: dict[str, Any]) -> str:
        f = summary["fractions"]
        rest = ", ".join(f"{k} {f[k]:.0%}" for k in PARTS if k != "steps" and summary["seconds"][k])
        return f"goodput {summary['goodput']:.0%} of {summary['wall_s']:.1f} s in training steps" + (
            f"; {rest}" if rest else "")
