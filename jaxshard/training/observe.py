"""What a run shows besides its metrics file: TensorBoard scalars (and reading them back, with
the metrics file, as curves to plot), and a profiler trace of a window of steps."""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import jax

from jaxshard.errors import ConfigError, DataError
from jaxshard.options import flag, option

@dataclass(frozen=True, slots=True)
class OutputConfig:
    """What a run writes and shows as it trains."""

    metrics: str | None = option(None, "JSON lines, one per step", run_only=True)
    report: str | None = option(None, "JSON summary written at the end", run_only=True)
    no_progress: bool = option(False, "no progress bar (there is one only where stderr is a terminal)",
                               run_only=True)
    log_every: int = option(0, "print a line (loss, tokens/s, MFU) every N steps; 0: about ten per run",
                            run_only=True)
    tensorboard: str | None = option(None, "write TensorBoard scalars (loss, val loss, lr, grad norm, "
                                           "tokens/s, MFU)", metavar="DIR", run_only=True)
    profile_steps: str | None = option(None, "record a jax.profiler trace of steps A to B into "
                                             "--profile-dir", metavar="A:B", run_only=True)
    profile_dir: str | None = option(None, "where --profile-steps' trace goes", metavar="DIR", run_only=True)

    def __post_init__(self) -> None:
        if self.log_every < 0:
            raise ConfigError(f"{flag(OutputConfig, 'log_every')} must be >= 0, got {self.log_every}")


# A step record's key -> its TensorBoard tag; every moe_* key is written too, as train/moe_*.
TAGS = {"loss": "train/loss", "val_loss": "val/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
        "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu"}
FLUSH_SECS = 10  # the writer's thread flushes this often: a killed run loses about this much


def tag_of(key: str) -> str | None:
    if key in TAGS:
        return TAGS[key]
    if key.startswith("val/"):  # --eval-data's val/NAME/loss and val/NAME/perplexity
        return key
    if key.startswith("goodput_"):  # the run's wall time by part, written once at its end
        return f"goodput/{key.removeprefix('goodput_')}"
    return f"train/{key}" if key.startswith("moe_") else None


class TensorBoardLog:
    """The scalars of each step's record (``TAGS``) as TensorBoard events in ``directory``,
    written by process 0 only; nothing at all when ``directory`` is None.

    ``start_step`` > 0 (a resumed run) marks the file so TensorBoard drops what an earlier run
    logged after that step: those steps are run again. Values are stored as float32, as
    TensorBoard's scalars are."""

    def __init__(self, directory: str | os.PathLike | None, start_step: int = 0):
        self._writer = None
        if directory is not None and jax.process_index() == 0:
            from tensorboardX import SummaryWriter  # imports torch where installed: only when used

            # tensorboardX names the file by the second and truncates one of the same name: a
            # run resumed within the second would erase its predecessor's file without the suffix.
            self._writer = SummaryWriter(logdir=str(directory), flush_secs=FLUSH_SECS,
                                         purge_step=start_step + 1 if start_step else None,
                                         filename_suffix=f".{time.time_ns() % 10**9:09d}")

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        if self._writer is None:
            return
        for key, value in record.items():
            tag = tag_of(key)
            if tag is not None and _finite(value):
                self._writer.add_scalar(tag, float(value), step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()  # writes what is queued, then flushes
            self._writer = None

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _finite(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def read_scalars(directory: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files directly in ``directory``: tag -> [(step, value)] in the
    order written. A resumed run's purge marker drops the values read before it from its step
    on, as TensorBoard does. CRCs are not checked; a record cut short (a run killed while
    writing) ends its file."""
    files = sorted(Path(directory).glob("*tfevents*")) if Path(directory).is_dir() else []
    if not files:
        raise DataError(f"{directory}: no TensorBoard event file (events.out.tfevents.*) there")
    from google.protobuf.message import DecodeError
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    out: dict[str, list[tuple[int, float]]] = {}
    for path in files:
        for offset, data in _records(path.read_bytes()):
            try:
                event = Event.FromString(data)
            except DecodeError:
                raise DataError(f"{path}: the record at byte {offset} is not an event") from None
            if event.WhichOneof("what") == "session_log" and event.session_log.status == SessionLog.START:
                for points in out.values():
                    points[:] = [(s, v) for s, v in points if s < event.step]
            for value in event.summary.value:
                if value.WhichOneof("value") == "simple_value":
                    out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def _records(data: bytes) -> Iterator[tuple[int, bytes]]:
    """TFRecord framing: length (uint64 LE), its CRC, the data, the data's CRC."""
    pos = 0
    while pos + 12 <= len(data):
        (n,) = struct.unpack_from("<Q", data, pos)
        if pos + 12 + n + 4 > len(data):
            return
        yield pos, data[pos + 12:pos + 12 + n]
        pos += 12 + n + 4


@dataclass(frozen=True, slots=True)
class Curve:
    """One run's ``metric`` by step, and the validation points of it (``val_<metric>``) where
    the run has them; non-finite values are left out."""
    name: str
    metric: str
    train: list[tuple[int, float]]
    val: list[tuple[int, float]]


def read_curve(run: str | os.PathLike, metric: str = "loss") -> Curve:
    """``run``: a metrics JSON-lines file, a folder holding ``metrics.jsonl``, or a folder of
    TensorBoard event files. Named by its folder when the file is ``metrics.jsonl``."""
    path = Path(run)
    if path.is_dir():
        if (path / "metrics.jsonl").is_file():
            return _curve_from_jsonl(path / "metrics.jsonl", path.name, metric)
        if not any(path.glob("*tfevents*")):
            raise DataError(f"{run}: neither metrics.jsonl nor TensorBoard event files there")
        scalars = read_scalars(path)
        train, val = (scalars.get(tag_of(k), []) for k in (metric, f"val_{metric}"))
        if not train and not val:
            raise DataError(f"{run}: the event files have no {metric!r}")
        return Curve(path.name, metric, _finite_points(train), _finite_points(val))
    if not path.is_file():
        raise DataError(f"{run}: no such file or folder")
    return _curve_from_jsonl(path, path.parent.name if path.name == "metrics.jsonl" else path.name, metric)


def _curve_from_jsonl(path: Path, name: str, metric: str) -> Curve:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path}: not a metrics file (not UTF-8 text)") from None
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise DataError(f"{path}:{n}: not a JSON object") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise DataError(f"{path}:{n}: a record needs an integer \"step\"")
        records.append(record)
    if not records:
        raise DataError(f"{path}: empty (no step records)")
    train, val = ([(r["step"], v) for r in records if (v := _number(r.get(k))) is not None]
                  for k in (metric, f"val_{metric}"))
    if not train and not val:
        raise DataError(f"{path}: no step has {metric!r}")
    return Curve(name, metric, _finite_points(train), _finite_points(val))


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    # The metrics file writes NaN and inf as strings.
    return float(value) if value in ("nan", "inf", "-inf") else None


def _finite_points(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    return [(s, v) for s, v in points if math.isfinite(v)]


_SPEC = re.compile(r"(-?\d+):(-?\d+)")


class ProfileWindow:
    """A ``jax.profiler`` trace of steps ``first`` to ``last`` (inclusive; step i + 1 is the
    (i + 1)-th update) into ``directory``, which TensorBoard's profile plugin or XProf opens:
    ``<directory>/plugins/profile/<date_time>/<host>.xplane.pb``. Under several processes each
    traces its own devices into ``<directory>/process_<i>`` (processes on one host would
    otherwise write the same file).

    The loop calls ``before(step)`` just before dispatching a step and ``after(step, block)``
    just after; a run resumed inside the window traces the rest of it."""

    def __init__(self, first: int, last: int, directory: str | os.PathLike):
        self.first, self.last, self.directory = first, last, str(directory)
        self._state = "waiting"  # -> "tracing" -> "done"

    @classmethod
    def parse(cls, spec: str | None, directory: str | os.PathLike | None) -> ProfileWindow | None:
        """``--profile-steps A:B`` and ``--profile-dir``: both or neither. Touches no device
        (the flags are parsed before the backend starts)."""
        if spec is None and not directory:
            return None
        if not directory:
            raise ConfigError(f"--profile-steps {spec} needs --profile-dir (where the trace goes)")
        if spec is None:
            raise ConfigError(f"--profile-dir {directory} needs --profile-steps A:B (the steps to trace)")
        m = _SPEC.fullmatch(spec.strip())
        if m is None:
            raise ConfigError(f"--profile-steps must be A:B, the first and last step to trace "
                              f"(e.g. 10:12), got {spec!r}")
        first, last = int(m[1]), int(m[2])
        if first < 1:
            raise ConfigError(f"--profile-steps {spec}: steps count from 1")
        if last < first:
            raise ConfigError(f"--profile-steps {spec}: the last step {last} is before the first {first}")
        return cls(first, last, directory)

    def check(self, steps: int) -> None:
        if self.last > steps:
            raise ConfigError(f"--profile-steps {self.first}:{self.last} ends after the run's last "
                              f"step (--steps {steps})")

    def trace_dir(self) -> str:
        if jax.process_count() == 1:
            return self.directory
        return os.path.join(self.directory, f"process_{jax.process_index()}")

    def before(self, step: int) -> None:
        if self._state == "waiting" and self.first <= step <= self.last:
            jax.profiler.start_trace(self.trace_dir())
            self._state = "tracing"

    def after(self, step: int, block: Callable[[], None]) -> None:
        """At the last step: ``block()`` waits for the devices to finish it, so the trace holds
        the whole window's device work, not only its dispatch."""
        if self._state == "tracing" and step >= self.last:
            block()
            self._stop()

    def close(self) -> None:
        """Stops (and writes) a trace still running: the run ended inside the window."""
        if self._state == "tracing":
            self._stop()

    def _stop(self) -> None:
        self._state = "done"
        jax.profiler.stop_trace()

    def __enter__(self) -> ProfileWindow:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
