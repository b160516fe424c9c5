"""On the GPU at hand: jaxshard's step measured against its predictions, and the rates they assume.

    python scripts/bench_gpu.py                       # both parts, tables, runs/bench_gpu.json
    python scripts/bench_gpu.py --parts train --train 1b
    python scripts/bench_gpu.py --budget 420          # start nothing after 420 s

Two parts, each result written to the JSON as soon as it is taken:

* ``rates``: what the time model takes as measured elsewhere (``jaxshard/analysis/devices.py``),
  measured here through XLA: bf16 matmuls at a Llama layer's shapes (TFLOP/s against the
  device's ``matmul_tflops``) and a stream over HBM (the triad a = b + s c, against
  ``hbm_achieved_gbs``). Each the best of three timings of 20 back-to-back runs.
* ``train``: ``experiments/train.py`` on this one GPU for the cases in ``TRAIN``: the step time
  measured (median after the first step) beside the time model's, the MFU both ways, XLA's
  temporaries beside the accounting's, and the allocator's peak beside the device's memory.
Each part and each training run is its own process with a time limit, so one that fails or
hangs costs its case, not the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)

# name: train.py flags. Sequence 8192 as the published H100 runs; shapes that fit one 80 GB GPU.
TRAIN = {
    "1b": "--model llama-1b --seq-len 8192 --batch-size 1 --remat none",
    "8b-4layers-full": "--model llama-8b --n-layers 4 --seq-len 8192 --batch-size 2 --remat full",
    "8b-4layers-selective": "--model llama-8b --n-layers 4 --seq-len 8192 --batch-size 2 --remat selective",
}
# A Llama 3 8B layer's matmuls on 16,384 tokens (2 sequences of 8,192), (M, K, N), and the square.
MATMULS = {"qkv": (16384, 4096, 6144), "out": (16384, 4096, 4096), "gate+up": (16384, 4096, 28672),
           "down": (16384, 14336, 4096), "8192^3": (8192, 8192, 8192)}
STREAM = 2**28  # the triad's arrays: three of 1 GiB in float32


def rates(matmuls: dict, stream: int) -> dict:
    """The matmul rate at each of ``matmuls``' shapes and the HBM triad over three float32
    arrays of ``stream`` elements, on JAX's first device."""
    import jax
    import jax.numpy as jnp

    from jaxshard.analysis import devices

    dev = jax.devices()[0]
    known = devices.detect_device(dev.device_kind)

    def best(fn, *args, reps: int = 20) -> float:
        fn(*args).block_until_ready()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(reps):
                out = fn(*args)
            out.block_until_ready()
            times.append((time.perf_counter() - start) / reps)
        return min(times)

    out = {"device_kind": dev.device_kind, "jax": jax.__version__, "known_as": known and known.name,
           "matmul_tflops_assumed": known and known.matmul_tflops,
           "hbm_gbs_assumed": known and known.hbm_achieved_gbs, "matmuls": {}}
    key = jax.random.key(0)
    mm = jax.jit(lambda a, b: a @ b)
    for name, (m, k, n) in matmuls.items():
        a = jax.random.normal(key, (m, k), jnp.bfloat16)
        b = jax.random.normal(key, (k, n), jnp.bfloat16)
        out["matmuls"][name] = {"shape": [m, k, n], "tflops": 2 * m * k * n / best(mm, a, b) / 1e12}
        del a, b
    n = stream
    b, c = jnp.ones(n, jnp.float32), jnp.full(n, 2.0, jnp.float32)
    triad = jax.jit(lambda b, c: b + 3.0 * c)
    out["hbm_triad_gbs"] = 3 * 4 * n / best(triad, b, c) / 1e9
    return out


def train(name: str, timeout: float, scratch: Path) -> dict:
    report = scratch / f"train-{name}.json"
    cmd = [sys.executable, str(ROOT / "experiments" / "train.py"), *TRAIN[name].split(),
           "--compute-dtype", "bfloat16", "--steps", "6", "--eval-every", "0", "--eval-batches", "1",
           "--log-every", "1", "--report", str(report)]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"case": name, "flags": TRAIN[name], "error": f"no result in {timeout:.0f} s"}
    text = (done.stdout + done.stderr).strip()
    if done.returncode or not report.exists():
        return {"case": name, "flags": TRAIN[name], "error": text.splitlines()[-1] if text else "no output",
                "tail": text[-3000:]}
    r = json.loads(report.read_text())
    model = r["predicted"].get("time_model") or {}
    return {"case": name, "flags": TRAIN[name], "wall_s": time.perf_counter() - start,
            "step_s": r["step_time_s_median"], "step_s_predicted": model.get("step_time_s"),
            "mfu": r["mfu"], "mfu_predicted": model.get("mfu"), "time_parts_predicted": model.get("parts"),
            "tflops_per_device": r["tflops_per_device"], "compile_s": r["compile_time_s"],
            "temp": r["xla_memory"]["temp"], "temp_predicted": r["predicted"].get("temp_bytes"),
            "argument": r["xla_memory"]["argument"], "argument_predicted": r["predicted"]["argument_bytes"],
            "peak_bytes_in_use": r.get("peak_bytes_in_use"), "losses": [r["first_loss"], r["final_loss"]],
            "log": text[-2000:]}


def tables(result: dict) -> str:
    lines = []
    if (r := result.get("rates")) and "error" in r:
        lines += [f"rates: {r['error']}", ""]
    elif r:
        lines += [f"rates on {r['device_kind']} (jax {r['jax']}); the time model assumes "
                  f"{r['matmul_tflops_assumed']} TFLOP/s for large bf16 matmuls, {r['hbm_gbs_assumed']} GB/s HBM",
                  "| matmul | M x K x N | TFLOP/s |", "|---|---|---|"]
        lines += [f"| {k} | {' x '.join(map(str, v['shape']))} | {v['tflops']:.0f} |" for k, v in r["matmuls"].items()]
        lines += [f"HBM triad: {r['hbm_triad_gbs']:.0f} GB/s", ""]
    if rows := result.get("train"):
        lines += ["| case | step s, measured / predicted | predicted / measured | MFU measured / predicted | temp GB, XLA / "
                  "predicted | peak in use GB | compile s |", "|---|---|---|---|---|---|---|"]
        for t in rows:
            if "error" in t:
                lines.append(f"| {t['case']} | {t['error'][:120]} | | | | | |")
                continue
            pred = t["step_s_predicted"] or float("nan")
            lines.append(f"| {t['case']} | {t['step_s']:.3f} / {pred:.3f} | {pred / t['step_s']:.2f} | "
                         f"{t['mfu']:.1%} / {t['mfu_predicted'] or float('nan'):.1%} | {t['temp'] / 1e9:.1f} / "
                         f"{(t['temp_predicted'] or 0) / 1e9:.1f} | {(t['peak_bytes_in_use'] or 0) / 1e9:.1f} | "
                         f"{t['compile_s']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="rates,train", help="rates, train")
    p.add_argument("--train", default=",".join(TRAIN), help=", ".join(TRAIN))
    p.add_argument("--budget", type=float, default=1800, help="seconds; start no case after this")
    p.add_argument("--json", default=str(ROOT / "runs" / "bench_gpu.json"))
    a = p.parse_args(argv)
    parts = a.parts.split(",")
    if bad := [x for x in parts if x not in ("rates", "train")]:
        p.error(f"unknown part(s) {', '.join(bad)}: rates, train")
    if bad := [x for x in a.train.split(",") if x not in TRAIN]:
        p.error(f"unknown training case(s) {', '.join(bad)}: {', '.join(TRAIN)}")
    start = time.perf_counter()
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"train": []}

    def save() -> None:
        out.write_text(json.dumps(result, indent=1) + "\n")

    def left() -> float:
        return a.budget - (time.perf_counter() - start)

    if "rates" in parts:
        print("rates ...", file=sys.stderr, flush=True)
        # In a child process: this one must not hold the GPU while the others run.
        code = ("import json, sys; sys.path[0] = sys.argv[1]; import scripts.bench_gpu as b; "
                "print(json.dumps(b.rates(json.loads(sys.argv[2]), int(sys.argv[3]))))")
        try:
            done = subprocess.run([sys.executable, "-c", code, str(ROOT), json.dumps(MATMULS), str(STREAM)],
                                  capture_output=True, text=True, timeout=max(left(), 1), cwd=ROOT)
            result["rates"] = (json.loads(done.stdout) if done.returncode == 0
                               else {"error": done.stderr.strip()[-2000:]})
        except subprocess.TimeoutExpired:
            result["rates"] = {"error": "no result within --budget"}
        save()
    with tempfile.TemporaryDirectory() as scratch:
        os.environ["JAXSHARD_CACHE"] = scratch  # cold compiles, timed as a user's first run
        for name in a.train.split(",") if "train" in parts else ():
            if left() < 30:
                result["train"].append({"case": name, "error": "not started: out of --budget"})
                continue
            print(f"train {name} ({left():.0f} s left) ...", file=sys.stderr, flush=True)
            result["train"].append(train(name, left(), Path(scratch)))
            save()
    print(tables(result))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
