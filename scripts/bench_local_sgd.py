"""Local SGD benchmark: train loss, validation loss and communication for --sync-every H.

    python scripts/bench_local_sgd.py                    # ~4 minutes on 2 CPU cores
    python scripts/bench_local_sgd.py --steps 20 --sync-every 1,4 --out /tmp/local-sgd

Trains the same model from the same init on the same batches of the default corpus (the
Python standard library's source, byte tokens) on 8 fake CPU devices (``data=8``), once per
H: H = 1 is DDP; H > 1 averages the replicas every H steps. Records the train loss of every
step (the mean over the whole batch, every replica's rows at its own params), the validation
loss of the replicas' average every --eval-every steps, the spread between replicas, and the
step times of synchronising and local steps. Communication comes from the compiled steps
(collective buffer bytes per device): a synchronising step's all-reduces (params, both Adam
moments, gradients) against a local step's (scalars only), with and without the
``replica_spread`` metric's all-reduce, and GSPMD DDP's for reference. Writes local_sgd.json
and local_sgd.png to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxshard import runtime  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--sync-every", default="1,4,16", help="comma-separated values of H")
    p.add_argument("--batch-size", type=int, default=32, help="global batch in sequences")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-devices", type=int, default=8, help="the data axis: one replica per device")
    p.add_argument("--out", default="docs/bench")
    return p


def collective_bytes(program, batch: int, seq: int, mesh) -> dict[str, int]:
    """Collective buffer bytes per device of a compiled step: every step's, and those that
    only a synchronising step runs (the branch of the step's conditional)."""
    from jaxshard.analysis.inspect import compiled_collectives

    found = compiled_collectives(program.lower_step(batch, seq).compile(), mesh)
    local = sum(c.bytes * c.executions for c in found if not c.conditional)
    return {"local": local, "sync": local + sum(c.bytes * c.executions for c in found if c.conditional)}


def train(model, rules, optim_cfg, sync_every: int, corpus, a) -> dict:
    import jax
    import numpy as np

    from jaxshard.data import corpus as data_lib
    from jaxshard.training.local_sgd import build_local_sgd_program
    from jaxshard.training.step import StepConfig

    B, L = a.batch_size, a.seq_len
    program = build_local_sgd_program(model, rules, optim_cfg, StepConfig(seed=a.seed), sync_every)
    t0 = time.perf_counter()
    step = program.lower_step(B, L).compile()
    compile_s = time.perf_counter() - t0
    train_data, val_batches = data_lib.splits_for(program, corpus, B, L, a.seed, a.eval_batches)

    def validate(state) -> float:
        return float(np.mean(jax.device_get([program.eval(state.params, b) for b in val_batches])))

    state = program.init(a.seed)
    records, val = [], [{"step": 0, "val_loss": validate(state)}]
    for i in range(a.steps):
        batch = data_lib.to_global(train_data.batch_at(i * B), program.batch_sharding, (B, L))
        t = time.perf_counter()
        state, metrics = step(state, batch)
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}  # waits for the step
        records.append({"step": i + 1, **m, "step_time_s": time.perf_counter() - t})
        if (i + 1) % a.eval_every == 0 or i + 1 == a.steps:
            val.append({"step": i + 1, "val_loss": validate(state)})
    timed = records[1:]  # the first step pays for the executable's first run
    sync_times = [r["step_time_s"] for r in timed if r["synced"]]
    local_times = [r["step_time_s"] for r in timed if not r["synced"]]
    return {
        "sync_every": sync_every, "compile_s": compile_s,
        "train_loss": [r["loss"] for r in records], "grad_norm": [r["grad_norm"] for r in records],
        "replica_spread": [r["replica_spread"] for r in records], "lr": [r["lr"] for r in records],
        "val": val, "final_train_loss": records[-1]["loss"],
        # The train loss is noisy from batch to batch: the mean of the last eval interval too.
        "final_train_loss_mean": float(np.mean([r["loss"] for r in records[-a.eval_every:]])),
        "final_val_loss": val[-1]["val_loss"],
        "step_s_sync_median": statistics.median(sync_times) if sync_times else None,
        "step_s_local_median": statistics.median(local_times) if local_times else None,
        "bytes": collective_bytes(program, B, L, rules.mesh),
        "bytes_without_spread": collective_bytes(
            build_local_sgd_program(model, rules, optim_cfg, StepConfig(seed=a.seed), sync_every,
                                    measure_spread=False), B, L, rules.mesh),
    }


def per_step(bytes_: dict[str, int], H: int) -> float:
    """Mean collective bytes per step over a period of H steps (one synchronising)."""
    return (bytes_["sync"] + (H - 1) * bytes_["local"]) / H


def _size(n: float) -> str:
    return f"{n / 1024:,.1f} KiB" if n >= 1024 else f"{n:.0f} B"


def table(runs: list[dict]) -> str:
    lines = ["| H | final train loss (last / mean of last interval) | final val loss | collectives per "
             "device: sync step / local step / mean per step | the same with the replica_spread metric | "
             "step ms: sync / local |", "|" + "---|" * 6]
    for r in runs:
        H = r["sync_every"]
        ms = " / ".join("-" if x is None else f"{x * 1e3:.0f}"
                        for x in (r["step_s_sync_median"], r["step_s_local_median"]))
        cells = [f"{_size(b['sync'])} / {'-' if H == 1 else _size(b['local'])} / {_size(per_step(b, H))}"
                 for b in (r["bytes_without_spread"], r["bytes"])]
        lines.append(f"| {H} | {r['final_train_loss']:.4f} / {r['final_train_loss_mean']:.4f} | "
                     f"{r['final_val_loss']:.4f} | {cells[0]} | {cells[1]} | {ms} |")
    return "\n".join(lines)


def plot(runs: list[dict], meta: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [1.6, 1]})
    window = min(10, meta["steps"])
    for r, color in zip(runs, plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        loss = np.array(r["train_loss"])
        smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
        steps = np.arange(1, len(loss) + 1)
        ax.plot(steps, loss, color=color, alpha=0.2, lw=0.8)
        ax.plot(steps[window - 1:], smooth, color=color, lw=1.6,
                label=f"H={r['sync_every']} train ({window}-step mean)")
        ax.plot([v["step"] for v in r["val"]], [v["val_loss"] for v in r["val"]], "o--", color=color, ms=4,
                label=f"H={r['sync_every']} validation (replicas' average)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_ylim(top=min(ax.get_ylim()[1], 3.5))
    ax.set_title(f"{meta['model']} on data={meta['devices']}: loss, averaging every H steps")
    ax.legend(fontsize=7, ncol=2)
    labels = [f"H={r['sync_every']}" for r in runs]
    x = np.arange(len(runs))
    w = [r["bytes_without_spread"] for r in runs]
    kib = lambda v: np.array(v) / 1024  # noqa: E731
    bx.bar(x - 0.27, kib([b["sync"] for b in w]), 0.27, label="synchronising step")
    bx.bar(x, kib([b["local"] if r["sync_every"] > 1 else 0 for b, r in zip(w, runs)]), 0.27, label="local step")
    bx.bar(x + 0.27, kib([per_step(b, r["sync_every"]) for b, r in zip(w, runs)]), 0.27, label="mean per step")
    bx.axhline(meta["ddp_bytes"] / 1024, color="k", ls=":", lw=1, label="GSPMD DDP step")
    bx.set_xticks(x, labels)
    bx.set_ylabel("collective KiB per device (compiled)")
    bx.set_title("Communication per step (without the spread metric)")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    from jaxshard.cli import int_list, one_line_errors
    from jaxshard.errors import ConfigError

    with one_line_errors():
        values = int_list(a.sync_every, "--sync-every")
        if not values or min(a.steps, a.eval_every, a.eval_batches) < 1:
            raise ConfigError("--sync-every needs a value; --steps, --eval-every and --eval-batches must be >= 1")
        runtime.configure(runtime.RuntimeConfig(cpu_devices=a.cpu_devices))
        import jax

        from jaxshard.data import corpus as data_lib
        from jaxshard.mesh import build_mesh
        from jaxshard.rules import ShardingRules
        from jaxshard.training.local_sgd import check
        from jaxshard.training.optim import OptimConfig
        from jaxshard.training.step import StepConfig, build_program, check_batch
        from models import TransformerLM, get_preset

        model = TransformerLM(get_preset(a.model))
        rules = ShardingRules(build_mesh(f"data={a.cpu_devices}"))
        check_batch(rules, a.batch_size, a.seq_len, 1)
        for H in values:  # every run can start, before any does
            check(model, rules, StepConfig(), H)
        optim_cfg = OptimConfig(lr=a.lr, warmup_steps=min(20, a.steps // 10), total_steps=a.steps)
        t0 = time.perf_counter()
        corpus = data_lib.load_corpus(data_lib.DataConfig())
        if corpus.vocab_size > model.cfg.vocab_size or a.seq_len > model.cfg.max_seq_len:
            raise ConfigError(f"--model {a.model} does not fit the corpus' vocabulary or --seq-len {a.seq_len}")
        ddp = build_program(model, rules, optim_cfg, StepConfig(seed=a.seed))
        ddp_bytes = collective_bytes(ddp, a.batch_size, a.seq_len, rules.mesh)["local"]
        runs = []
        for H in values:
            print(f"H={H}: training {a.steps} steps ...", file=sys.stderr, flush=True)
            runs.append(train(model, rules, optim_cfg, H, corpus, a))
        meta = {"backend": jax.default_backend(), "devices": jax.device_count(), "cpu_count": os.cpu_count(),
                "jax": jax.__version__, "model": a.model, "n_params": model.n_params(), "data": corpus.name,
                "batch_size": a.batch_size, "seq_len": a.seq_len, "steps": a.steps, "seed": a.seed,
                "optim": {"lr": optim_cfg.lr, "warmup_steps": optim_cfg.warmup_steps,
                          "total_steps": optim_cfg.total_steps, "grad_clip": optim_cfg.grad_clip},
                "eval_every": a.eval_every, "eval_batches": a.eval_batches, "ddp_bytes": ddp_bytes,
                "params_bytes": 4 * model.n_params(), "wall_s": time.perf_counter() - t0,
                "bytes_note": "collective buffer bytes per device of the compiled step; 'local' is what "
                              "every step runs, 'sync' adds the conditionals' branches (the local "
                              "branch's 4-byte grad-norm mean is counted there, not in 'local')"}
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "local_sgd.json"), "w") as f:
            json.dump({"meta": meta, "runs": runs}, f, indent=1)
        plot(runs, meta, os.path.join(a.out, "local_sgd.png"))
        print(table(runs))
        print(f"\nGSPMD DDP step: {ddp_bytes / 1024:,.1f} KiB; params {meta['params_bytes'] / 1024:,.1f} KiB. "
              f"wrote {a.out}/local_sgd.json, local_sgd.png in {meta['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
