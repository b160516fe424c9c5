"""Float8 training against bf16: the same model, init and batches, trained with ``--fp8`` off,
tensorwise, rowwise and delayed, and the loss curves compared.

    python scripts/bench_fp8_train.py                    # llama-tiny, 200 steps: ~16 minutes on 2 CPU cores
    python scripts/bench_fp8_train.py --steps 20 --out /tmp/fp8

Each run is ``experiments/train.py`` on the default corpus (the Python standard library's
source, byte tokens) with matmuls in bfloat16 (``--compute-dtype bfloat16``); the float8 runs
put the blocks' linear layers in float8 on top. Records every step's train loss and the
validation loss every --eval-every steps; prints a table whose last column is each run's final
loss (the mean of the last 10 steps' train losses) against the bf16 run's, and writes
fp8_train.json and fp8_train.png to --out. On CPU, XLA emulates the float8 dots: the numbers are
float8's, the speed is not (see scripts/bench_fp8.py for what a GPU lowers them to).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = ("bf16", "tensorwise", "rowwise", "delayed")
TAIL = 10  # the final loss: the mean of this many last steps' train losses


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="llama-tiny")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)} (bf16 first: the "
                   "others are compared with it)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16, help="global batch in sequences")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--mesh", default="data=1")
    p.add_argument("--cpu-devices", type=int, default=1)
    p.add_argument("--out", default="docs/bench")
    return p


def train(a, run: str, folder: str) -> dict:
    """One run of experiments/train.py: its per-step losses and validation losses."""
    metrics = os.path.join(folder, f"{run}.jsonl")
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "train.py"), "--model", a.model,
           "--compute-dtype", "bfloat16", "--steps", str(a.steps), "--batch-size", str(a.batch_size),
           "--seq-len", str(a.seq_len), "--eval-every", str(a.eval_every), "--mesh", a.mesh,
           "--cpu-devices", str(a.cpu_devices), "--platform", "cpu", "--no-progress", "--metrics", metrics]
    if run != "bf16":
        cmd += ["--fp8", run]
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"error: the {run} run exited with {done.returncode}: "
                         f"{(done.stderr.strip().splitlines() or [''])[-1]}")
    rows = [json.loads(line) for line in open(metrics)]
    return {"loss": [r["loss"] for r in rows],
            "val": {r["step"]: r["val_loss"] for r in rows if "val_loss" in r},
            "step_s": sorted(r["step_time_s"] for r in rows)[len(rows) // 2],
            "wall_s": time.monotonic() - start}


def final(run: dict) -> float:
    tail = run["loss"][-TAIL:]
    return sum(tail) / len(tail)


def table(runs: dict) -> str:
    base = final(runs["bf16"]) if "bf16" in runs else None
    lines = ["| run | final loss (last 10 steps) | last val loss | vs bf16 | median step s (CPU, emulated) |",
             "|---|---|---|---|---|"]
    for name, r in runs.items():
        val = f"{r['val'][max(r['val'])]:.4f}" if r["val"] else "-"
        vs = f"{(final(r) / base - 1) * 100:+.2f}%" if base else "-"
        lines.append(f"| {name} | {final(r):.4f} | {val} | {vs} | {r['step_s']:.2f} |")
    return "\n".join(lines)


def plot(runs: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in runs.items():
        smooth = [sum(r["loss"][max(0, i - 9):i + 1]) / len(r["loss"][max(0, i - 9):i + 1]) for i in range(len(r["loss"]))]
        line, = ax.plot(range(1, len(smooth) + 1), smooth, label=f"{name} (train, 10-step mean)")
        if r["val"]:
            ax.plot(list(r["val"]), list(r["val"].values()), "o--", color=line.get_color(), label=f"{name} (val)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    names = [r for r in a.runs.split(",") if r]
    if not names or any(r not in RUNS for r in names):
        print(f"error: --runs takes a comma-separated list of {', '.join(RUNS)}; got {a.runs!r}", file=sys.stderr)
        return 2
    if a.steps < TAIL:
        print(f"error: --steps must be at least {TAIL} (the final loss is the last {TAIL} steps' mean)", file=sys.stderr)
        return 2
    runs = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in names:
            print(f"training {name}: {a.model}, {a.steps} steps ...", flush=True)
            runs[name] = train(a, name, folder)
    print(table(runs))
    os.makedirs(a.out, exist_ok=True)
    meta = {k: getattr(a, k) for k in ("model", "steps", "batch_size", "seq_len", "mesh", "eval_every")}
    with open(os.path.join(a.out, "fp8_train.json"), "w") as f:
        json.dump({"meta": meta, "runs": runs, "final": {n: final(r) for n, r in runs.items()}}, f, indent=1)
    plot(runs, os.path.join(a.out, "fp8_train.png"))
    print(f"wrote {a.out}/fp8_train.json, fp8_train.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
