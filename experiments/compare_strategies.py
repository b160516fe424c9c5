"""One page: the same model under DDP, ZeRO-1/2/3, TP and TP+SP -- what each device holds and sends.

    python experiments/compare_strategies.py --model small --cpu-devices 8

Compiles each strategy's training step (nothing is trained) and prints, per device: params,
gradients and optimizer state, saved activations, XLA's argument bytes, and the collectives
in the compiled step by kind and mesh axis, next to the textbook volume of the strategy; then
the classic bytes-per-parameter table (DDP, ZeRO-1/2/3, FSDP; float32 or 2-byte params; with
and without ZeRO-Offload), the textbook's next to the live arrays'.
"""

from __future__ import annotations

import os
import sys

# The repository root instead of this folder, whose inspect.py would shadow the standard library's.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxshard import cli, runtime  # noqa: E402

# name -> (mesh over N devices, zero, sequence parallel, the textbook, with P = the params' bytes)
LESSONS = {
    "DDP": ("data={n}", 0, False,
            "every device holds everything; gradients all-reduced: sends 2(n-1)/n P"),
    "ZeRO-1": ("data={n}", 1, False,
               "optimizer state 1/n; gradients all-reduced, updated params all-gathered: 3(n-1)/n P "
               "(the ZeRO paper's 2(n-1)/n P reduce-scatters the gradients: that is ZeRO-2 here)"),
    "ZeRO-2": ("data={n}", 2, False,
               "gradients 1/n too: reduce-scatter of gradients + all-gather of params, 2(n-1)/n P"),
    "ZeRO-3/FSDP": ("fsdp={n}", 0, False,
                    "params 1/n too: each layer all-gathered for compute (kept for backward, or "
                    "gathered again under remat) + gradient reduce-scatter, 2(n-1)/n P (3 with remat)"),
    "TP": ("{dp}tensor={t}", 0, False,
           "weights 1/n (heads, MLP, vocab split); per layer an all-reduce of activations after "
           "attention and MLP, forward and backward"),
    "TP+SP": ("{dp}tensor={t}", 0, True,
              "as TP, each all-reduce now a reduce-scatter + all-gather (same bytes sent); the "
              "residual stream's activations are 1/n too"),
}


def main(argv: list[str] | None = None) -> int:
    p = cli.Parser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--devices", type=int, default=8, help="devices each strategy uses")
    p.add_argument("--tensor", type=int, default=None,
                   help="tensor size for TP (default: the largest that divides the devices and the "
                        "model's heads, MLP and vocab; data parallelism takes the rest)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--cpu-devices", type=int, default=8)
    p.add_argument("--out", default=None, help="also write the page as markdown here")
    with cli.one_line_errors():
        a = p.parse_args(argv)
        runtime.configure(runtime.RuntimeConfig(cpu_devices=a.cpu_devices))
        import jax

        from jaxshard.analysis import accounting, inspect
        from jaxshard.errors import ConfigError
        from jaxshard.mesh import build_mesh
        from jaxshard.rules import ShardingRules, Strategy
        from jaxshard.training.optim import OptimConfig
        from jaxshard.training.step import StepConfig, build_program
        from models import TransformerLM, get_preset

        if a.devices > jax.device_count():
            raise ConfigError(f"--devices {a.devices} but only {jax.device_count()} are available")
        model = TransformerLM(get_preset(a.model))
        P = 4 * model.n_params()
        lines = [f"# {model.cfg.name}: {model.n_params():,} params (P = {P / 2**20:,.2f} MiB in float32), "
                 f"batch {a.batch_size} x {a.seq_len}, {a.devices} devices", ""]
        rows = ["| strategy | mesh | sequences/device | params | grads | Adam | activations | "
                "XLA argument | compiled collectives (kind over axes: MiB per step) | sent MiB (ring) |",
                "|" + "---|" * 10]
        notes = []
        mib = 2**20
        cfg = model.cfg
        t = a.tensor or max(d for d in range(1, a.devices + 1) if a.devices % d == 0 and
                            cfg.n_heads % d == 0 and cfg.d_mlp % d == 0 and cfg.padded_vocab % d == 0)
        if a.devices % t:
            raise ConfigError(f"--tensor {t} does not divide --devices {a.devices}")
        dp = f"data={a.devices // t}," if a.devices > t else ""
        for name, (mesh_t, zero, sp, textbook) in LESSONS.items():
            mesh = mesh_t.format(n=a.devices, t=t, dp=dp)
            rules = ShardingRules(build_mesh(mesh, jax.devices()[:a.devices]),
                                  Strategy(zero=zero, sequence_parallel=sp))
            rules.check_model(model.param_axes(), model.abstract_params())
            program = build_program(model, rules, OptimConfig(), StepConfig())
            compiled = program.lower_step(a.batch_size, a.seq_len).compile()
            v = inspect.verify(model, program, compiled, a.batch_size, a.seq_len)
            mem = accounting.memory(model, rules, a.batch_size, a.seq_len)
            found = inspect.compiled_collectives(compiled, rules.mesh)
            by = {}
            for c in found:
                by[(c.kind, c.axes)] = by.get((c.kind, c.axes), 0) + c.bytes * c.executions
            sends = ", ".join(f"{k} over {','.join(ax)}: {b / mib:,.2f}" for (k, ax), b in sorted(by.items())
                              if b >= 1024) or "none"
            sent = sum(c.sent_bytes * c.executions for c in found)
            per_device = a.batch_size // rules.size(rules.batch_axes)
            rows.append(f"| {name} | `{mesh}` | {per_device} | {mem.params / mib:,.2f} | {mem.grads / mib:,.2f} | "
                        f"{mem.opt_state / mib:,.2f} | {mem.activations / mib:,.2f} | "
                        f"{v.memory[2][2] / mib:,.2f} | {sends} | {sent / mib:,.2f} |")
            notes.append(f"- **{name}** (`{mesh}`): {textbook}." + (
                "" if not v.flags else " Verifier: " + "; ".join(v.flags)))
        lines += rows + ["", "Memory in MiB per device (params, gradients and Adam's two moments in "
                         "float32; activations saved for the backward pass, estimated). Collectives "
                         "read from the compiled HLO; 'sent' is what one device sends under the ring "
                         "algorithm.", "", *notes]
        lines += ["", f"## Bytes per parameter per device ({a.devices} devices)", "",
                  "Params + gradients + optimizer state (Adam's moments, and the float32 master copy "
                  "of 2-byte params), the textbook's next to the live arrays: the state "
                  "created in its layout (init's) and gradient-shaped arrays in the layout the step "
                  "reduces the gradients to.", "",
                  "| strategy | params | offload | textbook (params + grads + optimizer) | "
                  "textbook device | measured device | textbook host | measured host |",
                  "|" + "---|" * 8]
        for name in inspect.CLASSIC_STRATEGIES:
            for dtype in ("float32", "bfloat16"):
                for r in inspect.bytes_per_param(model, name, a.devices, dtype):
                    lines.append(f"| {name} | {dtype} | {','.join(r.offload) or '-'} | "
                                 f"{r.predicted.formula} | {r.predicted.device:.2f} | {r.device:.2f} | "
                                 f"{r.predicted.host:.2f} | {r.host:.2f} |")
        page = "\n".join(lines)
        print(page)
        if a.out:
            with open(a.out, "w") as f:
                f.write(page + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
