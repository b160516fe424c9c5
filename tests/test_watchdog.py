"""The hang watchdog (jaxshard/training/watchdog.py): its limit, pauses and message on a clock
the test moves, and a planted stall in one of two real processes, which ends the job with the
watchdog's status instead of a hang."""

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxshard.training import watchdog
from jaxshard.training.watchdog import Watchdog

ROOT = Path(__file__).resolve().parents[1]
CACHE = os.environ.get("JAXSHARD_TEST_CACHE", str(ROOT / ".cache" / "xla-tests"))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def dog(timeout):
    clock, stopped, out = Clock(), [], io.StringIO()
    return Watchdog(timeout, out=out, stop=stopped.append, clock=clock), clock, stopped, out


def test_the_automatic_limit_is_ten_medians_after_warm_up_with_a_floor():
    d, clock, stopped, _ = dog(None)
    assert d.limit() == watchdog.FLOOR_S  # nothing measured yet
    for step, t in enumerate([50.0, 40.0, 30.0, 40.0, 42.0, 44.0], start=1):  # the first three: warm-up
        d.beat(step, t)
    assert d.limit() == pytest.approx(watchdog.FACTOR * 42.0)
    d2, *_ = dog(None)
    for step in range(1, 10):
        d2.beat(step, 0.1)
    assert d2.limit() == watchdog.FLOOR_S  # fast steps: the floor


def test_the_first_step_waits_for_the_slowest_start_up():
    d, clock, stopped, _ = dog(5.0)
    clock.now += 100.0  # a peer still compiling: within the first step's floor
    assert not d.check() and d.limit() == watchdog.FLOOR_S
    clock.now += watchdog.FLOOR_S
    assert d.check() and stopped == [watchdog.EXIT_STATUS]


def test_a_step_over_its_limit_stops_the_process_with_one_line():
    d, clock, stopped, out = dog(5.0)
    d.beat(7, 1.0)
    clock.now += 5.0
    assert not d.check() and stopped == []
    clock.now += 0.5
    assert d.check() and stopped == [watchdog.EXIT_STATUS]
    line = out.getvalue()
    assert line.count("\n") == 1 and line.startswith("error: no training step has finished for 6 s since step 7")
    assert "limit 5 s: --step-timeout" in line


def test_evaluation_and_checkpoints_pause_the_watch():
    d, clock, stopped, _ = dog(5.0)
    d.beat(1, 1.0)
    with d.paused():
        clock.now += 100.0
        assert not d.check()
    clock.now += 4.0  # the watch restarts when the pause ends
    assert not d.check() and stopped == []
    clock.now += 2.0
    assert d.check()


def test_zero_turns_it_off():
    d, clock, stopped, _ = dog(0)
    assert not d.enabled
    with d:
        assert d._thread is None


def test_a_stalled_process_ends_the_job_with_the_watchdogs_status():
    """Process 1 of 2 stalls as it dispatches step 4; process 0 then waits in a collective.
    A watchdog stops its process within the limit, the launcher stops the other, and the job
    ends with status 124 and the watchdog's line, long before the launcher's own timeout."""
    cmd = [sys.executable, str(ROOT / "scripts" / "launch_local.py"), "--processes", "2",
           "--devices-per-process", "4", "--timeout", "200", "--init-timeout", "60", "--",
           "--model", "tiny", "--batch-size", "16", "--seq-len", "64", "--no-progress", "--eval-every", "0",
           "--compile-cache", CACHE, "--mesh", "fsdp=8", "--steps", "8", "--step-timeout", "8"]
    start = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=220, cwd=ROOT,
                       env={**os.environ, "JAXSHARD_FAULT": "stall:1:4"})
    assert r.returncode == watchdog.EXIT_STATUS, r.stdout[-2000:] + r.stderr[-2000:]
    assert "error: no training step has finished for" in r.stdout + r.stderr
    assert f"exited with status {watchdog.EXIT_STATUS}" in r.stderr
    assert time.monotonic() - start < 150


def test_a_negative_timeout_is_a_one_line_error():
    done = subprocess.run([sys.executable, str(ROOT / "experiments" / "train.py"), "--platform", "cpu",
                           "--step-timeout", "-1", "--steps", "1"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: --step-timeout must be >= 0 (0: no watchdog), got -1"]
