"""Pipeline benchmark: the bubble of each schedule against theory, step times, stage balancing.

    python scripts/bench_pipeline.py                    # ~10 minutes on 2 CPU cores
    python scripts/bench_pipeline.py --out /tmp/pp --steps 3

Three parts, each in its own process (device count and threading are fixed at JAX start):

* **bubble** -- ``stage=2`` on 2 fake CPU devices, each single-threaded, so each stage has a core
  of its own and a waiting stage really idles. For naive, GPipe, 1F1B, interleaved (V = 2) and
  ZB-H1 at M in {P, 2P, 4P} with a fixed microbatch: the step time T, and each stage's own
  work W_s, timed as the same executor running a table in which only stage s works, every tick
  (its M V forward and backward slots back to back, no waiting; ZB-H1's B and W in the tick
  of their F), less the same table with every slot idle (the optimizer and the per-tick sends,
  which T pays too). Measured bubble = idle device time / all device time
  = 1 - sum_s W_s / (P (T - T_idle)); theory (P-1)/(M+P-1), interleaved (P-1)/(VM+P-1), ZB-H1
  (P-1)/(3M+P-1). The two devices are not independent: all stages working at once (the same
  table with every stage busy every tick, A) take longer than the slowest stage alone (the
  "slowdown" column), so the bubble is also given against A, 1 - A / (T - T_idle): the first
  counts the slowdown as idle time, the second credits a stage with the speed it gains while
  the other idles.
* **steps** -- naive vs GPipe vs 1F1B vs interleaved vs ZB-H1 on ``stage=4,data=2`` over 8 fake
  devices (which share the 2 cores: the bubble is hidden there, the executor's overheads are not),
  each with its compiled matmul FLOPs over the useful ones (a tick op's counted as often as the
  tables run it on each stage; x1.00 unexplained: the schedule computes nothing it need not).
* **balance** -- a model whose last stage is heavy (a 16k vocabulary's head): the even split
  against ``--balance profile``'s, step time on the ``bubble`` part's 2 single-threaded devices.

Writes pipeline.json, pipeline.md and bubble.png to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT

SINGLE_THREAD = "--xla_cpu_multi_thread_eigen=false"
BUBBLE_RUNS = [("naive", 1), ("gpipe", 2), ("gpipe", 4), ("gpipe", 8), ("1f1b", 2), ("1f1b", 4), ("1f1b", 8),
               ("interleaved", 2), ("interleaved", 4), ("interleaved", 8), ("zb-h1", 2), ("zb-h1", 4), ("zb-h1", 8)]
STEP_RUNS = [("naive", 1), ("gpipe", 8), ("1f1b", 8), ("interleaved", 8), ("zb-h1", 8)]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/bench-pipeline")
    p.add_argument("--rows", type=int, default=8,
                   help="sequences per microbatch (the steps part splits them over data=2)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=5, help="timed steps per configuration (median)")
    p.add_argument("--remat", default="dots", help="the model's --remat policy (what a stage keeps per "
                   "microbatch); dots is train.py's default on CPU")
    p.add_argument("--part", choices=("bubble", "steps", "balance"), default=None,
                   help="run one part in this process (the default runs all three, each in its own)")
    return p


def program_for(model, mesh: str, cfg, schedule=None):
    import jax

    from jaxshard.mesh import MeshSpec, build_mesh
    from jaxshard.rules import ShardingRules, Strategy
    from jaxshard.training.optim import OptimConfig
    from jaxshard.training.step import build_program

    n = 1
    for _, s in MeshSpec.parse(mesh).axes:
        n *= s
    rules = ShardingRules(build_mesh(mesh, jax.devices()[:n]), Strategy())
    return build_program(model, rules, OptimConfig(), cfg, schedule=schedule), rules


def stage_bubble(model, mesh: str, cfg, batch: int, a):
    """The schedule ``cfg`` asks for on ``mesh``, and its bubble measured (jaxshard.analysis.bubble)."""
    from jaxshard.analysis import bubble

    schedule = program_for(model, mesh, cfg)[0].schedule
    return schedule, bubble.measure(lambda table: program_for(model, mesh, cfg, table)[0], schedule, batch,
                                    a.seq_len, model.cfg.vocab_size, a.steps)


def part_bubble(a) -> list[dict]:
    from jaxshard.training.step import StepConfig
    from models import TransformerLM, get_preset

    model = TransformerLM(get_preset("llama-tiny"), remat=a.remat)  # 4 layers: 2 per stage, or 1 per chunk
    out = []
    for kind, m in BUBBLE_RUNS:
        cfg = StepConfig(pipeline_schedule=kind, microbatches=m)
        schedule, b = stage_bubble(model, "stage=2", cfg, m * a.rows, a)
        out.append({"schedule": kind, "stages": schedule.stages, "virtual": schedule.virtual,
                    "microbatches": m, "ticks": schedule.ticks, **b.as_dict()})
        print(f"{kind:>11} M={m}: {b.line()}", flush=True)
    return out


def part_steps(a) -> list[dict]:
    from jaxshard.analysis import accounting
    from jaxshard.analysis.bubble import step_seconds
    from jaxshard.training.step import StepConfig
    from models import TransformerLM, get_preset

    model = TransformerLM(get_preset("llama-tiny").replace(n_layers=8), remat=a.remat)
    batch = 8 * a.rows  # 8 microbatches of rows / 2 per device over data=2
    out = []
    for kind, m in STEP_RUNS:
        program, rules = program_for(model, "stage=4,data=2", StepConfig(pipeline_schedule=kind, microbatches=m))
        step = step_seconds(program, batch, a.seq_len, model.cfg.vocab_size, a.steps)
        # The compiled step's matmuls against the useful ones and the policy's recompute, each
        # tick op's counted as often as the tables run it on each stage (accounting.matmul_waste).
        waste = accounting.matmul_waste(
            accounting.flops(model.cfg, rules, batch, a.seq_len, remat=model.remat),
            program.lower_step(batch, a.seq_len).compile().as_text(), model.cfg, rules, batch, a.seq_len,
            schedule=program.schedule)
        out.append({"schedule": kind, "mesh": "stage=4,data=2", "microbatches": m, "batch_size": batch,
                    "virtual": program.schedule.virtual, "ticks": program.schedule.ticks,
                    "kept_microbatches": program.schedule.slots, "step_s": step,
                    "bubble_theory": program.schedule.bubble(), "matmul_flops_per_device": waste})
        print(f"{kind:>11} M={m}: step {step * 1e3:7.1f} ms ({program.schedule.ticks} ticks), matmul FLOPs / useful "
              f"{accounting.waste_cell(waste)}", flush=True)
    return out


def part_balance(a) -> dict:
    from jaxshard.training.step import StepConfig, balance_stages
    from models import TransformerLM, get_preset

    model = TransformerLM(get_preset("llama-tiny").replace(n_layers=8, vocab_size=16384, name="llama-8L-16k"),
                          remat=a.remat)
    m, batch = 4, 4 * a.rows
    even_cfg = StepConfig(pipeline_schedule="1f1b", microbatches=m)
    program, rules = program_for(model, "stage=2", even_cfg)
    balanced_cfg, line = balance_stages(model, rules, dataclasses.replace(even_cfg, balance="profile"),
                                        batch, a.seq_len)
    print(line, flush=True)
    result = {"model": model.cfg.name, "mesh": "stage=2", "microbatches": m, "batch_size": batch, "choice": line}
    for name, cfg in (("even", dataclasses.replace(even_cfg, stage_layers=(4, 4))), ("balanced", balanced_cfg)):
        _, b = stage_bubble(model, "stage=2", cfg, batch, a)
        result[name] = {"stage_layers": list(cfg.stage_layers), "step_s": b.step_s, "stage_work_s": b.stage_work_s}
        print(f"{name} {cfg.stage_layers}: {b.line()}", flush=True)
    return result


def run_part(part: str, a) -> None:
    from jaxshard import runtime

    if part in ("bubble", "balance"):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + SINGLE_THREAD).strip()
    runtime.configure(runtime.RuntimeConfig(cpu_devices=2 if part in ("bubble", "balance") else 8,
                                            platform="cpu"))
    result = {"bubble": part_bubble, "steps": part_steps, "balance": part_balance}[part](a)
    with open(os.path.join(a.out, f"{part}.json"), "w") as f:
        json.dump(result, f, indent=1)


def report(a) -> str:
    from jaxshard.analysis import accounting

    parts = {p: json.load(open(os.path.join(a.out, f"{p}.json"))) for p in ("bubble", "steps", "balance")}
    lines = ["Bubble: `stage=2` on 2 single-threaded fake CPU devices (a core each), llama-tiny "
             f"(4 layers), {a.rows} x {a.seq_len} tokens per microbatch.", "",
             "| schedule | M | ticks | step ms | stage work ms (alone) | all stages at once ms (slowdown) | "
             "bubble: against each stage alone | against all busy | theory |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in parts["bubble"]:
        name = r["schedule"] + (f" (V={r['virtual']})" if r["virtual"] > 1 else "")
        lines.append(f"| {name} | {r['microbatches']} | {r['ticks']} | {r['step_s'] * 1e3:.1f} | "
                     + " + ".join(f"{w * 1e3:.1f}" for w in r["stage_work_s"])
                     + f" | {r['all_stages_s'] * 1e3:.1f} ({r['concurrency_slowdown']:.2f}x) | "
                       f"{r['bubble_measured']:.3f} | {r['bubble_vs_all_busy']:.3f} | {r['bubble_theory']:.3f} |")
    lines += ["", "Step time: `stage=4,data=2` on 8 fake CPU devices sharing 2 cores, llama-tiny with "
              "8 layers.", "", "| schedule | M | ticks | microbatches kept per stage | step ms | theory bubble | "
              "matmul FLOPs / useful |", "|---|---|---|---|---|---|---|"]
    for r in parts["steps"]:
        name = r["schedule"] + (f" (V={r['virtual']})" if r["virtual"] > 1 else "")
        lines.append(f"| {name} | {r['microbatches']} | {r['ticks']} | {r['kept_microbatches']} | "
                     f"{r['step_s'] * 1e3:.1f} | {r['bubble_theory']:.3f} | "
                     f"{accounting.waste_cell(r.get('matmul_flops_per_device'))} |")
    b = parts["balance"]
    lines += ["", f"Balance: {b['model']} (8 layers, a 16k vocabulary's head), `stage=2` on the 2 "
              f"single-threaded devices, 1F1B, M={b['microbatches']}, `{b['choice']}`", "",
              "| split | step ms | stage work ms (alone) |", "|---|---|---|"]
    for name in ("even", "balanced"):
        r = b[name]
        lines.append(f"| {name} {','.join(map(str, r['stage_layers']))} | {r['step_s'] * 1e3:.1f} | "
                     + " + ".join(f"{w * 1e3:.1f}" for w in r["stage_work_s"]) + " |")
    return "\n".join(lines)


def plot(a) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = json.load(open(os.path.join(a.out, "bubble.json")))
    fig, ax = plt.subplots(figsize=(7, 5.5))
    ms = [1, 2, 4, 8]
    for kind, v, color in (("gpipe", 1, "C0"), ("1f1b", 1, "C1"), ("interleaved", 2, "C2"), ("zb-h1", 1, "C4")):
        pts = [r for r in rows if r["schedule"] == kind]
        ax.plot([r["microbatches"] for r in pts], [r["bubble_measured"] for r in pts], "o-", color=color,
                label=f"{kind}: against each stage alone")
        ax.plot([r["microbatches"] for r in pts], [r["bubble_vs_all_busy"] for r in pts], "o--", color=color,
                mfc="none", label=f"{kind}: against all stages busy")
    for v, style in ((1, "k--"), (2, "k:")):
        ax.plot(ms, [1 / (v * m + 1) for m in ms], style, label=f"theory (P-1)/({'V' if v > 1 else ''}M+P-1)"
                + (f", V={v}" if v > 1 else ""))
    ax.plot(ms, [1 / (3 * m + 1) for m in ms], "k-.", label="ZB-H1 theory (P-1)/(3M+P-1)")
    naive = next(r for r in rows if r["schedule"] == "naive")
    ax.plot([1, 1], [naive["bubble_measured"], naive["bubble_vs_all_busy"]], "s", color="C3", label="naive (both)")
    ax.set_xlabel("microbatches M (P = 2 stages)")
    ax.set_ylabel("bubble: idle share of device time")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    ax.set_title("Pipeline bubble vs microbatches")
    fig.tight_layout()
    path = os.path.join(a.out, "bubble.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    from jaxshard.cli import one_line_errors
    from jaxshard.errors import ConfigError

    with one_line_errors():
        if a.rows < 2 or a.rows % 2 or min(a.seq_len, a.steps) < 1:
            raise ConfigError(f"--rows must be a positive even number (a microbatch is split over the steps "
                              f"part's data=2), --seq-len and --steps >= 1; got --rows {a.rows}")
    os.makedirs(a.out, exist_ok=True)
    if a.part:
        run_part(a.part, a)
        return 0
    t0 = time.perf_counter()
    for part in ("bubble", "steps", "balance"):
        print(f"== {part}", flush=True)
        args = [sys.executable, os.path.abspath(__file__), "--part", part, "--out", a.out, "--rows", str(a.rows),
                "--seq-len", str(a.seq_len), "--steps", str(a.steps), "--remat", a.remat]
        done = subprocess.run(args, cwd=ROOT)
        if done.returncode:
            return done.returncode
    md = report(a)
    with open(os.path.join(a.out, "pipeline.md"), "w") as f:
        f.write(md + "\n")
    merged = {p: json.load(open(os.path.join(a.out, f"{p}.json"))) for p in ("bubble", "steps", "balance")}
    merged["meta"] = {"cpu_count": os.cpu_count(), "rows": a.rows, "seq_len": a.seq_len, "steps": a.steps,
                      "wall_s": time.perf_counter() - t0}
    with open(os.path.join(a.out, "pipeline.json"), "w") as f:
        json.dump(merged, f, indent=1)
    path = plot(a)
    print(md)
    print(f"\nwrote {a.out}/pipeline.json, pipeline.md" + (f", {os.path.basename(path)}" if path else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
