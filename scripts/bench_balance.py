"""MoE load balancing benchmark: the auxiliary loss against DeepSeek-V3's routing bias.

    python scripts/bench_balance.py                      # ~10 minutes on 2 CPU cores
    python scripts/bench_balance.py --steps 30 --out /tmp/balance

Trains the same MoE model from the same init on the same batches of the default corpus (the
Python standard library's source, byte tokens) on 8 fake CPU devices (``data=2,expert=4``), once
per ``--moe-balance`` mode: ``aux`` (the load-balancing loss, weight 0.01), ``bias`` (the
auxiliary-loss-free bias alone), ``both``; and ``none`` (neither) as the floor. The capacity
factor is 1, so an expert over its share drops tokens: the dropped fraction is what imbalance
costs. Records per step the train loss (the language-model loss, without auxiliary terms), the
dropped fraction and the max violation (E max_e f_e - 1: 0 at perfect balance), each averaged
over the MoE layers, and the validation loss every --eval-every steps. Writes balance.json and
balance.png to --out and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxshard import runtime  # noqa: E402

MODES = ("none", "aux", "bias", "both")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="moe-tiny")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--mesh", default="data=2,expert=4")
    p.add_argument("--capacity-factor", type=float, default=1.0)
    p.add_argument("--bias-rate", type=float, default=0.001, help="the bias's step (DeepSeek-V3's gamma)")
    p.add_argument("--batch-size", type=int, default=16, help="global batch in sequences")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-devices", type=int, default=8)
    p.add_argument("--out", default="docs/bench")
    return p


def model_for(cfg, mode: str, a):
    """``cfg`` balanced by ``mode`` ("none": no auxiliary loss and no bias)."""
    from models import TransformerLM

    changes = dict(moe_capacity_factor=a.capacity_factor)
    if mode == "none":
        changes |= dict(moe_balance="aux", moe_aux_coef=0.0)
    else:
        changes |= dict(moe_balance=mode, moe_bias_rate=a.bias_rate)
    return TransformerLM(cfg.replace(**changes))


def train(model, rules, optim_cfg, corpus, a) -> dict:
    import jax
    import numpy as np

    from jaxshard.data import corpus as data_lib
    from jaxshard.training.step import StepConfig, build_program

    B, L = a.batch_size, a.seq_len
    program = build_program(model, rules, optim_cfg, StepConfig(seed=a.seed))
    step = program.lower_step(B, L).compile()
    train_data, val_batches = data_lib.splits_for(program, corpus, B, L, a.seed, a.eval_batches)

    def validate(state) -> float:
        return float(np.mean(jax.device_get([program.eval(state.params, b) for b in val_batches])))

    state = program.init(a.seed)
    records, val = [], [{"step": 0, "val_loss": validate(state)}]
    t0 = time.perf_counter()
    for i in range(a.steps):
        batch = data_lib.to_global(train_data.batch_at(i * B), program.batch_sharding, (B, L))
        state, metrics = step(state, batch)
        records.append({k: float(v) for k, v in jax.device_get(metrics).items()})
        if (i + 1) % a.eval_every == 0 or i + 1 == a.steps:
            val.append({"step": i + 1, "val_loss": validate(state)})
            print(f"  step {i + 1}: loss {records[-1]['loss']:.4f}, dropped {records[-1]['moe_dropped']:.3f}, "
                  f"val {val[-1]['val_loss']:.4f}", file=sys.stderr, flush=True)
    ffn = program.saved(state).params["moe_blocks"]["ffn"]
    bias = np.asarray(ffn["router_bias"]).tolist() if "router_bias" in ffn else None
    tail = slice(-a.eval_every, None)
    return {"train_loss": [r["loss"] for r in records], "dropped": [r["moe_dropped"] for r in records],
            "max_violation": [r["moe_max_violation"] for r in records],
            "load_balance": [r["moe_load_balance"] for r in records], "val": val,
            "final_val_loss": val[-1]["val_loss"],
            "tail_train_loss": float(np.mean([r["loss"] for r in records[tail]])),
            "tail_dropped": float(np.mean([r["moe_dropped"] for r in records[tail]])),
            "tail_max_violation": float(np.mean([r["moe_max_violation"] for r in records[tail]])),
            "final_bias": bias, "train_s": time.perf_counter() - t0}


def table(runs: dict[str, dict], tail: int) -> str:
    lines = [f"| --moe-balance | dropped fraction (mean of the last {tail} steps) | max violation | "
             f"train loss (last {tail}) | final val loss |", "|---|---|---|---|---|"]
    for mode, r in runs.items():
        name = "none (no aux loss, no bias)" if mode == "none" else mode
        lines.append(f"| {name} | {r['tail_dropped']:.4f} | {r['tail_max_violation']:.3f} | "
                     f"{r['tail_train_loss']:.4f} | {r['final_val_loss']:.4f} |")
    return "\n".join(lines)


def plot(runs: dict[str, dict], meta: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    window = min(10, meta["steps"])
    smooth = lambda v: np.convolve(v, np.ones(window) / window, mode="valid")  # noqa: E731
    for (mode, r), color in zip(runs.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        steps = np.arange(1, len(r["train_loss"]) + 1)[window - 1:]
        axes[0].plot(steps, smooth(r["train_loss"]), color=color, lw=1.4, label=f"{mode} train")
        axes[0].plot([v["step"] for v in r["val"]], [v["val_loss"] for v in r["val"]], "o--", color=color, ms=3,
                     label=f"{mode} validation")
        axes[1].plot(steps, smooth(r["dropped"]), color=color, lw=1.4, label=mode)
        axes[2].plot(steps, smooth(r["max_violation"]), color=color, lw=1.4, label=mode)
    axes[0].set_ylim(top=min(axes[0].get_ylim()[1], 3.5))
    for ax, title in zip(axes, ("loss (nats per byte)", "dropped fraction of choices (capacity 1)",
                                "max violation E max f_e - 1")):
        ax.set_xlabel("step")
        ax.set_title(f"{title}, {window}-step mean", fontsize=10)
        ax.legend(fontsize=7, ncol=2 if ax is axes[0] else 1)
    fig.suptitle(f"{meta['model']} on {meta['mesh']}: load balancing by aux loss or routing bias", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    from jaxshard.cli import one_line_errors
    from jaxshard.errors import ConfigError

    with one_line_errors():
        modes = [m for m in a.modes.split(",") if m]
        if not modes or any(m not in MODES for m in modes):
            raise ConfigError(f"--modes takes a comma-separated subset of {', '.join(MODES)}, got {a.modes!r}")
        if min(a.steps, a.eval_every, a.eval_batches) < 1:
            raise ConfigError("--steps, --eval-every and --eval-batches must be >= 1")
        runtime.configure(runtime.RuntimeConfig(cpu_devices=a.cpu_devices))
        import jax

        from jaxshard.data import corpus as data_lib
        from jaxshard.mesh import build_mesh
        from jaxshard.rules import ShardingRules
        from jaxshard.training.optim import OptimConfig
        from jaxshard.training.step import check_batch
        from models import get_preset

        cfg = get_preset(a.model)
        if not cfg.moe_experts:
            raise ConfigError(f"--model {a.model} has no MoE layers")
        rules = ShardingRules(build_mesh(a.mesh))
        check_batch(rules, a.batch_size, a.seq_len, 1)
        optim_cfg = OptimConfig(lr=a.lr, warmup_steps=min(20, a.steps // 10), total_steps=a.steps)
        t0 = time.perf_counter()
        corpus = data_lib.load_corpus(data_lib.DataConfig())
        if corpus.vocab_size > cfg.vocab_size or a.seq_len > cfg.max_seq_len:
            raise ConfigError(f"--model {a.model} does not fit the corpus' vocabulary or --seq-len {a.seq_len}")
        runs = {}
        for mode in modes:
            print(f"--moe-balance {mode}: training {a.steps} steps ...", file=sys.stderr, flush=True)
            runs[mode] = train(model_for(cfg, mode, a), rules, optim_cfg, corpus, a)
        meta = {"backend": jax.default_backend(), "devices": jax.device_count(), "cpu_count": os.cpu_count(),
                "jax": jax.__version__, "model": a.model, "mesh": a.mesh, "data": corpus.name,
                "capacity_factor": a.capacity_factor, "bias_rate": a.bias_rate, "aux_coef": cfg.moe_aux_coef,
                "batch_size": a.batch_size, "seq_len": a.seq_len, "steps": a.steps, "seed": a.seed,
                "optim": {"lr": optim_cfg.lr, "warmup_steps": optim_cfg.warmup_steps,
                          "total_steps": optim_cfg.total_steps, "grad_clip": optim_cfg.grad_clip},
                "eval_every": a.eval_every, "eval_batches": a.eval_batches, "wall_s": time.perf_counter() - t0}
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "balance.json"), "w") as f:
            json.dump({"meta": meta, "runs": runs}, f, indent=1)
        plot(runs, meta, os.path.join(a.out, "balance.png"))
        print(table(runs, min(a.eval_every, a.steps)))
        print(f"\nwrote {a.out}/balance.json, balance.png in {meta['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
