"""Zero-bubble pipelining's memory: ZB-H1's compiled temp against 1F1B's, per device.

    python scripts/bench_zero_bubble_memory.py            # ~8 minutes on 2 CPU cores (60 pairs)
    python scripts/bench_zero_bubble_memory.py --models tiny --meshes stage=2,data=4 --remats dots --out zm
    python scripts/bench_zero_bubble_memory.py --residual-cap stage --out zm-narrow   # every run at P - s
    python scripts/bench_zero_bubble_memory.py --meshes "stage=4,tensor=2" --layers 8 --microbatches 4,8

For each model, mesh, remat policy and M: the compiled training step of 1F1B and of ZB-H1 on 8
fake CPU devices, the models' --layers layers (4) on the mesh's stages, --rows x --seq-len
tokens a microbatch, and XLA's temporary bytes per device (``memory_analysis().temp_size_in_bytes``),
the figure the memory tests of tests/test_pipeline.py compare, beside each table's idle
fraction (``Schedule.idle``). ZB-H1's cap is the training step's (``pipeline.residual_cap``)
unless --residual-cap sets it: ``wide`` 1F1B's 2P - 1, ``stage`` P - s on stage s (lowered as
the step lowers it), or a number for every stage. Nothing runs: the figures are
the compiler's, the same on any machine with this jax and XLA. Writes zero_bubble_memory.json
and zero_bubble_memory.md to --out; a ratio above 1 is where ZB-H1 keeps more than 1F1B
(docs/pipelines.md says why, case by case).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT

from scripts.bench_zero_bubble import KINDS, write_report  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="docs/bench")
    p.add_argument("--models", default="tiny-llama,tiny", help="comma-separated presets")
    p.add_argument("--meshes", default="stage=2,data=4;data=2,stage=2,tensor=2;stage=2,fsdp=4",
                   help="semicolon-separated --mesh values of 8 devices, each with a stage axis")
    p.add_argument("--remats", default="none,dots,selective,dots_no_batch,full",
                   help="comma-separated --remat policies (semicolon-separated where one names several "
                        "values, e.g. 'none;names:qkv,attn_proj')")
    p.add_argument("--microbatches", default="2,4", help="comma-separated values of M (>= the stages)")
    p.add_argument("--layers", type=int, default=4, help="the models' layers")
    p.add_argument("--rows", type=int, default=4, help="sequences per microbatch")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--residual-cap", default=None,
                   help="ZB-H1's cap on microbatches whose residuals a stage holds: 'wide' (2P - 1), 'stage' (P - s "
                        "on stage s) or a number (default: the training step's, pipeline.residual_cap)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    from jaxshard.cli import int_list, one_line_errors
    from jaxshard.errors import ConfigError

    with one_line_errors():
        ms = int_list(a.microbatches, "--microbatches")
        models = [m for m in a.models.split(",") if m]
        meshes = [m for m in a.meshes.split(";") if m]
        remats = [r for r in a.remats.split(";" if ";" in a.remats else ",") if r]
        if not (ms and models and meshes and remats) or min(a.layers, a.rows, a.seq_len) < 1:
            raise ConfigError("--models, --meshes, --remats and --microbatches must name at least one each; "
                              "--layers, --rows and --seq-len must be >= 1")
        cap_ok = a.residual_cap in (None, "wide", "stage") or a.residual_cap.isdigit() and int(a.residual_cap) >= 1
        if not cap_ok:
            raise ConfigError(f"--residual-cap must be 'wide', 'stage' or a number >= 1, got {a.residual_cap}")
        from jaxshard import remat, runtime

        for r in remats:
            remat.Remat.parse(r)  # a one-line error for an unknown policy, before anything compiles
        runtime.configure(runtime.RuntimeConfig(cpu_devices=8, platform="cpu"))
        import jax

        from jaxshard.mesh import MeshSpec, build_mesh
        from jaxshard.rules import ShardingRules
        from jaxshard.training.optim import OptimConfig
        from jaxshard.training.step import StepConfig, build_program, check_batch
        from models import TransformerLM, get_preset

        for mesh in meshes:
            if MeshSpec.parse(mesh).resolve(len(jax.devices())).get("stage", 1) < 2:
                raise ConfigError(f"--meshes: {mesh!r} has no stage axis of size > 1")
            for m in ms:  # a microbatch the batch axes split, as training asks
                check_batch(ShardingRules(build_mesh(mesh, jax.devices())), m * a.rows, a.seq_len, 1, m)
        t0 = time.perf_counter()
        rows = []
        for mesh in meshes:
            rules = ShardingRules(build_mesh(mesh, jax.devices()))
            for policy in remats:
                for name in models:
                    model = TransformerLM(get_preset(name).replace(n_layers=a.layers), remat=policy)
                    for m in ms:
                        row = {"model": name, "mesh": mesh, "remat": policy, "microbatches": m}
                        for kind in KINDS:
                            step = StepConfig(pipeline_schedule=kind, microbatches=m)
                            tables = None if kind != "zb-h1" or a.residual_cap is None else \
                                own_tables(rules, model, step, a.residual_cap)
                            program = build_program(model, rules, OptimConfig(), step, schedule=tables)
                            compiled = program.lower_step(m * a.rows, a.seq_len).compile()
                            row[kind] = {"temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                                         "slots": program.schedule.slots, "idle": program.schedule.idle()}
                            if kind == "zb-h1":
                                row[kind]["handover_slots"] = program.schedule.w_slots
                        row["ratio"] = row["zb-h1"]["temp_bytes"] / row["1f1b"]["temp_bytes"]
                        rows.append(row)
                        print(f"{name} {mesh} --remat {policy} M={m}: {row['ratio']:.3f}", file=sys.stderr,
                              flush=True)
        meta = {"backend": jax.default_backend(), "devices": 8, "jax": jax.__version__, "layers": a.layers,
                "rows": a.rows, "seq_len": a.seq_len, "residual_cap": a.residual_cap or "step",
                "wall_s": time.perf_counter() - t0}
        columns = [(name, m) for name in models for m in ms]
        cap = {None: "the training step's", "wide": "2P - 1", "stage": "P - s on stage s"}.get(
            a.residual_cap, a.residual_cap)
        lines = [f"ZB-H1's compiled temp bytes per device over 1F1B's: {a.layers} layers, "
                 f"{a.rows} x {a.seq_len} tokens a microbatch, 8 fake CPU devices, jax {jax.__version__}; "
                 f"ZB-H1's residual cap {cap}.", "",
                 "| mesh | `--remat` | " + " | ".join(f"{name}, M = {m}" for name, m in columns) + " |",
                 "|---|---|" + "---|" * len(columns)]
        for mesh in meshes:
            for policy in remats:
                cells = {(r["model"], r["microbatches"]): r["ratio"] for r in rows
                         if r["mesh"] == mesh and r["remat"] == policy}
                lines.append(f"| `{mesh}` | `{policy}` | " + " | ".join(
                    f"{cells[c]:.3f}" + (" **over**" if cells[c] > 1 else "") for c in columns) + " |")
        lines += ["", "The tables' idle fraction (F, B and W one unit each), ZB-H1 (1F1B):", "",
                  "| mesh | `--remat` | " + " | ".join(f"{name}, M = {m}" for name, m in columns) + " |",
                  "|---|---|" + "---|" * len(columns)]
        for mesh in meshes:
            for policy in remats:
                idle = {(r["model"], r["microbatches"]): (r["zb-h1"]["idle"], r["1f1b"]["idle"]) for r in rows
                        if r["mesh"] == mesh and r["remat"] == policy}
                lines.append(f"| `{mesh}` | `{policy}` | " + " | ".join(
                    f"{idle[c][0]:.3f} ({idle[c][1]:.3f})" for c in columns) + " |")
        write_report(a.out, "zero_bubble_memory", meta, rows, "\n".join(lines))
    return 0


def own_tables(rules, model, step, cap: str):
    """ZB-H1's tables for ``step`` with the cap --residual-cap names, in place of the step's."""
    from jaxshard.parallel import pipeline

    stages, m = rules.sizes["stage"], step.microbatches
    layout = pipeline.slot_layout(dict(rules.sizes), pipeline.replica_axes(rules))
    cap = (2 * stages - 1 if cap == "wide" else pipeline.residual_cap(stages, "full", layout, m) if cap == "stage"
           else int(cap))
    return pipeline.make_schedule("zb-h1", stages, m, layout=pipeline.StageLayout.make(model.cfg.n_layers, stages),
                                  residual_cap=cap)


if __name__ == "__main__":
    sys.exit(main())
