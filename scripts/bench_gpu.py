"""On the GPU at hand: jaxshard's step measured against its predictions, and the rates they assume.

    python scripts/bench_gpu.py                       # five parts, tables, runs/bench_gpu.json
    python scripts/bench_gpu.py --parts train --train 1b
    python scripts/bench_gpu.py --parts fp8,moe --fp8-cases 8b-4layers-selective
    python scripts/bench_gpu.py --budget 420          # start nothing after 420 s

The parts, run in the order ``--parts`` names them, each result written to the JSON as soon as
it is taken:

* ``rates``: what the time model takes as measured elsewhere (``jaxshard/analysis/devices.py``),
  measured here through XLA: bf16 matmuls at a Llama layer's shapes (TFLOP/s against the
  device's ``matmul_tflops``) and a stream over HBM (the triad a = b + s c, against
  ``hbm_achieved_gbs``). Each the best of three timings of 20 back-to-back runs.
* ``train``: ``experiments/train.py`` on this one GPU for the cases in ``TRAIN``: the step time
  measured (median after the first step) beside the time model's, the MFU both ways, XLA's
  temporaries beside the accounting's, and the allocator's peak beside the device's memory.
* ``layers``: every matmul of a Llama 3 8B and a Llama 2 7B layer on 16,384 tokens in the three
  passes a training step runs (forward, input gradient, weight gradient), and their
  FLOP-weighted rate.
* ``attention``: cuDNN's flash attention (``jax.nn.dot_product_attention``, causal), forward and
  forward + backward, at the 1B's and the 8B's head widths and at sequences 4,096 to 16,384, in the kernel's
  FLOPs (the causal half square; the backward 2.5 forwards) against ``timing.FLASH_TFLOPS``.
* ``profile``: the cases in ``PROFILE`` run again with two steps traced (``--profile-steps``) and
  the optimized HLO dumped; :mod:`jaxshard.analysis.profile` sums the kernels' time into the
  time model's parts and lists the costliest instructions with the source lines that made them.
* ``fp8``: each of ``--fp8-cases`` under each of ``--fp8-recipes`` (``--fp8``), beside its bf16
  run (run first where ``train`` has not): step time, tokens/s, the speed-up, losses, memory.
* ``fp8-matmuls``: ``scripts/bench_fp8.py``'s matmuls, and what XLA lowered each dot to.
* ``moe``: the cases in ``MOE``, dropless experts by each grouped-matmul kernel
  (``--moe-kernel``) against a capacity of 1.25.
Each part and each training run is its own process with a time limit, so one that fails or
hangs costs its case, not the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
    # MaxText's configs/a3/llama_2_7b per device: sequence 4096, 4 sequences, remat "minimal"
    # (checkpoint_dots_with_no_batch_dims).
    "7b-4layers-dots": "--model llama-7b --n-layers 4 --seq-len 4096 --batch-size 4 --remat dots_no_batch",
    # Held out: shapes and policies none of XLA's measured costs in the time model
    # (timing.XLA_GPU) were taken from.
    "1b-batch2-selective": "--model llama-1b --seq-len 8192 --batch-size 2 --remat selective",
    "8b-4layers-dots": "--model llama-8b --n-layers 4 --seq-len 8192 --batch-size 2 --remat dots_no_batch",
    "7b-4layers-full-2048": "--model llama-7b --n-layers 4 --seq-len 2048 --batch-size 8 --remat full",
}
PROFILE = ("1b", "8b-4layers-selective")
# Float8 (``--fp8``) against bf16: each case of FP8_CASES again under each recipe.
FP8_CASES = ("1b", "8b-4layers-selective")
FP8_RECIPES = ("tensorwise", "rowwise", "delayed")
# Dropless experts (grouped matmuls) by each kernel (``--moe-kernel``; ragged is auto's on GPUs)
# against a capacity of 1.25 on one GPU: DeepSeekMoE 16B's layer shapes (64 experts, 6 routed and
# 2 shared a token), 4 layers.
MOE_BASE = "--model deepseek-moe-16b --n-layers 4 --seq-len 4096 --batch-size 2 --remat none"
MOE = {f"moe16b-4layers-{name}": f"{MOE_BASE} {flags}" for name, flags in (
    ("dropless", "--moe-capacity-factor 0"), ("dropless-tiled", "--moe-capacity-factor 0 --moe-kernel tiled"),
    ("dropless-triton", "--moe-capacity-factor 0 --moe-kernel triton"), ("capacity1.25", "--moe-capacity-factor 1.25"))}
# The training cases' token ids: "zipf" draws them over the model's whole vocabulary at Zipf's
# law frequencies (the r-th commonest id at 1/r), as text has, so the embedding gradient's
# scatter-add collides about as often as a real run's; "corpus" is train.py's embedded text as
# bytes, 256 ids, whose adds collide far more.
DATA = ("zipf", "corpus")
ZIPF_TOKENS = 1 << 22
# (batch, sequence, query heads, kv heads, head width): the 1B's and the 8B's attention.
ATTENTION = {"1b (head 64)": (1, 8192, 32, 8, 64), "8b (head 128)": (2, 8192, 32, 8, 128),
             "8b at 4096": (4, 4096, 32, 8, 128), "8b at 16384": (1, 16384, 32, 8, 128),
             "7b (MHA) at 4096": (4, 4096, 32, 32, 128)}
# A layer's matmuls (K, N) on 16,384 tokens, each in the three passes a training step runs:
# forward x w, the input gradient g w^T, the weight gradient x^T g.
LAYER_MATMULS = {
    "8b": {"qkv": (4096, 6144), "out": (4096, 4096), "gate+up": (4096, 28672), "down": (14336, 4096)},
    "7b": {"qkv": (4096, 12288), "out": (4096, 4096), "gate+up": (4096, 22016), "down": (11008, 4096)},
}
TOKENS = 16384
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


# nvidia-smi's clocks_event_reasons bits that slow the clocks (idle and application clocks are not).
SLOWDOWNS = {0x4: "software power cap", 0x8: "hardware slowdown", 0x20: "software thermal slowdown",
             0x40: "hardware thermal slowdown", 0x80: "hardware power brake"}


class Clocks:
    """The GPU's SM clock, temperature and power sampled by ``nvidia-smi`` every 250 ms while a
    part runs; :meth:`stop` sums them up with any slowdown the driver reported. A result taken
    under thermal slowdown measures the machine's cooling, not the kernels: one H100 here ran at
    555-960 MHz and 83-93 C, and its matmuls at a quarter of their rate."""

    def __init__(self):
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,temperature.gpu,power.draw,clocks_event_reasons.active",
                 "--format=csv,noheader,nounits", "-lms", "250"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True)
        except OSError as e:
            self.proc, self.error = None, f"nvidia-smi: {e}"

    def stop(self) -> dict:
        if self.proc is None:
            return {"error": self.error}
        self.proc.terminate()
        text = self.proc.communicate()[0]
        rows = []
        for line in text.splitlines():
            try:
                clock, temp, power, reasons = (x.strip() for x in line.split(","))
                rows.append((float(clock), float(temp), float(power), int(reasons, 16)))
            except ValueError:
                continue
        if not rows:
            return {"error": "no nvidia-smi samples"}
        clocks = sorted(r[0] for r in rows)
        seen = 0
        for r in rows:
            seen |= r[3]
        return {"samples": len(rows), "sm_mhz_min": clocks[0], "sm_mhz_median": clocks[len(clocks) // 2],
                "temperature_c_max": max(r[1] for r in rows), "power_w_max": max(r[2] for r in rows),
                "slowdowns": [name for bit, name in SLOWDOWNS.items() if seen & bit]}


def _best(fn, *args, reps: int = 20) -> float:
    """The best of three timings of ``reps`` back-to-back runs of ``fn(*args)``, in seconds."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / reps)
    return min(times)


def layer_matmuls(models: dict, tokens: int) -> dict:
    """Each layer matmul of ``models`` on ``tokens`` tokens in bf16, forward, input gradient and
    weight gradient: TFLOP/s each, and the FLOP-weighted rate of all three passes of every
    matmul (what a training step's layers run at)."""
    import jax
    import jax.numpy as jnp

    key = jax.random.key(0)
    passes = {
        "forward": (jax.jit(lambda x, w: x @ w), lambda t, k, n: ((t, k), (k, n))),
        "input grad": (jax.jit(lambda g, w: g @ w.T), lambda t, k, n: ((t, n), (k, n))),
        "weight grad": (jax.jit(lambda x, g: x.T @ g), lambda t, k, n: ((t, k), (t, n))),
    }
    out = {}
    for model, shapes in models.items():
        rows, flops, seconds = {}, 0.0, 0.0
        for name, (k, n) in shapes.items():
            for p, (fn, operands) in passes.items():
                a_shape, b_shape = operands(tokens, k, n)
                a = jax.random.normal(key, a_shape, jnp.bfloat16)
                b = jax.random.normal(key, b_shape, jnp.bfloat16)
                s = _best(fn, a, b)
                f = 2 * tokens * k * n
                rows[f"{name} {p}"] = {"shape_TKN": [tokens, k, n], "tflops": f / s / 1e12}
                flops, seconds = flops + f, seconds + s
                del a, b
        out[model] = {"matmuls": rows, "tflops_all": flops / seconds / 1e12}
    return out


def attention(shapes: dict, reps: int = 10) -> dict:
    """cuDNN's causal flash attention at each of ``shapes`` (B, L, N, K, H): forward and forward +
    backward seconds (the best of three timings of ``reps`` runs) and TFLOP/s in the kernel's
    FLOPs (forward 2 B L^2 N H, the causal half of 4 B L^2 N H; backward 2.5 forwards)."""
    import jax
    import jax.numpy as jnp

    from jaxshard.analysis import devices, timing

    known = devices.detect_device(jax.devices()[0].device_kind)
    out = {"shapes": {}}
    for name, (B, L, N, K, H) in shapes.items():
        keys = jax.random.split(jax.random.key(0), 4)
        q = jax.random.normal(keys[0], (B, L, N, H), jnp.bfloat16)
        k, v = (jax.random.normal(key, (B, L, K, H), jnp.bfloat16) for key in keys[1:3])
        g = jax.random.normal(keys[3], (B, L, N, H), jnp.bfloat16)

        def fwd(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

        def fwd_bwd(q, k, v, g):
            out, pull = jax.vjp(fwd, q, k, v)
            return out, pull(g)

        flops = 2 * B * L * L * N * H  # the causal half of q k^T and p v
        f, fb = _best(jax.jit(fwd), q, k, v, reps=reps), _best(jax.jit(fwd_bwd), q, k, v, g, reps=reps)
        assumed = known and timing.flash_tflops("cudnn", known.name, H, L)
        out["shapes"][name] = {"shape_BLNKH": [B, L, N, K, H], "fwd_s": f, "fwd_bwd_s": fb, "assumed_fwd_bwd_tflops": assumed,
                               "fwd_tflops": flops / f / 1e12, "fwd_bwd_tflops": 3.5 * flops / fb / 1e12}
    return out


def zipf_tokens(path: Path, vocab: int, count: int = ZIPF_TOKENS, seed: int = 0) -> Path:
    """A token file of ``count`` ids over ``vocab`` at Zipf's law frequencies, the ranks shuffled
    over the ids (written once)."""
    import numpy as np

    from jaxshard.data.token_file import TokenWriter

    if not path.exists():
        rng = np.random.default_rng(seed)
        p = 1.0 / np.arange(1, vocab + 1)
        ranks = rng.choice(vocab, size=count, p=p / p.sum())
        with TokenWriter(path, vocab) as w:
            w.write(rng.permutation(vocab)[ranks])
    return path


def data_flags(name: str, data: str, scratch: Path) -> list[str]:
    if data == "corpus":
        return []
    from models import get_preset

    flags = case_flags(name).split()
    vocab = get_preset(flags[flags.index("--model") + 1]).vocab_size
    return ["--data", str(zipf_tokens(scratch / f"zipf-{vocab}.tokens", vocab))]


def case_shape(flags: str):
    """A training case's model config, batch, sequence length and recompute policy."""
    import dataclasses

    from jaxshard.remat import Remat
    from models import get_preset

    f = flags.split()
    cfg = get_preset(f[f.index("--model") + 1])
    if "--n-layers" in f:
        cfg = dataclasses.replace(cfg, n_layers=int(f[f.index("--n-layers") + 1]))
    return cfg, int(f[f.index("--batch-size") + 1]), int(f[f.index("--seq-len") + 1]), Remat.parse(f[f.index("--remat") + 1])


def predicted(flags: str, device: str = "h100"):
    """The time model's step (``timing.StepTime``) for a training case's flags on one ``device``,
    as train.py's report prices it (bf16 compute, float32 params)."""
    from jaxshard.analysis import timing
    from jaxshard.analysis.devices import KNOWN_DEVICES
    from jaxshard.mesh import abstract_mesh
    from jaxshard.rules import ShardingRules, Strategy
    from models import TransformerLM

    cfg, batch, seq, remat = case_shape(flags)
    return timing.step_time(TransformerLM(cfg, remat=remat), ShardingRules(abstract_mesh({"data": 1}), Strategy()),
                            KNOWN_DEVICES[device], batch, seq, software=timing.SOFTWARE["jaxshard"],
                            compute_dtype="bfloat16", param_dtype="float32", remat=remat)


def case_flags(name: str) -> str:
    """A training case's train.py flags: ``TRAIN``'s or ``MOE``'s."""
    return {**TRAIN, **MOE}[name]


def train(name: str, timeout: float, scratch: Path, profile: bool = False, data: str = "zipf",
          extra: tuple[str, ...] = ()) -> dict:
    """``experiments/train.py`` on case ``name`` (with ``extra`` flags: ``--fp8 rowwise``); with
    ``profile`` its steps 4 and 5 traced and the optimized HLO dumped, summed by
    :func:`jaxshard.analysis.profile.profile`."""
    flags = " ".join([case_flags(name), *extra])
    report = scratch / f"train-{name}{'-'.join(('',) + extra)}{'-profile' if profile else ''}.json"
    steps = 6
    cmd = [sys.executable, str(ROOT / "experiments" / "train.py"), *flags.split(), *data_flags(name, data, scratch),
           "--compute-dtype", "bfloat16", "--steps", str(steps), "--eval-every", "0", "--eval-batches", "1",
           "--log-every", "1", "--report", str(report)]
    env = dict(os.environ)
    trace, dump = scratch / f"trace-{name}", scratch / f"hlo-{name}"
    if profile:
        cmd += ["--profile-steps", "4:5", "--profile-dir", str(trace)]
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
                            " --xla_dump_hlo_module_re=jit_step").strip()
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        return {"case": name, "flags": flags, "error": f"no result in {timeout:.0f} s"}
    text = (done.stdout + done.stderr).strip()
    if done.returncode or not report.exists():
        return {"case": name, "flags": flags, "error": text.splitlines()[-1] if text else "no output",
                "tail": text[-3000:]}
    r = json.loads(report.read_text())
    model = r["predicted"].get("time_model") or {}
    if profile:
        from jaxshard.analysis import hlo
        from jaxshard.analysis import profile as prof

        try:
            found = prof.profile(str(trace), str(dump), steps=2)
            # The layer scans' copies in the optimized module (the time model's scan_copy_bytes).
            modules = sorted(dump.glob("*jit_step*after_optimizations.txt"))
            found["scan_copies"] = hlo.scan_copies(modules[-1].read_text()) if modules else None
        except Exception as e:  # noqa: BLE001 -- a trace that cannot be read costs its case only
            found = {"error": f"{type(e).__name__}: {e}"}
        return {"case": name, "flags": flags, "step_s": r["step_time_s_median"],
                "step_s_predicted": model.get("step_time_s"), "time_parts_predicted": model.get("parts"),
                "profile": found}
    return {"case": name, "flags": flags, "wall_s": time.perf_counter() - start,
            "step_s": r["step_time_s_median"], "step_s_predicted": model.get("step_time_s"),
            "mfu": r["mfu"], "mfu_predicted": model.get("mfu"), "time_parts_predicted": model.get("parts"),
            "tflops_per_device": r["tflops_per_device"], "compile_s": r["compile_time_s"],
            "temp": r["xla_memory"]["temp"], "temp_predicted": r["predicted"].get("temp_bytes"),
            "argument": r["xla_memory"]["argument"], "argument_predicted": r["predicted"]["argument_bytes"],
            "peak_bytes_in_use": r.get("peak_bytes_in_use"), "losses": [r["first_loss"], r["final_loss"]],
            "log": text[-2000:]}


def fp8_matmuls(shapes: list[str] | None = None, reps: int = 10) -> dict:
    """``scripts/bench_fp8.py``'s matmuls: bf16 and float8 at each of ``shapes`` (MxKxN; its
    Llama 3 8B shapes by default)."""
    import jax

    from scripts import bench_fp8

    dev = jax.devices()[0]
    return {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
            "shapes": [bench_fp8.measure(shape, reps) for shape in shapes or bench_fp8.SHAPES]}


def _run_row(case: str, name: str, r: dict | None, base: dict | None) -> str:
    """One training run's row: step time, tokens/s, speed against ``base``'s, losses, memory."""
    if r is None or "error" in r:
        return f"| {case} | {name} | {'not run' if r is None else r['error'][:120]} | | | | | |"
    _, batch, seq, _ = case_shape(case_flags(case))
    against = f"{base['step_s'] / r['step_s']:.2f}x" if base and "error" not in base else ""
    return (f"| {case} | {name} | {r['step_s']:.3f} | {batch * seq / r['step_s']:,.0f} | {against} | "
            f"{r['losses'][0]:.3f} -> {r['losses'][1]:.3f} | {(r['peak_bytes_in_use'] or 0) / 1e9:.1f} | "
            f"{r['compile_s']:.0f} |")


RUN_HEADER = ["| case | run | step s | tokens/s | speed | loss, step 1 -> 6 | peak in use GB | compile s |",
              "|---|---|---|---|---|---|---|---|"]


def fp8_table(result: dict) -> list[str]:
    """Each float8 run beside the bf16 run of its case (``speed``: bf16's step time over its)."""
    base = {t["case"]: t for t in result.get("train", [])}
    cases = list(dict.fromkeys(t["case"] for t in result.get("fp8", [])))
    lines = ["float8 against bf16 (one GPU, 6 steps, the median step after the first)", *RUN_HEADER]
    for case in cases:
        lines.append(_run_row(case, "bf16", base.get(case), base.get(case)))
        lines += [_run_row(case, f"fp8 {t['recipe']}", t, base.get(case)) for t in result["fp8"] if t["case"] == case]
    return lines + [""]


def moe_table(result: dict) -> list[str]:
    """The MoE cases (``speed``: the capacity run's step time over each)."""
    rows = {t["case"]: t for t in result.get("moe", [])}
    base = next((t for name, t in rows.items() if "capacity" in name), None)
    lines = ["dropless experts by kernel (--moe-kernel) against capacity 1.25, one GPU", *RUN_HEADER]
    return lines + [_run_row(name, name.removeprefix("moe16b-4layers-"), t, base) for name, t in rows.items()] + [""]


def slowed(result: dict) -> list[str]:
    """One line for each part or case whose clocks the driver slowed while it ran."""
    out = []
    for name, part in [(k, v) for k, v in result.items() if isinstance(v, dict)] + [
            (f"{k} {t.get('case')} {t.get('recipe', '')}".strip(), t) for k in ("train", "profile", "fp8", "moe")
            for t in result.get(k, [])]:
        c = part.get("clocks") or {}
        # (The power cap is how a 700 W part runs dense matmuls at length: a training run meets it too.)
        if bad := [x for x in c.get("slowdowns", []) if x != "software power cap"]:
            out.append(f"WARNING {name}: {', '.join(bad)} (SM clock down to {c['sm_mhz_min']:.0f} MHz, "
                       f"{c['temperature_c_max']:.0f} C): its timings measure the machine's cooling, not the code")
    return out


def tables(result: dict) -> str:
    lines = slowed(result)
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
                         f"{t['mfu'] or float('nan'):.1%} / {t['mfu_predicted'] or float('nan'):.1%} | {t['temp'] / 1e9:.1f} / "
                         f"{(t['temp_predicted'] or 0) / 1e9:.1f} | {(t['peak_bytes_in_use'] or 0) / 1e9:.1f} | "
                         f"{t['compile_s']:.0f} |")
        lines.append("")
    if (m := result.get("layers")) and "error" not in m:
        m = {k: v for k, v in m.items() if k != "clocks"}
        lines += ["| layer matmul (16,384 tokens) | " + " | ".join(m) + " |", "|---|" + "---|" * len(m)]
        names = list(next(iter(m.values()))["matmuls"])
        lines += [f"| {n} | " + " | ".join(f"{v['matmuls'][n]['tflops']:.0f}" for v in m.values()) + " |" for n in names]
        lines += ["| all, FLOP-weighted | " + " | ".join(f"{v['tflops_all']:.0f}" for v in m.values()) + " |", ""]
    elif m:
        lines += [f"layers: {m['error'][-300:]}", ""]
    if (a := result.get("attention")) and "error" not in a:
        lines += ["cuDNN causal attention (TFLOP/s in the kernel's FLOPs; assumed: the time model's rate)",
                  "| shape | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | assumed |", "|---|---|---|---|---|---|"]
        lines += [f"| {k} | {v['fwd_s'] * 1e3:.2f} | {v['fwd_tflops']:.0f} | {v['fwd_bwd_s'] * 1e3:.2f} | "
                  f"{v['fwd_bwd_tflops']:.0f} | {v.get('assumed_fwd_bwd_tflops') or float('nan'):.0f} |"
                  for k, v in a["shapes"].items()]
        lines.append("")
    elif a:
        lines += [f"attention: {a['error'][-300:]}", ""]
    if result.get("fp8"):
        lines += fp8_table(result)
    if (m := result.get("fp8-matmuls")) and "error" not in m:
        from scripts import bench_fp8

        lines += ["float8 matmuls (scripts/bench_fp8.py)", bench_fp8.table(m), ""]
    elif m:
        lines += [f"fp8-matmuls: {m['error'][-300:]}", ""]
    if result.get("moe"):
        lines += moe_table(result)
    for p in result.get("profile", []):
        f = p.get("profile") or {}
        if "error" in p or "error" in f:
            lines += [f"profile {p['case']}: {p.get('error') or f.get('error')}", ""]
            continue
        pred = p["time_parts_predicted"] or {}
        lines += [f"profile {p['case']}: step {p['step_s'] * 1e3:.1f} ms measured, kernels {f['kernel_s'] * 1e3:.1f} ms, "
                  f"GPU busy {f['busy_s'] * 1e3:.1f} ms of a {f['span_s'] * 1e3:.1f} ms span, {f['kernels']} kernels",
                  "| part | traced ms | predicted ms |", "|---|---|---|"]
        model = {"matmul": "matmul_s", "attention": "attention_s", "optimizer": "optimizer_s"}
        for part, sec in f["parts_s"].items():
            guess = pred.get(model.get(part, ""), None)
            lines.append(f"| {part} | {sec * 1e3:.1f} | {'' if guess is None else f'{guess * 1e3:.1f}'} |")
        lines.append(f"| (memory-bound, predicted) | | {pred.get('memory_bound_s', 0) * 1e3:.1f} |")
        if copies := f.get("scan_copies"):
            lines.append(f"(the layer scans' copies in the optimized HLO: {copies['moved_bytes'] / 1e9:.1f} GB read "
                         f"and written a step)")
        lines += ["", "| ms | part | instruction | kernel | source |", "|---|---|---|---|---|"]
        lines += [f"| {t['ms']:.2f} | {t['part']} | {t['hlo_op']} x{t['launches']} | {t['kernels'][0][:50]} | "
                  f"{t['source']} |" for t in f["top"][:25]]
        lines.append("")
    return "\n".join(lines)


PARTS = ("rates", "layers", "attention", "train", "profile", "fp8", "fp8-matmuls", "moe")
# The parts each run in a child process of their own: function, arguments.
CHILD = {"rates": ("rates", (MATMULS, STREAM)), "layers": ("layer_matmuls", (LAYER_MATMULS, TOKENS)),
         "attention": ("attention", (ATTENTION,)), "fp8-matmuls": ("fp8_matmuls", ())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="rates,layers,attention,train,profile",
                   help=f"run in this order, of: {', '.join(PARTS)}")
    p.add_argument("--profile", default=",".join(PROFILE), help=f"training cases to trace ({', '.join(TRAIN)})")
    p.add_argument("--train", default=",".join(TRAIN), help=", ".join(TRAIN))
    p.add_argument("--fp8-cases", default=",".join(FP8_CASES), help="training cases run again under each --fp8-recipes")
    p.add_argument("--fp8-recipes", default=",".join(FP8_RECIPES), help=", ".join(FP8_RECIPES))
    p.add_argument("--budget", type=float, default=1800, help="seconds; start no case after this")
    p.add_argument("--json", default=str(ROOT / "runs" / "bench_gpu.json"))
    p.add_argument("--keep", metavar="DIR", help="copy the profiles' traces and optimized HLO here")
    p.add_argument("--data", default=DATA[0], choices=DATA, help="the training cases' token ids (see DATA)")
    a = p.parse_args(argv)
    parts = a.parts.split(",")
    if bad := [x for x in parts if x not in PARTS]:
        p.error(f"unknown part(s) {', '.join(bad)}: {', '.join(PARTS)}")
    named = [x for part, names in (("train", a.train), ("profile", a.profile), ("fp8", a.fp8_cases)) if part in parts
             for x in names.split(",")]
    if bad := [x for x in named if x not in TRAIN]:
        p.error(f"unknown training case(s) {', '.join(bad)}: {', '.join(TRAIN)}")
    if bad := [x for x in a.fp8_recipes.split(",") if x not in FP8_RECIPES]:
        p.error(f"unknown float8 recipe(s) {', '.join(bad)}: {', '.join(FP8_RECIPES)}")
    start = time.perf_counter()
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"data": a.data, "train": [], "profile": [], "fp8": [], "moe": []}

    def save() -> None:
        out.write_text(json.dumps(result, indent=1) + "\n")

    def left() -> float:
        return a.budget - (time.perf_counter() - start)

    # (kind, case, extra flags) for the training runs, in the parts' order; the child parts as
    # (part, None, ()).
    runs: list[tuple[str, str | None, tuple[str, ...]]] = []
    for part in parts:
        if part in CHILD:
            runs.append((part, None, ()))
        elif part in ("train", "profile"):
            runs += [(part, n, ()) for n in getattr(a, part).split(",")]
        elif part == "fp8":
            cases = a.fp8_cases.split(",")
            trained = [n for kind, n, _ in runs if kind == "train"] + (a.train.split(",") if "train" in parts else [])
            runs += [("train", n, ()) for n in cases if n not in trained]  # the bf16 run to compare with
            runs += [("fp8", n, ("--fp8", r)) for n in cases for r in a.fp8_recipes.split(",")]
        elif part == "moe":
            runs += [("moe", n, ()) for n in MOE]
    with tempfile.TemporaryDirectory() as scratch:
        os.environ["JAXSHARD_CACHE"] = scratch  # cold compiles, timed as a user's first run
        for kind, name, extra in runs:
            if left() < 30:
                skipped = {"error": "not started: out of --budget"}
                if name is None:
                    result[kind] = skipped
                else:
                    result[kind].append({"case": name, **skipped, **({"recipe": extra[1]} if extra else {})})
                continue
            print(f"{kind} {name or ''} {' '.join(extra)} ({left():.0f} s left) ...", file=sys.stderr, flush=True)
            clocks = Clocks()
            if kind in CHILD:
                fn, args = CHILD[kind]
                # In a child process: this one must not hold the GPU while the others run.
                code = ("import json, sys; sys.path[0] = sys.argv[1]; import scripts.bench_gpu as b; "
                        f"print(json.dumps(b.{fn}(*json.loads(sys.argv[2]))))")
                try:
                    done = subprocess.run([sys.executable, "-c", code, str(ROOT), json.dumps(args)],
                                          capture_output=True, text=True, timeout=max(left(), 1), cwd=ROOT)
                    result[kind] = (json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0
                                    else {"error": done.stderr.strip()[-2000:]})
                except subprocess.TimeoutExpired:
                    result[kind] = {"error": "no result within --budget"}
                result[kind]["clocks"] = clocks.stop()
            else:
                row = train(name, left(), Path(scratch), profile=kind == "profile", data=a.data, extra=extra)
                result[kind].append({**row, **({"recipe": extra[1]} if extra else {}), "clocks": clocks.stop()})
            save()
            if kind == "profile" and a.keep:
                keep = Path(a.keep) / name
                shutil.copytree(Path(scratch) / f"trace-{name}", keep, dirs_exist_ok=True)
                for f in (Path(scratch) / f"hlo-{name}").glob("*jit_step*after_optimizations.txt"):
                    shutil.copy(f, keep)
    print(tables(result))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
