"""Float8 matmuls (jaxshard.fp8) against bf16 on the device at hand: a linear layer's forward
and forward + backward at transformer shapes, and what XLA lowered each dot to.

    python scripts/bench_fp8.py                      # Llama 3 8B's MLP and attention shapes
    python scripts/bench_fp8.py --shapes 16384x4096x14336 --json runs/bench_fp8.json

Per shape (tokens M, in K, out N): bf16 ``x @ w``; ``fp8_matmul`` tensorwise and rowwise (the
amaxes, the casts and the float8 dot each time, as a training step runs them); and the bare
float8 dot of operands cast beforehand (the GEMM's own rate). Forward + backward is the
gradient of the output's sum with respect to both operands (three matmuls). TFLOP/s count the
matmuls' 2 M K N per product. Each figure is the best of three timings of ``--reps`` runs. On
CPU (XLA:CPU emulates float8) this runs but times nothing a GPU would.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

from bench_gpu import _best  # noqa: E402  (the best of three timings of back-to-back runs)

SHAPES = ("16384x4096x14336", "16384x14336x4096", "16384x4096x6144")  # 8B: MLP in, MLP out, q+k+v


def lowered_dots(fn, *args) -> list[str]:
    """What the compiled program's matmuls became: custom-call targets (cuBLAS, cuBLASLt) and
    plain ``dot`` instructions with their operand and result types."""
    import re

    found, types = set(), {}
    for line in fn.lower(*args).compile().as_text().splitlines():
        if not line.startswith(" "):
            types = {}  # a new computation: its own instruction names
            continue
        if m := re.match(r"\s*(?:ROOT )?%(\S+) = (\w+)\[", line):
            types[m.group(1)] = m.group(2)
        if target := re.search(r'custom_call_target="([^"]*(?:gemm|matmul|cublas)[^"]*)"', line):
            found.add(target.group(1))
        elif (dot := re.search(r" dot\(%(\S+), %(\S+)\)", line)) and m:
            found.add(f"dot({types.get(dot.group(1), '?')} x {types.get(dot.group(2), '?')} -> {m.group(2)})")
    return sorted(found)


def measure(shape: str, reps: int) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxshard import fp8

    M, K, N = map(int, shape.split("x"))
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (M, K), jnp.bfloat16)
    w = (jax.random.normal(kw, (K, N), jnp.float32) / K**0.5).astype(jnp.bfloat16)
    flops = 2 * M * K * N
    runs = {
        "bf16": lambda a, b: a @ b,
        "fp8 tensorwise": lambda a, b: fp8.fp8_matmul(a, b, "tensorwise"),
        "fp8 rowwise": lambda a, b: fp8.fp8_matmul(a, b, "rowwise"),
    }
    out: dict = {"shape_MKN": [M, K, N], "runs": {}}
    for name, f in runs.items():
        fwd = jax.jit(f)
        both = jax.jit(jax.grad(lambda a, b, f=f: f(a, b).astype(jnp.float32).sum(), (0, 1)))
        t1, t3 = _best(fwd, x, w, reps=reps), _best(both, x, w, reps=reps)
        out["runs"][name] = {"fwd_s": t1, "fwd_tflops": flops / t1 / 1e12, "fwd_bwd_s": t3,
                             "fwd_bwd_tflops": 3 * flops / t3 / 1e12, "lowered": lowered_dots(fwd, x, w)}
    sx = fp8.scale_from_amax(fp8.amax(x), fp8.E4M3)
    sw = fp8.scale_from_amax(fp8.amax(w), fp8.E4M3)
    qx, qw = fp8.quantize(x, sx, fp8.E4M3), fp8.quantize(w, sw, fp8.E4M3)
    dot = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                                                   preferred_element_type=jnp.float32))
    t = _best(dot, qx, qw, reps=reps)
    out["runs"]["float8 dot alone"] = {"fwd_s": t, "fwd_tflops": flops / t / 1e12, "lowered": lowered_dots(dot, qx, qw)}
    return out


def table(results: dict) -> str:
    lines = [f"{results['device']} ({results['platform']}), jax {results['jax']}",
             "| M x K x N | run | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | lowered to |",
             "|---|---|---|---|---|---|---|"]
    for r in results["shapes"]:
        for name, v in r["runs"].items():
            both = (f"{v['fwd_bwd_s'] * 1e3:.2f} | {v['fwd_bwd_tflops']:.0f}" if "fwd_bwd_s" in v else " | ")
            lines.append(f"| {' x '.join(map(str, r['shape_MKN']))} | {name} | {v['fwd_s'] * 1e3:.2f} | "
                         f"{v['fwd_tflops']:.0f} | {both} | {', '.join(v['lowered'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="MxKxN,...")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    shapes = a.shapes.split(",")
    bad = [s for s in shapes if len(s.split("x")) != 3 or not all(d.isdigit() and int(d) > 0 for d in s.split("x"))]
    if bad:
        p.error(f"--shapes takes MxKxN with positive integers, e.g. 16384x4096x14336; got {', '.join(bad)}")
    import jax

    dev = jax.devices()[0]
    results = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
               "shapes": [measure(s, a.reps) for s in shapes]}
    print(table(results))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
