"""Do asynchronous checkpoints stall training? Step times around saves against steps without.

    python scripts/bench_checkpoint.py                       # gpt2-small, about 3 minutes on 2 cores
    python scripts/bench_checkpoint.py --model tiny --steps 30 --out /tmp/ckpt

Trains ``--model`` once without checkpoints and once saving every ``--save-every`` steps
(``experiments/train.py``, one process, ``--devices`` CPU devices), and reads each run's step
times (the metrics file) and goodput (the report). A save blocks the loop while orbax takes the
state off the devices (the step that saves first waits for its own result); the write itself
runs in the background while the next steps train. The table gives, per run: the median step,
the blocking part per save (goodput's checkpoint seconds over the saves), and the median of
the ``--after`` steps that follow each save (those the background write overlaps) against the
median of the other steps. Writes checkpoint.json and checkpoint.md to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="gpt2-small")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--save-every", type=int, default=6)
    p.add_argument("--after", type=int, default=2, help="steps after a save counted as overlapping its write")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--out", default="docs/bench")
    return p


def run(a, scratch: Path, name: str, save: bool) -> dict:
    d = scratch / name
    cmd = [sys.executable, str(ROOT / "experiments" / "train.py"), "--platform", "cpu", "--cpu-devices",
           str(a.devices), "--model", a.model, "--steps", str(a.steps), "--batch-size", str(a.batch_size),
           "--seq-len", str(a.seq_len), "--eval-every", "0", "--eval-batches", "1", "--no-progress",
           "--metrics", str(d / "m.jsonl"), "--report", str(d / "r.json")]
    if save:
        cmd += ["--checkpoint-dir", str(d / "ck"), "--save-every", str(a.save_every), "--keep", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"error: the {name} run failed: {(done.stderr or done.stdout).strip().splitlines()[-1]}")
    records = [json.loads(line) for line in (d / "m.jsonl").read_text().splitlines()]
    times = {r["step"]: r["step_time_s"] for r in records if "step_time_s" in r}
    report = json.loads((d / "r.json").read_text())
    return {"times": times, "goodput": report["goodput"]}


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.save_every < 1 or a.steps < 2 * a.save_every or a.after < 1:
        print("error: --save-every >= 1, --steps >= 2 x --save-every and --after >= 1", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        plain = run(a, Path(scratch), "plain", save=False)
        saving = run(a, Path(scratch), "saving", save=True)
    saves = [s for s in range(a.save_every, a.steps + 1, a.save_every)]
    after = {s + k for s in saves for k in range(1, a.after + 1) if s + k <= a.steps}
    steady = [t for s, t in saving["times"].items() if s > 1 and s not in after and s not in saves]
    overlapped = [saving["times"][s] for s in sorted(after)]
    result = {
        "meta": {"model": a.model, "steps": a.steps, "save_every": a.save_every, "after": a.after,
                 "batch_size": a.batch_size, "seq_len": a.seq_len, "devices": a.devices, "cpu_count": os.cpu_count(),
                 "wall_s": time.perf_counter() - t0},
        "median_step_s_without_saves": statistics.median(t for s, t in plain["times"].items() if s > 1),
        "median_step_s_steady": statistics.median(steady),
        "median_step_s_during_writes": statistics.median(overlapped),
        "blocking_s_per_save": saving["goodput"]["seconds"]["checkpoint"] / len(saves),
        "saves": len(saves),
        "goodput": {"without": plain["goodput"], "saving": saving["goodput"]},
    }
    r = result
    md = "\n".join([
        f"{a.model}, {a.batch_size} x {a.seq_len} tokens a step on {a.devices} CPU device(s) ({os.cpu_count()} cores), "
        f"{a.steps} steps, a save every {a.save_every} (the last one waited for at the end).", "",
        "| median step, no saves | median step, saving run, away from saves | median of the "
        f"{a.after} steps after each save (write in the background) | blocking part per save |",
        "|---|---|---|---|",
        f"| {r['median_step_s_without_saves'] * 1e3:.0f} ms | {r['median_step_s_steady'] * 1e3:.0f} ms | "
        f"{r['median_step_s_during_writes'] * 1e3:.0f} ms | {r['blocking_s_per_save'] * 1e3:.0f} ms |"])
    os.makedirs(a.out, exist_ok=True)
    Path(a.out, "checkpoint.json").write_text(json.dumps(result, indent=1) + "\n")
    Path(a.out, "checkpoint.md").write_text(md + "\n")
    print(md)
    print(f"\nwrote {a.out}/checkpoint.json, checkpoint.md in {result['meta']['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
