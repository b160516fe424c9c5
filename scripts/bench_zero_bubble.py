"""Zero-bubble pipelining: ZB-H1 against 1F1B, step time, memory and the tables' bubble.

    python scripts/bench_zero_bubble.py                 # ~7 minutes on 2 CPU cores
    python scripts/bench_zero_bubble.py --steps 3 --microbatches 2 --d-model 256 --out /tmp/zb

``stage=2`` on 2 fake CPU devices, each single-threaded (a core each, so a waiting stage really
idles, as in bench_pipeline.py's bubble part), llama-tiny's 4 layers (2 a stage) at width
--d-model (MLP 4x), --rows x --seq-len tokens a microbatch. For each M: the fastest of --steps
steps of 1F1B and of ZB-H1 (the backward slot split into B and W, W deferred into the idle
ticks), the compiled step's temporary bytes and matmul FLOPs over the useful ones (what the
remat policy's recompute does not explain: x1.00 when B and W together compute one backward),
and each table's idle fraction (F, B and W one unit
each) beside the theory: (P - 1)/(M + P - 1) for 1F1B, (P - 1)/(3M + P - 1) for ZB-H1. The two
runs alternate, each timed --rounds times, so that the machine's drift falls on both; each
round's ratio is reported too. Then one more step of each, traced with jax.profiler: each
device's time by the part of the step its ops are in (F, B, W, the ends' embedding, head and
loss, the tick loop's own work, the sends with their waiting, the step around the loop), read
from the trace's thunks (jaxshard.analysis.profile.tick_parts). Writes zero_bubble.json and
zero_bubble.md to --out.

The default width is 1024, a real model's order (GPT-2 medium's). B holds all of the backward
pass's elementwise work, which grows with the width where the matmuls grow with its square, so
at narrower widths B takes more of W's time and the Ws fill less of the bubble than the tables
count (traced at 1024: B about twice W; docs/pipelines.md; ``--d-model 256 --rows 4`` not
measured with the present tables).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT

SINGLE_THREAD = "--xla_cpu_multi_thread_eigen=false"
KINDS = ("1f1b", "zb-h1")
# The traced table's columns: the parts of jaxshard.analysis.profile.tick_part each sums.
COLUMNS = {"F": ("F",), "B": ("B",), "W": ("W", "W_first"), "last": ("last",), "ends": ("head", "embed", "embed_grad"),
           "tick": ("tick",), "sends": ("send",), "outside": ("outside", "xla")}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="docs/bench")
    p.add_argument("--microbatches", default="2,4,8", help="comma-separated values of M")
    p.add_argument("--d-model", type=int, default=1024, help="the model's width (MLP 4x, 4 heads)")
    p.add_argument("--rows", type=int, default=1, help="sequences per microbatch")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=5, help="timed steps per round (the fastest counts)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of the two schedules")
    p.add_argument("--remat", default="none", help="the model's --remat policy")
    p.add_argument("--residual-cap", default=None,
                   help="ZB-H1's cap on microbatches whose residuals a stage holds: a number, or 'stage' for P - s "
                        "on stage s (default: the training step's for --remat, pipeline.residual_cap)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    from jaxshard.cli import int_list, one_line_errors
    from jaxshard.errors import ConfigError

    with one_line_errors():
        ms = int_list(a.microbatches, "--microbatches")
        if not ms or min(ms) < 2 or min(a.steps, a.rounds, a.rows) < 1:
            raise ConfigError("--microbatches must be >= 2 (the stages); --steps, --rounds and --rows >= 1")
        if a.d_model < 8 or a.d_model % 8:
            raise ConfigError(f"--d-model must be a multiple of 8 (4 heads of an even width, for RoPE), "
                              f"got {a.d_model}")
        if a.residual_cap not in (None, "stage") and not (a.residual_cap.isdigit() and int(a.residual_cap) >= 1):
            raise ConfigError(f"--residual-cap must be a number >= 1 or 'stage', got {a.residual_cap}")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + SINGLE_THREAD).strip()
        from jaxshard import runtime

        runtime.configure(runtime.RuntimeConfig(cpu_devices=2, platform="cpu"))
        import jax

        from jaxshard.analysis import accounting
        from jaxshard.analysis.bubble import priced_step, step_seconds, traced_parts
        from jaxshard.mesh import build_mesh
        from jaxshard.parallel import pipeline
        from jaxshard.rules import ShardingRules
        from jaxshard.training.optim import OptimConfig
        from jaxshard.training.step import StepConfig, build_program
        from models import TransformerLM, get_preset

        model = TransformerLM(get_preset("llama-tiny").replace(d_model=a.d_model, d_mlp=4 * a.d_model), remat=a.remat)
        rules = ShardingRules(build_mesh("stage=2", jax.devices()[:2]))
        cap = (pipeline.residual_cap(2, model.remat) if a.residual_cap is None
               else (2, 1) if a.residual_cap == "stage" else int(a.residual_cap))
        t0 = time.perf_counter()
        rows = []
        for m in ms:
            batch = m * a.rows
            layout = pipeline.StageLayout.make(model.cfg.n_layers, 2)
            tables = {"1f1b": None, "zb-h1": pipeline.make_schedule("zb-h1", 2, m, layout=layout,
                                                                    residual_cap=cap)}
            programs = {k: build_program(model, rules, OptimConfig(), StepConfig(pipeline_schedule=k, microbatches=m),
                                         schedule=tables[k]) for k in KINDS}
            times = {k: [] for k in KINDS}
            for _ in range(a.rounds):
                for k in KINDS:
                    times[k].append(step_seconds(programs[k], batch, a.seq_len, model.cfg.vocab_size, a.steps))
            row = {"microbatches": m, "batch_size": batch,
                   "ratio_rounds": [z / o for z, o in zip(times["zb-h1"], times["1f1b"])]}
            for k, program in programs.items():
                s = program.schedule
                compiled = program.lower_step(batch, a.seq_len).compile()
                # The compiled step's matmuls against the useful ones and the policy's recompute
                # (accounting.matmul_waste: each tick op's counted as often as the tables run it).
                waste = accounting.matmul_waste(
                    accounting.flops(model.cfg, rules, batch, a.seq_len, remat=model.remat), compiled.as_text(),
                    model.cfg, rules, batch, a.seq_len, schedule=s)
                row[k] = {"step_s": min(times[k]), "step_s_rounds": times[k],
                          "temp_bytes": compiled.memory_analysis().temp_size_in_bytes, "ticks": s.ticks,
                          "table_idle": s.idle(), "theory": s.bubble(), "matmul_flops_per_device": waste,
                          "traced": traced_parts(program, batch, a.seq_len, model.cfg.vocab_size)}
                row[k]["traced"]["priced_step_s"] = priced_step(s, row[k]["traced"]["devices"])
            rows.append(row)
            print(f"M={m}: 1f1b {row['1f1b']['step_s'] * 1e3:.1f} ms, zb-h1 {row['zb-h1']['step_s'] * 1e3:.1f} ms",
                  file=sys.stderr, flush=True)
        meta = {"backend": jax.default_backend(), "devices": 2, "cpu_count": os.cpu_count(), "jax": jax.__version__,
                "model": "llama-tiny", "d_model": a.d_model, "mesh": "stage=2", "rows": a.rows, "seq_len": a.seq_len,
                "steps": a.steps, "rounds": a.rounds, "remat": a.remat, "residual_cap": cap,
                "wall_s": time.perf_counter() - t0}
        lines = [f"`stage=2` on 2 single-threaded fake CPU devices, llama-tiny (4 layers) at width {a.d_model}, "
                 f"{a.rows} x {a.seq_len} tokens a microbatch, --remat {a.remat}, ZB-H1's residual cap "
                 f"{'P - s' if isinstance(cap, tuple) else cap}; "
                 f"the fastest of {a.rounds} x {a.steps} steps.", "",
                 "| M | 1F1B step ms | ZB-H1 step ms | ZB-H1 / 1F1B | each round | table idle 1F1B (theory) | "
                 "table idle ZB-H1 (theory) | temp MiB 1F1B / ZB-H1 | matmul FLOPs / useful 1F1B, ZB-H1 |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            o, z = r["1f1b"], r["zb-h1"]
            lines.append(f"| {r['microbatches']} | {o['step_s'] * 1e3:.1f} | {z['step_s'] * 1e3:.1f} | "
                         f"{z['step_s'] / o['step_s']:.3f} | {' '.join(f'{x:.2f}' for x in r['ratio_rounds'])} | "
                         f"{o['table_idle']:.3f} ({o['theory']:.3f}) | "
                         f"{z['table_idle']:.3f} ({z['theory']:.3f}) | {o['temp_bytes'] / 2**20:.2f} / "
                         f"{z['temp_bytes'] / 2**20:.2f} | {accounting.waste_cell(o['matmul_flops_per_device'])}, "
                         f"{accounting.waste_cell(z['matmul_flops_per_device'])} |")
        lines += ["", "Where each device's time went, ms of one traced step (ops by the executor's scope; "
                  "B: 1F1B's whole backward; last: 1F1B's last chunk, its forward and backward in one slot; ends: "
                  "the embedding, ZB-H1's head and loss; the sends include their waiting; unaccounted: the "
                  "runtime's own, in loops and branches; priced: the tables with each op at its traced cost on "
                  "its stage, jaxshard.analysis.bubble.priced_step):", "",
                  "| M | schedule | device | F | B | W | last | ends | tick | sends | outside | unaccounted | "
                  "traced step | priced |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            for k in KINDS:
                traced = r[k]["traced"]
                for device, parts in traced["devices"].items():
                    cells = [sum(parts.get(p, 0.0) for p in group) for group in COLUMNS.values()]
                    lines.append(f"| {r['microbatches']} | {k} | {device} | "
                                 + " | ".join(f"{c * 1e3:.0f}" for c in cells)
                                 + f" | {(traced['step_s'] - sum(parts.values())) * 1e3:.0f} | "
                                 f"{traced['step_s'] * 1e3:.0f} | {traced['priced_step_s'] * 1e3:.0f} |")
        write_report(a.out, "zero_bubble", meta, rows, "\n".join(lines))
    return 0


def write_report(out: str, stem: str, meta: dict, rows: list, md: str) -> None:
    """``stem``.json (``meta`` and ``rows``) and ``stem``.md (the table ``md``) into ``out``; the
    table printed."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    print(f"\nwrote {out}/{stem}.json, {stem}.md in {meta['wall_s']:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
