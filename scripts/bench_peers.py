"""jaxshard against MaxText and PyTorch FSDP2 + TP: the same model, mesh, batch and machine.

    python scripts/bench_peers.py --maxtext-python ENV/bin/python --torch-python ENV2/bin/python

Each peer runs from a Python environment the user names (MaxText with its JAX stack; PyTorch),
never this project's, and neither is installed by the project or its tests. Runs are
interleaved (round after round, each mesh, each system in turn) so that drift of the machine
falls on all of them alike. Each run is a fresh process that trains ``--steps`` steps on the
same Llama config (``--model``'s shapes: layers, width, heads, MLP, vocab) with global batch
``--batch-size`` x ``--seq-len`` on fake CPU devices (8 processes with gloo for PyTorch);
the first ``--warmup`` steps (compilation, allocator warm-up) are not timed.

Prints, per mesh and system: the median over runs of each run's mean step time (the timed
steps' wall time per step), the spread (min - max over runs), tokens/s, and per-device memory as each system can report it
(jaxshard and MaxText: the compiled step's arguments + outputs + temps - aliased bytes, as
MaxText prints them; PyTorch: peak RSS per process, which includes the framework itself);
writes every step time to ``--out`` as JSON. It is a benchmark, not a test.

Step time: jaxshard's is the time between the completions of consecutive steps (its metrics,
read one step late, so the loop never waits on the host); MaxText's is what its own logger
reports per step; PyTorch's is rank 0's wall time for the whole step, loss read back.
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

ROOT = Path(__file__).resolve().parent.parent
# What jaxshard and MaxText report of the compiled step, per device.
XLA_PEAK = "XLA arguments + outputs + temps - aliased"
PEERS = Path(__file__).resolve().parent / "peers"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--maxtext-python", help="python of an environment with MaxText installed")
    p.add_argument("--torch-python", help="python of an environment with PyTorch installed")
    p.add_argument("--meshes", default="fsdp=4,tensor=2 fsdp=8 data=8",
                   help="space-separated meshes over 8 devices")
    p.add_argument("--model", default="llama-tiny", help="a Llama preset: its shapes are given to every system")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--out", default="runs/bench_peers.json")
    return p


def model_flags(preset: str) -> list[str]:
    sys.path.insert(0, str(ROOT))
    from models import get_preset

    cfg = get_preset(preset)
    if cfg.n_kv_heads != cfg.n_heads or cfg.tie_embeddings or cfg.use_bias:
        raise ValueError(f"--model {preset}: the peers' drivers build plain Llamas "
                         "(full multi-head attention, untied head, no biases)")
    return ["--layers", str(cfg.n_layers), "--d-model", str(cfg.d_model), "--heads", str(cfg.n_heads),
            "--mlp", str(cfg.d_mlp), "--vocab", str(cfg.vocab_size)]


def run_jaxshard(args, mesh: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        metrics, report = Path(tmp) / "metrics.jsonl", Path(tmp) / "report.json"
        cmd = [sys.executable, str(ROOT / "experiments" / "train.py"), "--model", args.model,
               "--mesh", mesh, "--cpu-devices", "8", "--platform", "cpu", "--steps", str(args.steps),
               "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
               "--eval-every", "0", "--no-progress", "--metrics", str(metrics), "--report", str(report)]
        _run(cmd, args.timeout)
        steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        rep = json.loads(report.read_text())
    import jax

    xla = rep.get("xla_memory") or {}
    peak = sum(xla.get(k, 0) for k in ("argument", "output", "temp")) - xla.get("alias", 0)
    return {"step_times": [s["step_time_s"] for s in steps if "step_time_s" in s],
            "memory_bytes": peak or None, "memory_kind": XLA_PEAK, "version": f"jax {jax.__version__}"}


def run_driver(python: str, driver: str, args, mesh: str, flags: list[str]) -> dict:
    cmd = [python, str(PEERS / driver), "--mesh", mesh, "--steps", str(args.steps),
           "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), *flags]
    out = _run(cmd, args.timeout)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    summary = next((x for x in lines if x.get("summary")), {})
    if "torch_version" in summary:
        memory, kind = summary.get("peak_rss_bytes_per_process"), "peak RSS per process"
        version = f"torch {summary['torch_version']}"
    else:
        memory, kind = summary.get("peak_bytes_per_device"), XLA_PEAK
        version = f"maxtext {summary.get('maxtext_version')} (jax {summary.get('jax_version')})"
    return {"step_times": [x["step_time_s"] for x in lines if "step_time_s" in x],
            "memory_bytes": memory, "memory_kind": kind, "version": version}


def _run(cmd: list[str], timeout: int) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"{' '.join(cmd[:2])} failed (exit {proc.returncode}):\n{tail}")
    return proc.stdout


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.warmup >= args.steps:
        print("error: --warmup must be below --steps", file=sys.stderr)
        return 2
    try:
        flags = model_flags(args.model)
    except Exception as e:  # an unknown preset (ConfigError) or one the drivers cannot build
        print(f"error: {e}", file=sys.stderr)
        return 2
    systems = {"jaxshard": lambda mesh: run_jaxshard(args, mesh)}
    for name, python, driver in (("maxtext", args.maxtext_python, "maxtext_driver.py"),
                                 ("pytorch", args.torch_python, "torch_driver.py")):
        if python:
            if not Path(python).exists():
                print(f"error: --{name.replace('pytorch', 'torch')}-python {python} does not exist",
                      file=sys.stderr)
                return 2
            systems[name] = lambda mesh, p=python, d=driver: run_driver(p, d, args, mesh, flags)
    meshes = args.meshes.split()
    results: dict[str, dict[str, list]] = {m: {s: [] for s in systems} for m in meshes}
    failed: dict[tuple[str, str], str] = {}
    total = args.rounds * len(meshes) * len(systems)
    done = 0
    for r in range(args.rounds):
        for mesh in meshes:
            for name, run in systems.items():
                done += 1
                if (mesh, name) in failed:
                    continue
                t0 = time.time()
                try:
                    res = run(mesh)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    failed[(mesh, name)] = str(e).splitlines()[-1][:200]
                    print(f"[{done}/{total}] {name} {mesh}: failed: {failed[(mesh, name)]}", file=sys.stderr)
                    continue
                timed = res["step_times"][args.warmup:]
                if not timed:
                    failed[(mesh, name)] = f"reported {len(res['step_times'])} steps"
                    continue
                # The mean: a system that times dispatches rather than completions (MaxText)
                # reports uneven steps whose sum is still the wall time.
                res["mean_s"] = statistics.fmean(timed)
                results[mesh][name].append(res)
                print(f"[{done}/{total}] round {r + 1} {name:<8} {mesh:<16} mean "
                      f"{res['mean_s']:.3f} s/step ({time.time() - t0:.0f} s)", file=sys.stderr)

    tokens = args.batch_size * args.seq_len
    rows = []
    print(f"\n{args.model}, global batch {args.batch_size} x {args.seq_len}, 8 CPU devices, "
          f"{args.rounds} interleaved rounds of {args.steps} steps ({args.warmup} warm-up)\n")
    print(f"{'mesh':<16} {'system':<9} {'s/step':>8} {'spread':>15} {'tokens/s':>9} "
          f"{'vs jaxshard':>11} {'memory/device':>14}  version")
    for mesh in meshes:
        base = _median(results[mesh].get("jaxshard", []))
        for name in systems:
            runs = results[mesh][name]
            if not runs:
                print(f"{mesh:<16} {name:<9} {'failed: ' + failed.get((mesh, name), 'no runs')}")
                continue
            med = _median(runs)
            lo, hi = min(x["mean_s"] for x in runs), max(x["mean_s"] for x in runs)
            mem = runs[-1]["memory_bytes"]
            speed = f"{med / base:.2f}x" if base else "-"
            print(f"{mesh:<16} {name:<9} {med:>8.3f} {f'{lo:.3f}-{hi:.3f}':>15} {tokens / med:>9.0f} "
                  f"{speed:>11} {(f'{mem / 2**20:.1f} MiB' if mem else '-'):>14}  {runs[-1]['version']}")
            rows.append({"mesh": mesh, "system": name, "median_of_means_s": med, "min_s": lo, "max_s": hi,
                         "tokens_per_s": tokens / med, "memory_bytes": mem,
                         "memory_kind": runs[-1]["memory_kind"], "version": runs[-1]["version"],
                         "runs": [x["step_times"] for x in runs]})
    print("\n'vs jaxshard': the system's step time over jaxshard's (above 1: jaxshard is faster).")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": vars(args), "results": rows,
                                          "failed": {f"{m} {s}": e for (m, s), e in failed.items()}},
                                         indent=1))
    print(f"wrote {args.out}")
    return 1 if failed else 0


def _median(runs: list[dict]) -> float | None:
    return statistics.median(x["mean_s"] for x in runs) if runs else None


if __name__ == "__main__":
    sys.exit(main())
