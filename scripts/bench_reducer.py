"""Gradient reduction benchmark: GSPMD DDP (the partitioner's all-reduce) against DDP's Reducer
by hand (``--strategy explicit``) for several bucket sizes, and the same for ZeRO-2 (a
reduce-scatter per bucket).

    python scripts/bench_reducer.py                    # ~3 minutes on 2 CPU cores
    python scripts/bench_reducer.py --rounds 1 --steps 3 --out /tmp/reducer

All on ``data=8`` fake CPU devices with the same model and global batch, interleaved (every
configuration once per round, --rounds rounds; the table gives the median of all timed steps
and the rounds' medians). Besides step time: the number of gradient reductions in the compiled
step (non-scalar all-reduces / reduce-scatters, each loop iteration counted) and their sizes.
Writes reducer.json and reducer.md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT
sys.path.insert(1, os.path.join(ROOT, "scripts"))

from jaxshard import runtime  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="llama-tiny")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--buckets", default="0.25,1,4,25", help="bucket sizes in MB, comma-separated")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed steps per configuration per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="runs/bench-reducer")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    from jaxshard.cli import one_line_errors
    from jaxshard.errors import ConfigError

    with one_line_errors():
        if min(a.steps, a.rounds) < 1:
            raise ConfigError("--steps and --rounds must be >= 1")
        try:
            sizes = [float(x) for x in a.buckets.split(",")]
        except ValueError:
            raise ConfigError(f"--buckets expects MB values like 0.25,1,4, got {a.buckets!r}") from None
        runtime.configure(runtime.RuntimeConfig(cpu_devices=8))
        import jax
        from tqdm import tqdm

        from bench import bench_one, rules_for, write_markdown
        from models import TransformerLM, get_preset

        model = TransformerLM(get_preset(a.model))
        runs = []
        for zero in (0, 2):
            runs.append((f"gspmd, zero {zero}", zero, {}))
            runs += [(f"explicit, buckets {mb:g} MB, zero {zero}", zero, {"reducer": "explicit", "bucket_mb": mb}) for mb in sizes]
        rules_for(model, "data=8", 0, False, a.batch_size, a.seq_len)
        os.makedirs(a.out, exist_ok=True)
        rounds: list[list[dict]] = [[] for _ in runs]
        t0 = time.perf_counter()
        with tqdm(total=len(runs) * a.rounds, desc="bench-reducer", unit="run", file=sys.stderr) as bar:
            for _ in range(a.rounds):
                for i, (label, zero, step) in enumerate(runs):
                    bar.set_postfix(run=label)
                    rounds[i].append(bench_one(model, "data=8", zero, False, a.batch_size, a.seq_len,
                                               a.warmup, a.steps, step))
                    bar.update()
        results = []
        for (label, zero, step), rs in zip(runs, rounds):
            medians = [r["step_s"]["median"] for r in rs]
            red = rs[0]["reductions"]
            results.append({"run": label, "zero": zero, **step, "step_s_median": statistics.median(medians),
                            "step_s_rounds": medians, "reductions": len(red), "reduction_bytes": red,
                            "final_loss": rs[-1]["final_loss"]})
        meta = {"backend": jax.default_backend(), "devices": jax.device_count(), "cpu_count": os.cpu_count(),
                "jax": jax.__version__, "model": a.model, "params": model.n_params(),
                "batch_size": a.batch_size, "seq_len": a.seq_len, "timed_steps": a.steps, "rounds": a.rounds,
                "wall_s": time.perf_counter() - t0}
        with open(os.path.join(a.out, "reducer.json"), "w") as f:
            json.dump({"meta": meta, "runs": results}, f, indent=1)
        lines = ["| run | step ms (median; rounds) | gradient reductions | sizes KiB (min / max) | final loss |",
                 "|" + "---|" * 5]
        for r in results:
            b = r["reduction_bytes"]
            rounds_ms = ", ".join(f"{m * 1e3:.0f}" for m in r["step_s_rounds"])
            lines.append(f"| {r['run']} | {r['step_s_median'] * 1e3:.0f}; {rounds_ms} | {r['reductions']} | "
                         f"{min(b) / 1024:,.1f} / {max(b) / 1024:,.1f} | {r['final_loss']:.4f} |")
        write_markdown(a.out, "reducer", meta, f"{a.model} ({meta['params']:,} params), data=8, global "
                       f"batch {a.batch_size} x {a.seq_len}", "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
