"""Per-step metrics as JSON lines, and the progress bar."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm


class MetricsLog:
    """Appends one JSON object per step to ``path`` (nothing when path is None), flushed each
    line so a crashed run keeps every step it finished."""

    def __init__(self, path: str | os.PathLike | None, append: bool = False):
        self._file: IO[str] | None = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a" if append else "w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(_jsonable(record)) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _jsonable(record: dict[str, Any]) -> dict[str, Any]:
    # JSON has no NaN/inf: write them as strings so the line stays valid JSON.
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as JSON via a temporary file and rename: never a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def progress(total: int, enabled: bool, stream: IO[str] | None = None) -> tqdm:
    """The progress bar, on ``stream`` (stderr) and only where that is a terminal: under a batch
    scheduler it is a file, where every refresh of a bar would be one more carriage-return
    update. The run's log lines (``--log-every``) are printed either way."""
    stream = stream or sys.stderr
    terminal = bool(getattr(stream, "isatty", None) and stream.isatty())
    return tqdm(total=total, disable=not (enabled and terminal), unit="step", dynamic_ncols=True,
                file=stream, mininterval=0.5, smoothing=0.1)
