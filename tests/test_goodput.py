"""Goodput (jaxshard/training/goodput.py): a run's wall time by part, from its report, adding up
to the wall time; a resumed run's recomputed steps counted apart; the same in TensorBoard."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jaxshard.training.goodput import PARTS, Goodput
from jaxshard.training.observe import read_scalars

ROOT = Path(__file__).resolve().parents[1]
CACHE = os.environ.get("JAXSHARD_TEST_CACHE", str(ROOT / ".cache" / "xla-tests"))


def test_parts_and_fractions():
    now = [10.0]
    g = Goodput(start=10.0, clock=lambda: now[0])
    g.add("compile", 2.0)
    with g.timed("evaluation"):
        now[0] += 1.0
    g.add("steps", 6.0)
    now[0] = 20.0
    s = g.summary()
    assert s["wall_s"] == 10.0 and s["seconds"]["unaccounted"] == pytest.approx(1.0)
    assert s["fractions"]["steps"] == s["goodput"] == 0.6
    assert set(s["seconds"]) == {*PARTS, "unaccounted"}
    with pytest.raises(ValueError, match="unknown goodput part 'naps'"):
        g.add("naps", 1.0)


def train(tmp_path, *flags, env=None):
    cmd = [sys.executable, str(ROOT / "experiments" / "train.py"), "--platform", "cpu", "--model", "tiny",
           "--batch-size", "8", "--seq-len", "32", "--no-progress", "--compile-cache", CACHE,
           "--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "4", "--eval-every", "4",
           "--metrics", str(tmp_path / "m.jsonl"), "--report", str(tmp_path / "r.json"),
           "--tensorboard", str(tmp_path / "tb"), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, **(env or {})})


def step_times(tmp_path, first, last):
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    return sum(r["step_time_s"] for r in records if first <= r["step"] <= last and "step_time_s" in r)


def test_the_reports_goodput_adds_up_and_counts_a_restarts_recomputed_steps(tmp_path):
    # A run whose metrics hold steps 1-6 and whose last complete checkpoint is step 4: one that
    # died while step 6 was being saved (its unfinished save removed, as orbax would never use it).
    first = train(tmp_path, "--steps", "6")
    assert first.returncode == 0, first.stderr[-2000:]
    shutil.rmtree(tmp_path / "ck" / "6")
    resumed = train(tmp_path, "--steps", "12", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    g = report["goodput"]
    s = g["seconds"]
    # Every part measured where it happens; together they cover the wall time (within 2%).
    assert abs(s["unaccounted"]) <= 0.02 * g["wall_s"], g
    assert sum(s.values()) == pytest.approx(g["wall_s"])
    assert s["compile"] == pytest.approx(report["compile_time_s"])
    assert s["evaluation"] > 0 and s["checkpoint"] > 0 and s["startup"] > 0 and s["finish"] > 0
    # Steps 5 and 6 were done before: training them again is lost to the restart. The steps
    # after them are the run's goodput. (Both from the resumed run's own metrics.)
    assert s["recomputed"] == pytest.approx(step_times(tmp_path, 5, 6), rel=1e-9) and s["recomputed"] > 0
    assert s["steps"] == pytest.approx(step_times(tmp_path, 7, 12), rel=1e-9)
    assert g["goodput"] == pytest.approx(s["steps"] / g["wall_s"])
    assert "goodput " in resumed.stdout
    scalars = read_scalars(tmp_path / "tb")
    assert scalars["goodput/steps"] == [(12, pytest.approx(g["fractions"]["steps"], rel=1e-6))]
    assert scalars["goodput/recomputed"][0][1] > 0


def test_a_run_sigterm_stops_writes_goodput_but_no_report(tmp_path):
    """A preemption (SIGTERM as step 6 is dispatched): the save of the last finished step is
    counted as checkpoint time, the goodput line is printed and TensorBoard's goodput/* are
    written at that step; no report, which describes a finished run."""
    stopped = train(tmp_path, "--steps", "12", env={"JAXSHARD_FAULT": "term:6"})
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert not (tmp_path / "r.json").exists()
    line = re.search(r"^goodput \d+% of [\d.]+ s in training steps; .*checkpoint (\d+)%", stopped.stdout, re.M)
    assert line and int(line.group(1)) > 0, stopped.stdout
    scalars = read_scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["goodput/steps"]] == [6] and scalars["goodput/checkpoint"][0][1] > 0
