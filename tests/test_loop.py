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


def test_a_dispatch_that_holds_the_host_counts_to_its_own_step():
    """A device that runs steps of 0.3 s in turn, and a dispatch of step 1 that returns only
    once that step has run (as one whose loops wait on the device does). Read where the host
    reads the metrics, step 0 would take 0.6 s and step 1 none; the clock, which sees each
    step's outputs become ready, gives every step its 0.3 s."""
    step_s, work, times = 0.3, queue.Queue(), {}

    def device():
        while (done := work.get()) is not None:
            time.sleep(step_s)
            done.set()

    runner = threading.Thread(target=device, daemon=True)
    runner.start()
    clock = StepClock(wait=threading.Event.wait)

    def dispatch(i):
        started, done = time.perf_counter(), threading.Event()
        work.put(done)
        if i == 1:
            done.wait()
        clock.dispatched(i, done, started)
        return done

    try:
        run_pipelined(range(4), dispatch, lambda i, out: times.setdefault(i, clock.seconds(i)), waits=lambda i: False)
    finally:
        work.put(None)
        clock.close()
    assert sorted(times) == [0, 1, 2, 3]
    assert all(0.6 * step_s < t < 1.6 * step_s for t in times.values()), times


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
