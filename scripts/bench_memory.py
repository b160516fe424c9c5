"""What the compiled training step keeps, and the recompute policies' step time (docs/memory.md).

    python scripts/bench_memory.py                                   # ~3 minutes on 2 CPU cores
    python scripts/bench_memory.py --parts keeps --out /tmp/bm       # compile only, ~40 s
    python scripts/bench_memory.py --parts policies --warmup 1 --steps 2 --out /tmp/bm

8 fake CPU devices, --model (llama-tiny), global batch --batch-size x --seq-len (8 x 128).

keeps: the compiled step (nothing runs) of FSDP (``fsdp=8``) under each recompute policy with and
without reshard-after-forward, and of ZeRO-2 (``data=8 --zero 2``), DDP (``data=8``) and TP
(``data=2,tensor=4``) without remat, and FSDP under ``--fp8 tensorwise`` (its weights gathered
as float8, which XLA:CPU widens to float16) and ``rowwise``, under three policies. Per row,
XLA's memory analysis per device (argument, output, temp, aliased bytes, and arguments +
outputs + temps - aliased, what bench_peers.py reports), the gathered layers the step keeps
for the backward pass (``inspect.gathered_weights_kept``) and its all-gather bytes over the
params' bytes.

policies: the step time of each --remat policy on each mesh: --warmup steps, then --steps timed
steps per configuration, taken round-robin across the configurations so that the machine's
drift falls on all alike; each step waits for its loss. Median (min-max) per configuration.

Writes memory.json and memory.md to --out; a part not run keeps what the file holds of it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT

PARTS = ("keeps", "policies")
# (mesh, ZeRO stage, --remat, reshard-after-forward, --fp8): docs/memory.md's rows, and
# docs/float8.md's float8 all-gather.
KEEPS = (("fsdp=8", 0, "none", True, None), ("fsdp=8", 0, "none", False, None),
         ("fsdp=8", 0, "selective", True, None), ("fsdp=8", 0, "dots", True, None),
         ("fsdp=8", 0, "full", True, None), ("fsdp=8", 0, "full", False, None),
         ("data=8", 2, "none", True, None), ("data=8", 0, "none", True, None),
         ("data=2,tensor=4", 0, "none", True, None),
         *(("fsdp=8", 0, remat, True, recipe) for recipe in ("tensorwise", "rowwise")
           for remat in ("none", "dots", "full")))
MIB = 2**20


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="docs/bench")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated, from: " + ", ".join(PARTS))
    p.add_argument("--model", default="llama-tiny", help="a preset")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--meshes", default="fsdp=4,tensor=2;fsdp=8;data=8", help="policies: semicolon-separated meshes")
    p.add_argument("--policies", default="none,dots,full,dots_no_batch", help="policies: comma-separated --remat")
    p.add_argument("--warmup", type=int, default=5, help="policies: untimed steps per configuration")
    p.add_argument("--steps", type=int, default=12, help="policies: timed steps per configuration")
    return p


def build(model_name: str, mesh: str, zero: int, remat: str, reshard: bool, fp8: str | None = None):
    """The model and the training program of one configuration, on all devices."""
    import jax

    from jaxshard.mesh import build_mesh
    from jaxshard.rules import ShardingRules, Strategy
    from jaxshard.training.optim import OptimConfig
    from jaxshard.training.step import StepConfig, build_program
    from models import TransformerLM, get_preset

    model = TransformerLM(get_preset(model_name).replace(fp8=fp8), remat=remat)
    rules = ShardingRules(build_mesh(mesh, jax.devices()), Strategy(zero=zero, reshard_after_forward=reshard))
    return model, build_program(model, rules, OptimConfig(), StepConfig())


def keeps_row(model_name: str, mesh: str, zero: int, remat: str, reshard: bool, fp8: str | None, batch: int,
              seq: int) -> dict:
    """One compiled step's memory per device and what it gathers and keeps (float32 params)."""
    import jax

    from jaxshard.analysis import inspect, shards

    model, program = build(model_name, mesh, zero, remat, reshard, fp8)
    rules = program.rules
    compiled = program.lower_step(batch, seq).compile()
    mem = inspect.xla_memory(compiled)
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.abstract_params()))
    gathered = sum(math.prod(rules.named(p.compute).shard_shape(p.shape)) * 4
                   for p in shards.param_infos(model, rules) if p.in_layers and p.params != p.compute)
    per_layer = gathered / model.cfg.n_layers
    kept = inspect.gathered_weights_kept(compiled, model, rules)
    allgather = sum(c.bytes * c.executions for c in inspect.compiled_collectives(compiled, rules.mesh)
                    if c.kind == "all-gather")
    return {"mesh": mesh, "zero": zero, "remat": remat, "reshard_after_forward": reshard, "fp8": fp8,
            "temp_bytes": mem["temp"], "argument_bytes": mem["argument"], "output_bytes": mem["output"],
            "alias_bytes": mem["alias"], "total_bytes": mem["argument"] + mem["output"] + mem["temp"] - mem["alias"],
            "gathered_kept_bytes": kept, "gathered_layers_kept": round(kept / per_layer) if per_layer else 0,
            "layers": model.cfg.n_layers, "allgather_bytes": allgather, "params_bytes": params,
            "allgather_over_params": allgather / params}


def time_policies(model_name: str, meshes: list[str], policies: list[str], batch: int, seq: int,
                  warmup: int, steps: int) -> list[dict]:
    """Step seconds of each (mesh, policy), the configurations' steps taken in turn."""
    import jax

    from jaxshard.data.synthetic import random_batches

    runs = []
    for mesh in meshes:
        for policy in policies:
            model, program = build(model_name, mesh, 0, policy, True)
            compiled = program.lower_step(batch, seq).compile()
            batch_d = jax.device_put(random_batches(model.cfg.vocab_size, 1, batch, seq)[0], program.batch_sharding)
            runs.append({"mesh": mesh, "remat": policy, "compiled": compiled, "state": program.init(0),
                         "batch": batch_d, "times": []})
            print(f"compiled {mesh} --remat {policy}", file=sys.stderr, flush=True)
    for i in range(warmup + steps):
        for r in runs:
            t = time.perf_counter()
            r["state"], metrics = r["compiled"](r["state"], r["batch"])
            jax.block_until_ready(metrics["loss"])
            if i >= warmup:
                r["times"].append(time.perf_counter() - t)
    return [{"mesh": r["mesh"], "remat": r["remat"], "step_s": r["times"], "median_s": statistics.median(r["times"]),
             "min_s": min(r["times"]), "max_s": max(r["times"]),
             "temp_bytes": r["compiled"].memory_analysis().temp_size_in_bytes} for r in runs]


def keeps_table(rows: list[dict]) -> list[str]:
    lines = ["| mesh | `--remat` | reshard-after-forward | gathered layers kept for backward | "
             "all-gather bytes / params bytes | XLA temp per device | arguments + outputs + temps - aliased |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        n = r["gathered_layers_kept"]
        kept = f"{n} of {r['layers']} ({r['gathered_kept_bytes'] / MIB:.1f} MiB)" if n else "0"
        mesh = r["mesh"] + (f" --zero {r['zero']}" if r["zero"] else "") + (f" --fp8 {r['fp8']}" if r["fp8"] else "")
        lines.append(f"| `{mesh}` | {r['remat']} | {str(r['reshard_after_forward']).lower()} | {kept} | "
                     f"{r['allgather_over_params']:.2f} | {r['temp_bytes'] / MIB:.1f} MiB | "
                     f"{r['total_bytes'] / MIB:.1f} MiB |")
    return lines


def policies_table(rows: list[dict], meshes: list[str], policies: list[str]) -> list[str]:
    cells = {(r["mesh"], r["remat"]): f"{r['median_s']:.3f} s ({r['min_s']:.3f}–{r['max_s']:.3f})" for r in rows}
    lines = ["| mesh | " + " | ".join(f"`{p}`" for p in policies) + " |", "|---|" + "---|" * len(policies)]
    for mesh in meshes:
        lines.append(f"| {mesh} | " + " | ".join(cells[mesh, p] for p in policies) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    from jaxshard.cli import one_line_errors
    from jaxshard.errors import ConfigError

    with one_line_errors():
        parts = [p for p in a.parts.split(",") if p]
        meshes = [m for m in a.meshes.split(";") if m]
        policies = [p for p in a.policies.split(",") if p]
        if not parts or set(parts) - set(PARTS):
            raise ConfigError(f"--parts takes a comma-separated subset of {', '.join(PARTS)}, got {a.parts!r}")
        if not (meshes and policies) or a.steps < 1 or a.warmup < 0 or min(a.batch_size, a.seq_len) < 1:
            raise ConfigError("--meshes and --policies must name at least one each; --steps, --batch-size and "
                              "--seq-len must be >= 1, --warmup >= 0")
        from jaxshard import remat, runtime

        for p in policies:
            remat.Remat.parse(p)
        runtime.configure(runtime.RuntimeConfig(cpu_devices=8, platform="cpu"))
        import jax

        t0 = time.perf_counter()
        meta = {"backend": jax.default_backend(), "devices": jax.device_count(), "cpu_count": os.cpu_count(),
                "jax": jax.__version__, "model": a.model, "batch_size": a.batch_size, "seq_len": a.seq_len}
        report = {}
        what = (f"{a.model}, batch {a.batch_size} x {a.seq_len}, {meta['devices']} fake CPU devices, "
                f"jax {jax.__version__}")
        if "keeps" in parts:
            t = time.perf_counter()
            report["keeps"] = []
            for row in KEEPS:
                report["keeps"].append(keeps_row(a.model, *row, a.batch_size, a.seq_len))
                print(f"compiled {row}", file=sys.stderr, flush=True)
            meta["keeps_wall_s"] = time.perf_counter() - t
        if "policies" in parts:
            t = time.perf_counter()
            report["policies"] = time_policies(a.model, meshes, policies, a.batch_size, a.seq_len, a.warmup, a.steps)
            meta.update(policies_wall_s=time.perf_counter() - t, warmup=a.warmup, steps=a.steps,
                        meshes=meshes, policies=policies)
        meta["wall_s"] = time.perf_counter() - t0
        # A part not run this time keeps its figures from the file (one part re-measured alone).
        path = os.path.join(a.out, "memory.json")
        old = json.load(open(path)) if os.path.exists(path) else {}
        report = {**{k: v for k, v in old.items() if k in PARTS}, **report}
        meta = {**old.get("meta", {}), **meta}
        md = []
        if "keeps" in report:
            md += [f"What the compiled training step keeps, per device (XLA's memory analysis; nothing run): {what}.",
                   "", *keeps_table(report["keeps"]), ""]
        if "policies" in report:
            md += [f"Step time, median (min–max) of {meta['steps']} steps after {meta['warmup']}, the "
                   f"configurations interleaved: {what}, {meta['cpu_count']} cores.", "",
                   *policies_table(report["policies"], meta.get("meshes", meshes), meta.get("policies", policies)), ""]
        os.makedirs(a.out, exist_ok=True)
        with open(path, "w") as f:
            json.dump({"meta": meta, **report}, f, indent=1)
        with open(os.path.join(a.out, "memory.md"), "w") as f:
            f.write("\n".join(md))
        print("\n".join(md))
        print(f"wrote {a.out}/memory.json, memory.md in {meta['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
