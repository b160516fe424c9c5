"""Benchmark strategies x meshes x model sizes: step time, throughput, memory, communication.

    python scripts/bench.py                      # the default matrix, ~5 minutes on 2 CPU cores
    python scripts/bench.py --models tiny --steps 5 --out /tmp/bench

For every configuration: compile the step, warm up, time --steps steps (median / min / max),
and record tokens/s, per-device memory (live params and optimizer state, XLA's argument and
temp bytes), the compiled collectives (bytes per device per step) next to the accounting's
prediction, and the compiled matmul FLOPs against the useful ones (the waste figure). Writes results.json, results.md (a table) and two plots: memory and communication
per device by strategy, and step time against device count.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxshard import runtime  # noqa: E402

# name -> (mesh, zero, sequence parallel); every mesh uses all 8 devices but "single"
STRATEGIES = {
    "single": ("data=1", 0, False),
    "ddp": ("data=8", 0, False),
    "zero1": ("data=8", 1, False),
    "zero2": ("data=8", 2, False),
    "fsdp": ("fsdp=8", 0, False),
    "hsdp": ("data=2,fsdp=4", 0, False),
    "tp": ("data=4,tensor=2", 0, False),
    "tp+sp": ("data=4,tensor=2", 0, True),
    "cp": ("data=2,sequence=4", 0, False),
}
SCALING = ("data=1", "data=2", "data=4", "data=8")  # DDP at a fixed global batch


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", default="tiny,small", help="comma-separated presets")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="from: " + ", ".join(STRATEGIES))
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    p.add_argument("--no-scaling", action="store_true", help="skip the device-count sweep")
    p.add_argument("--out", default="runs/bench", help="folder for results.json, results.md, plots")
    p.add_argument("--cpu-devices", type=int, default=8)
    return p


def rules_for(model, mesh_spec: str, zero: int, sp: bool, batch: int, seq: int):
    """The rules of one configuration, checked (one clear line if it cannot run)."""
    import jax

    from jaxshard.errors import ConfigError
    from jaxshard.mesh import MeshSpec, build_mesh
    from jaxshard.rules import ShardingRules, Strategy
    from jaxshard.training.step import check_batch

    n = math.prod(s for _, s in MeshSpec.parse(mesh_spec).axes)
    rules = ShardingRules(build_mesh(mesh_spec, jax.devices()[:n]), Strategy(zero=zero, sequence_parallel=sp))
    check_batch(rules, batch, seq, 1)
    rules.check_model(model.param_axes(), model.abstract_params())
    if seq > model.cfg.max_seq_len:
        raise ConfigError(f"--seq-len {seq} exceeds model {model.cfg.name}'s max_seq_len {model.cfg.max_seq_len}")
    return rules


def bench_one(model, mesh_spec: str, zero: int, sp: bool, batch: int, seq: int, warmup: int,
              steps: int, step: dict | None = None) -> dict:
    """``step``: StepConfig fields (e.g. the reducer) beside the defaults."""
    import jax
    import numpy as np

    from jaxshard.analysis import accounting, hlo, inspect
    from jaxshard.mesh import axis_sizes
    from jaxshard.training.optim import OptimConfig
    from jaxshard.training.step import StepConfig, build_program

    rules = rules_for(model, mesh_spec, zero, sp, batch, seq)
    n = rules.mesh.devices.size
    program = build_program(model, rules, OptimConfig(), StepConfig(**(step or {})))
    t0 = time.perf_counter()
    compiled = program.lower_step(batch, seq).compile()
    compile_s = time.perf_counter() - t0
    state = program.init(0)
    rng = np.random.default_rng(0)
    data = rng.integers(0, model.cfg.vocab_size, (warmup + steps, batch, seq + 1), dtype=np.int32)
    times = []
    for i in range(warmup + steps):
        batch_i = jax.device_put({"inputs": data[i, :, :-1], "targets": data[i, :, 1:]}, program.batch_sharding)
        t = time.perf_counter()
        state, metrics = compiled(state, batch_i)
        jax.block_until_ready(metrics["loss"])
        if i >= warmup:
            times.append(time.perf_counter() - t)
    found = inspect.compiled_collectives(compiled, rules.mesh)
    predicted = accounting.communication(model, rules, batch, seq).by_kind()
    mem = inspect.xla_memory(compiled)
    median = statistics.median(times)
    return {
        "model": model.cfg.name, "strategy": rules.name, "mesh": axis_sizes(rules.mesh),
        "mesh_flag": mesh_spec, "devices": n, "batch_size": batch, "seq_len": seq,
        "compile_s": compile_s, "step_s": {"median": median, "min": min(times), "max": max(times)},
        "timed_steps": len(times), "tokens_per_s": batch * seq / median,
        "per_device_bytes": {"params": inspect.max_bytes_per_device(state.params),
                             "opt_state": inspect.max_bytes_per_device(state.opt_state),
                             "xla_argument": mem.get("argument"), "xla_temp": mem.get("temp")},
        "collectives": hlo.summary(found),
        "collective_bytes": sum(c.bytes * c.executions for c in found),
        # Each gradient reduction (non-scalar all-reduce / reduce-scatter) as it runs: bytes.
        "reductions": [c.bytes for c in found if c.kind in ("all-reduce", "reduce-scatter")
                       and any(math.prod(s) > 1 for s in c.shapes) for _ in range(c.executions)],
        "collective_bytes_predicted": sum(predicted.values()),
        # The compiled step's matmuls against the useful ones (accounting.Flops.waste).
        "matmul_flops_per_device": accounting.matmul_waste(
            accounting.flops(model.cfg, rules, batch, seq, remat=model.remat), compiled.as_text(), model.cfg, rules,
            batch, seq, computed=float(metrics["moe_computed"]) if "moe_computed" in metrics else None,
            schedule=program.schedule),
        "final_loss": float(metrics["loss"]),
        # MoE: the last step's busiest expert's load over the mean, less 1 (DeepSeek's MaxVio).
        "moe_max_violation": float(metrics["moe_max_violation"]) if "moe_max_violation" in metrics else None,
    }


def write_markdown(out: str, stem: str, meta: dict, what: str, md: str) -> None:
    """``{out}/{stem}.md``: the machine and run line, then the table ``md``; prints the table.
    ``what``: the model, mesh and batch, as the line names them."""
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(f"Measured on {meta['devices']} {meta['backend']} devices ({meta['cpu_count']} cores), jax "
                f"{meta['jax']}, {what}, {meta['rounds']} interleaved rounds of {meta['timed_steps']} timed "
                f"steps.\n\n{md}\n")
    print(md)
    print(f"\nwrote {out}/{stem}.json, {stem}.md in {meta['wall_s']:.0f}s")


def table(results: list[dict]) -> str:
    from jaxshard.analysis import accounting

    head = ("| model | strategy | mesh | step ms (median / min / max) | tokens/s | params + opt "
            "KiB/device | XLA temp KiB | collective buffers KiB/step (compiled / predicted) | "
            "sent KiB/step (ring) | matmul FLOPs / useful |")
    lines = [head, "|" + "---|" * 10]
    for r in results:
        s, b = r["step_s"], r["per_device_bytes"]
        sent = sum(c["sent_bytes"] for c in r["collectives"])
        lines.append(
            f"| {r['model']} | {r['strategy']} | `{r['mesh_flag']}` | {s['median'] * 1e3:.1f} / "
            f"{s['min'] * 1e3:.1f} / {s['max'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | "
            f"{(b['params'] + b['opt_state']) / 1024:,.0f} | {(b['xla_temp'] or 0) / 1024:,.0f} | "
            f"{r['collective_bytes'] / 1024:,.0f} / {r['collective_bytes_predicted'] / 1024:,.0f} | "
            f"{sent / 1024:,.0f} | {accounting.waste_cell(r['matmul_flops_per_device'])} |")
    return "\n".join(lines)


def plots(results: list[dict], scaling: list[dict], out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    models = sorted({r["model"] for r in results})
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 3.6 * len(models)), squeeze=False)
    for row, model in zip(axes, models):
        rs = [r for r in results if r["model"] == model]
        names = [r["strategy"] for r in rs]
        params = [r["per_device_bytes"]["params"] / 2**20 for r in rs]
        opt = [r["per_device_bytes"]["opt_state"] / 2**20 for r in rs]
        row[0].bar(names, params, label="params")
        row[0].bar(names, opt, bottom=params, label="optimizer state")
        row[0].set_ylabel("MiB per device")
        row[0].set_title(f"{model}: what each device holds")
        row[0].legend()
        kinds = sorted({c["kind"] for r in rs for c in r["collectives"]})
        bottom = [0.0] * len(rs)
        for kind in kinds:
            vals = [sum(c["sent_bytes"] for c in r["collectives"] if c["kind"] == kind) / 2**20 for r in rs]
            row[1].bar(names, vals, bottom=bottom, label=kind)
            bottom = [a + b for a, b in zip(bottom, vals)]
        row[1].set_ylabel("MiB sent per device per step")
        row[1].set_title(f"{model}: what each device sends (compiled, ring model)")
        row[1].legend(fontsize=8)
        for ax in row:
            ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    path = os.path.join(out, "memory_comm.png")
    fig.savefig(path, dpi=110)
    written.append(path)
    plt.close(fig)
    if scaling:
        fig, ax = plt.subplots(figsize=(6, 4))
        for model in sorted({r["model"] for r in scaling}):
            rs = sorted((r for r in scaling if r["model"] == model), key=lambda r: r["devices"])
            ax.plot([r["devices"] for r in rs], [r["step_s"]["median"] * 1e3 for r in rs], "o-", label=model)
        ax.set_xlabel("devices (DDP, same global batch)")
        ax.set_ylabel("step time, ms (median)")
        ax.set_xscale("log", base=2)
        ax.set_title("Step time vs device count (fake CPU devices share the cores)")
        ax.legend()
        fig.tight_layout()
        path = os.path.join(out, "scaling.png")
        fig.savefig(path, dpi=110)
        written.append(path)
        plt.close(fig)
    return written


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    from jaxshard.cli import one_line_errors
    from jaxshard.errors import ConfigError

    with one_line_errors():
        runtime.configure(runtime.RuntimeConfig(cpu_devices=a.cpu_devices))
        import jax
        from tqdm import tqdm

        from models import TransformerLM, get_preset

        names = [s for s in a.strategies.split(",") if s]
        unknown = [s for s in names if s not in STRATEGIES]
        if unknown:
            raise ConfigError(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
        if a.steps < 1:
            raise ConfigError("--steps must be >= 1")
        models = [TransformerLM(get_preset(m)) for m in a.models.split(",") if m]
        jobs = [("strategy", m, *STRATEGIES[s]) for m in models for s in names]
        if not a.no_scaling:
            jobs += [("scaling", m, mesh, 0, False) for m in models for mesh in SCALING]
        for _, model, mesh, zero, sp in jobs:  # every configuration can run, before any does
            rules_for(model, mesh, zero, sp, a.batch_size, a.seq_len)
        os.makedirs(a.out, exist_ok=True)
        results, scaling, t0 = [], [], time.perf_counter()
        with tqdm(jobs, desc="bench", unit="config", file=sys.stderr) as bar:
            for kind, model, mesh, zero, sp in bar:
                bar.set_postfix(model=model.cfg.name, mesh=mesh)
                r = bench_one(model, mesh, zero, sp, a.batch_size, a.seq_len, a.warmup, a.steps)
                (results if kind == "strategy" else scaling).append(r)
        meta = {"backend": jax.default_backend(), "devices": jax.device_count(),
                "cpu_count": os.cpu_count(), "jax": jax.__version__, "wall_s": time.perf_counter() - t0,
                "batch_size": a.batch_size, "seq_len": a.seq_len, "timed_steps": a.steps}
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "strategies": results, "scaling": scaling}, f, indent=1)
        md = table(results)
        with open(os.path.join(a.out, "results.md"), "w") as f:
            f.write(f"Measured on {meta['devices']} {meta['backend']} devices ({meta['cpu_count']} cores), "
                    f"jax {meta['jax']}, global batch {a.batch_size} x {a.seq_len}, "
                    f"{a.steps} timed steps after {a.warmup} warm-up.\n\n{md}\n")
        written = plots(results, scaling, a.out)
        print(md)
        print(f"\nwrote {a.out}/results.json, results.md, " + ", ".join(os.path.basename(w) for w in written)
              + f" in {meta['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
