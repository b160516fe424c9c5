"""The training loop never waits on the host: results are read one step late, batches are made
ahead on a background thread."""

import queue
import threading
import time

import pytest

from jaxshard.data.corpus import Prefetch
from jaxshard.errors import DataError
from jaxshard.loop import StepClock, run_pipelined


def _events(steps, waits=()):
    events = []
    run_pipelined(steps, dispatch=lambda i: events.append(("dispatch", i)) or f"out{i}",
                  complete=lambda i, out: events.append(("read", i, out)),
                  waits=lambda i: i in waits)
    return events


def test_each_step_is_read_after_the_next_is_dispatched():
    events = _events(range(3, 8))
    assert events == [("dispatch", 3), ("dispatch", 4), ("read", 3, "out3"), ("dispatch", 5),
                      ("read", 4, "out4"), ("dispatch", 6), ("read", 5, "out5"), ("dispatch", 7),
                      ("read", 6, "out6"), ("read", 7, "out7")]


def test_steps_that_evaluate_or_checkpoint_are_read_at_once():
    """Such a step needs its own state, which the next step's dispatch would donate."""
    events = _events(range(0, 5), waits={1})
    assert events == [("dispatch", 0), ("dispatch", 1), ("read", 0, "out0"), ("read", 1, "out1"),
                      ("dispatch", 2), ("dispatch", 3), ("read", 2, "out2"), ("dispatch", 4),
                      ("read", 3, "out3"), ("read", 4, "out4")]


def test_an_error_on_reading_stops_before_another_dispatch():
    """A non-finite loss found while reading step i stops the run; step i + 1 was dispatched
    but nothing after it."""
    dispatched = []

    def complete(i, out):
        if i == 2:
            raise RuntimeError("loss is nan")

    with pytest.raises(RuntimeError, match="loss is nan"):
        run_pipelined(range(10), dispatched.append, complete, waits=lambda i: False)
    assert dispatched == [0, 1, 2, 3]


def _clocked(steps, step_s, holds=(), reading_s=0.0, waits=()):
    """Each step's time by the clock, on a fake device that runs steps of ``step_s`` in turn:
    the dispatches of steps ``holds`` return only once their step has run; reading a step's
    metrics takes ``reading_s`` of host time; steps ``waits`` are read at once, then 0.5 s pass."""
    work, times = queue.Queue(), {}

    def device():
        while (done := work.get()) is not None:
            time.sleep(step_s)
            done.set()

    threading.Thread(target=device, daemon=True).start()
    clock = StepClock(wait=threading.Event.wait)

    def dispatch(i):
        started, done = time.perf_counter(), threading.Event()
        work.put(done)
        if i in holds:
            done.wait()
        clock.dispatched(i, done, started)
        return done

    def complete(i, out):
        times[i] = clock.seconds(i)
        time.sleep(reading_s + (0.5 if i in waits else 0.0))

    try:
        run_pipelined(range(steps), dispatch, complete, waits=lambda i: i in waits)
    finally:
        work.put(None)
        clock.close()
    assert sorted(times) == list(range(steps))
    return times


def test_a_dispatch_that_holds_the_host_counts_to_its_own_step():
    """Step 1's dispatch returns only once that step has run (as one whose loops wait on the
    device does). Timed from the host's reads, step 0 would take 0.6 s and step 1 none; the
    clock, which sees each step's outputs become ready, gives every step its 0.3 s."""
    times = _clocked(4, 0.3, holds={1})
    assert all(0.18 < t < 0.48 for t in times.values()), times


def test_host_work_that_holds_the_devices_up_counts_and_a_pause_does_not():
    """Reading a step takes 0.3 s of host time where the device needs 0.05 s. The first two
    steps, dispatched before any read, take the device's 0.05 s; from then on each step waits
    for a read and takes the host's 0.3 s (the times add up to the wall time). Step 3
    evaluates (read at once, then a 0.5 s pause): steps 4 and 5, dispatched after it, start
    afresh and the pause is no step's."""
    times = _clocked(8, 0.05, reading_s=0.3, waits={3})
    assert all(times[i] < 0.2 for i in (0, 1, 4, 5)), times
    assert all(0.2 < times[i] < 0.45 for i in (2, 3, 6, 7)), times


def test_a_step_that_fails_raises_where_it_is_read():
    """An error waiting on a step's outputs (a device error, a lost peer) is raised where the
    loop reads that step, as reading its metrics would; the clock's thread is a daemon, so a
    step that never completes does not hold the process at exit."""
    def wait(outputs):
        raise RuntimeError(f"{outputs} failed")

    clock = StepClock(wait=wait)
    clock.dispatched(0, "step 0", time.perf_counter())
    with pytest.raises(RuntimeError, match="^step 0 failed$"):
        clock.seconds(0)
    watchers = [t for t in threading.enumerate() if t.name == "step-clock"]
    clock.close()
    assert watchers and all(t.daemon for t in watchers)


def test_prefetch_makes_batches_ahead_on_another_thread():
    made = []

    def make(i):
        made.append((i, threading.current_thread() is threading.main_thread()))
        return i * 10

    with Prefetch(make, range(5, 10), depth=2) as batches:
        deadline = time.monotonic() + 5
        while len(made) < 3 and time.monotonic() < deadline:  # depth 2 queued, one being put
            time.sleep(0.01)
        assert [i for i, _ in made][:3] == [5, 6, 7]  # made before anyone asked
        assert [batches.get(i) for i in range(5, 10)] == [50, 60, 70, 80, 90]
    assert made == [(i, False) for i in range(5, 10)]


def test_prefetch_raises_the_sources_error_where_its_batch_is_taken():
    def make(i):
        if i == 2:
            raise DataError("the training split is too short")
        return i

    with Prefetch(make, range(5)) as batches:
        assert batches.get(0) == 0 and batches.get(1) == 1
        with pytest.raises(DataError, match="too short"):
            batches.get(2)
