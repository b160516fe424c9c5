"""MoE benchmark: a dense model of the same active size vs MoE with and without expert
parallelism, dropping vs dropless.

    python scripts/bench_moe.py                  # ~3 minutes on 2 CPU cores
    python scripts/bench_moe.py --rounds 1 --steps 3 --out /tmp/moe

Configurations, all on 8 fake CPU devices with the same global batch (interleaved: every
configuration runs once per round, --rounds rounds; the table gives the median of all timed
steps and the spread of the rounds' medians):

* ``dense``: ``moe-tiny`` without experts, its MLP as wide as the k experts a token uses
  (the same active params and matmul FLOPs per token), ``data=8``;
* ``moe`` on ``data=8``: every device holds all experts (no expert parallelism);
* ``moe`` on ``expert=8`` and ``data=2,expert=4``: experts split;

each MoE configuration with a capacity factor (``--capacity``, tokens beyond it dropped: the
tokens move by all-to-all) and dropless (factor 0: only the routed tokens, grouped matmuls;
with the experts split, the tokens all-gathered over ``expert`` and the outputs
reduce-scattered back); and on ``expert=8`` the capacity E/k, which gives each expert S
slots a sequence -- E S per sequence, what dropless computed before it ran the routed rows
only. Besides step time and tokens/s: params + optimizer bytes per device, the compiled
bytes per step of the tokens' exchange (all-to-alls, or the dropless gathers and scatters)
with the accounting's prediction, the compiled matmul FLOPs against the useful (a grouped
matmul's loop counted by the rows it ran), and the busiest expert's load over the mean. A
closing line sets dropless against capacity E/k on ``expert=8``: the ratio of the step
times, and of the compiled FLOPs on the mean device, and where a device holds one expert an
estimate for the busiest (its rows are its expert's load; the step waits for it at the
exchange). Writes moe.json and moe.md to --out.

``--d-model`` and ``--expert-width`` widen the model (its 8 heads kept): at moe-tiny's 64 the
matmuls are a small part of a step; at 512 / 1024 they are most of it.
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

MESHES = ("data=8", "expert=8", "data=2,expert=4")
EXCHANGE = ("all-to-all", "all-gather", "reduce-scatter")  # the tokens' ways to their experts


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="moe-tiny", help="an MoE preset")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--capacity", type=float, default=1.25, help="the dropping runs' capacity factor")
    p.add_argument("--d-model", type=int, default=None, help="the model's width (default: the preset's)")
    p.add_argument("--expert-width", type=int, default=None, help="an expert's hidden size (default: the preset's)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed steps per configuration per round")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds over all configurations")
    p.add_argument("--out", default="runs/bench-moe")
    return p


FORMER = "expert=8"  # where dropless is set against the capacity of S slots an expert


def configurations(name: str, capacity: float, d_model: int | None = None,
                   expert_width: int | None = None) -> list[tuple[str, object, str]]:
    """(label, model, mesh) of every run."""
    from jaxshard.errors import ConfigError
    from models import TransformerLM, get_preset
    from models.config import Positions

    cfg = get_preset(name)
    if not cfg.moe_experts:
        raise ConfigError(f"--model {name} has no MoE layers")
    if d_model is not None:
        step = cfg.n_heads * (2 if cfg.positions is Positions.ROPE else 1)  # RoPE: an even head width
        if d_model < step or d_model % step:
            raise ConfigError(f"--d-model must be a positive multiple of {step} ({name}'s {cfg.n_heads} heads"
                              f"{' of an even width, for RoPE' if step > cfg.n_heads else ''}); got {d_model}")
        cfg = cfg.replace(d_model=d_model, d_head=d_model // cfg.n_heads)
    if expert_width is not None:
        if expert_width < 1:
            raise ConfigError(f"--expert-width must be >= 1; got {expert_width}")
        cfg = cfg.replace(moe_d_mlp=expert_width)
    width = cfg.moe_d_mlp or cfg.d_mlp
    d_mlp = (cfg.moe_top_k + cfg.moe_shared_experts) * width
    dense = cfg.replace(name=f"{name} dense", moe_experts=0, d_mlp=d_mlp)
    runs = [(f"dense (d_mlp {d_mlp})", TransformerLM(dense), "data=8")]
    for factor, what in ((capacity, f"capacity {capacity:g}"), (0.0, "dropless")):
        model = TransformerLM(cfg.replace(moe_capacity_factor=factor))
        runs += [(f"moe, {what}", model, mesh) for mesh in MESHES]
    every = cfg.moe_experts / cfg.moe_top_k  # C = S: what dropless computed before
    runs.append((f"moe, capacity {every:g} (S slots)", TransformerLM(cfg.replace(moe_capacity_factor=every)), FORMER))
    return runs


def load_cell(max_violation: float | None) -> str:
    return "-" if max_violation is None else f"{1 + max_violation:.2f}"


def against_former(results: list[dict], experts: int) -> dict | None:
    """Dropless against capacity E/k (every expert S slots a sequence) on ``expert=8``: the
    ratios of the step times and of the compiled matmul FLOPs on the mean device; and, where
    each device holds one expert (E = 8), an estimate for the busiest device: the mean device's
    compiled FLOPs with their data-dependent part (the grouped kernel's loops) scaled by the
    last step's busiest expert's load over the mean (a mean over the layers)."""
    new = next((r for r in results if r["run"] == "moe, dropless" and r["mesh"] == FORMER), None)
    old = next((r for r in results if r["run"].endswith("(S slots)")), None)
    if new is None or old is None:
        return None
    w, old_flops = new["matmul_flops_per_device"], old["matmul_flops_per_device"]["compiled"]
    one_each = experts == 8 and new["moe_max_violation"] is not None
    busiest = w["compiled"] + w["data_dependent"] * new["moe_max_violation"] if one_each else None
    return {"step_time_ratio": new["step_s_median"] / old["step_s_median"],
            "flops_ratio_mean_device": w["compiled"] / old_flops,
            "flops_ratio_busiest_device_estimated": None if busiest is None else busiest / old_flops,
            "busiest_over_mean": None if new["moe_max_violation"] is None else 1 + new["moe_max_violation"]}


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    from jaxshard.cli import one_line_errors
    from jaxshard.errors import ConfigError

    with one_line_errors():
        if min(a.steps, a.rounds) < 1:
            raise ConfigError("--steps and --rounds must be >= 1")
        runtime.configure(runtime.RuntimeConfig(cpu_devices=8))
        import jax
        from tqdm import tqdm

        from bench import bench_one, rules_for, write_markdown

        from jaxshard.analysis import accounting

        runs = configurations(a.model, a.capacity, a.d_model, a.expert_width)
        for _, model, mesh in runs:  # every configuration can run, before any does
            rules_for(model, mesh, 0, False, a.batch_size, a.seq_len)
        os.makedirs(a.out, exist_ok=True)
        rounds: list[list[dict]] = [[] for _ in runs]
        t0 = time.perf_counter()
        with tqdm(total=len(runs) * a.rounds, desc="bench-moe", unit="run", file=sys.stderr) as bar:
            for _ in range(a.rounds):
                for i, (label, model, mesh) in enumerate(runs):
                    bar.set_postfix(run=label, mesh=mesh)
                    rounds[i].append(bench_one(model, mesh, 0, False, a.batch_size, a.seq_len, a.warmup, a.steps))
                    bar.update()
        results = []
        for (label, model, mesh), rs in zip(runs, rounds):
            medians = [r["step_s"]["median"] for r in rs]
            # (No fsdp here, and the gradients are all-reduced: the gathers and scatters are the tokens'.)
            a2a = [c for c in rs[0]["collectives"] if c["kind"] in EXCHANGE]
            by_kind = accounting.communication(model, rules_for(model, mesh, 0, False, a.batch_size, a.seq_len),
                                               a.batch_size, a.seq_len).by_kind()
            predicted = sum(by_kind.get(k, 0) for k in EXCHANGE)
            results.append({
                "run": label, "mesh": mesh, "params": model.n_params(), "active_params": model.n_active_params(),
                "step_s_median": statistics.median(medians), "step_s_rounds": medians,
                "tokens_per_s": a.batch_size * a.seq_len / statistics.median(medians),
                "params_opt_bytes_per_device": rs[0]["per_device_bytes"]["params"] + rs[0]["per_device_bytes"]["opt_state"],
                "exchange_bytes": sum(c["bytes"] for c in a2a), "exchange_bytes_predicted": predicted,
                "matmul_flops_per_device": rs[0]["matmul_flops_per_device"], "final_loss": rs[-1]["final_loss"],
                "moe_max_violation": rs[-1]["moe_max_violation"]})
        former = against_former(results, runs[-1][1].cfg.moe_experts)
        meta = {"backend": jax.default_backend(), "devices": jax.device_count(), "cpu_count": os.cpu_count(),
                "jax": jax.__version__, "model": a.model, "d_model": runs[-1][1].cfg.d_model,
                "expert_width": runs[-1][1].cfg.moe_d_mlp or runs[-1][1].cfg.d_mlp, "batch_size": a.batch_size, "seq_len": a.seq_len,
                "timed_steps": a.steps, "rounds": a.rounds, "wall_s": time.perf_counter() - t0}
        with open(os.path.join(a.out, "moe.json"), "w") as f:
            json.dump({"meta": meta, "runs": results, "dropless_against_s_slots": former}, f, indent=1)
        lines = ["| run | mesh | params (active) | step ms (median; rounds) | tokens/s | params + opt "
                 "KiB/device | tokens exchanged KiB/step (compiled / predicted) | matmul FLOPs / useful "
                 "| busiest expert / mean |",
                 "|" + "---|" * 9]
        for r in results:
            rounds_ms = ", ".join(f"{m * 1e3:.0f}" for m in r["step_s_rounds"])
            lines.append(f"| {r['run']} | `{r['mesh']}` | {r['params']:,} ({r['active_params']:,}) | "
                         f"{r['step_s_median'] * 1e3:.0f}; {rounds_ms} | {r['tokens_per_s']:,.0f} | "
                         f"{r['params_opt_bytes_per_device'] / 1024:,.0f} | {r['exchange_bytes'] / 1024:,.0f} / "
                         f"{r['exchange_bytes_predicted'] / 1024:,.0f} | "
                         f"{accounting.waste_cell(r['matmul_flops_per_device'])} | "
                         f"{load_cell(r['moe_max_violation'])} |")
        if former:
            busiest = former["flops_ratio_busiest_device_estimated"]
            lines.append(f"\nDropless against capacity {runs[-1][1].cfg.moe_capacity_factor:g} (S slots an expert) on "
                         f"`{FORMER}`: step time x{former['step_time_ratio']:.2f}; compiled matmul FLOPs "
                         f"x{former['flops_ratio_mean_device']:.2f} on the mean device" +
                         ("." if busiest is None else
                          f", about x{busiest:.2f} on the busiest (estimated: its expert "
                          f"{former['busiest_over_mean']:.2f}x the mean load)."))
        cfg = runs[-1][1].cfg
        write_markdown(a.out, "moe", meta, f"{a.model} (d_model {cfg.d_model}, experts of "
                       f"{cfg.moe_d_mlp or cfg.d_mlp}), global batch {a.batch_size} x {a.seq_len}", "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
