"""Rank meshes and strategies for a model on a cluster, then confirm the top one by compiling;
or, with --mesh, evaluate one given configuration exactly.

    python experiments/plan.py --model llama-1b --devices 64 --device-memory 80GB --hosts 8 --device h100
    python experiments/plan.py --family gpt2 --n-layers 24 --d-model 2304 --n-heads 24 --d-mlp 9216 \
        --vocab-size 51200 --devices 32 --hosts 4 --device a100-80gb --mesh data=32 --batch 512 \
        --remat full --json plan.json

Ranking prints the plans (memory per device, step time by the time model --
jaxshard/analysis/timing.py -- split into compute and the communication it does not hide,
which axes cross hosts), the reasoning in the classic terms, and -- where the
device count allows it (``--confirm-limit``) -- compiles the top plan's step for the real model
on that many fake CPU devices and checks the prediction against XLA. A given --mesh prints its
step time by part from the time model (jaxshard/analysis/timing.py) and its memory by part;
--json writes the prediction (of the given plan, or of the top one).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

# The repository root instead of this folder, whose inspect.py would shadow the standard library's.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxshard import cli  # noqa: E402
from jaxshard.analysis.devices import KNOWN_DEVICES  # noqa: E402
from jaxshard.analysis.timing import SOFTWARE  # noqa: E402
from jaxshard.errors import ConfigError  # noqa: E402


SHAPE = ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_mlp", "vocab_size")
GIVEN = ("microbatches", "virtual_stages", "remat", "zero", "sequence_parallel", "context_parallel")


def parser() -> argparse.ArgumentParser:
    p = cli.Parser(description=__doc__.split("\n")[0],
                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="preset name (or --family with the shape flags)")
    p.add_argument("--family", default=None, choices=("gpt2", "llama"),
                   help="a model of this family with the shape the flags below give, instead of a preset")
    for name, what in zip(SHAPE, ("layers", "width of the residual stream", "attention heads",
                                  "key/value heads (default: --n-heads)", "MLP hidden width", "vocabulary")):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"{what} (overrides the preset's)")
    p.add_argument("--devices", type=int, required=True, help="accelerators in all")
    p.add_argument("--hosts", type=int, default=1, help="hosts they are spread over (evenly)")
    p.add_argument("--device", default=None, help=", ".join(KNOWN_DEVICES))
    p.add_argument("--device-memory", default=None, help="memory per device, e.g. 80GB (overrides --device's)")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense peak per device (overrides --device's)")
    p.add_argument("--intra-bw", type=float, default=None, help="GB/s per device within a host")
    p.add_argument("--inter-bw", type=float, default=None, help="GB/s per device between hosts")
    p.add_argument("--hbm-bw", type=float, default=None, help="HBM GB/s per device (overrides --device's)")
    p.add_argument("--software", default="jaxshard", choices=tuple(SOFTWARE),
                   help="whose kernels and overlap the time model prices (see jaxshard/analysis/timing.py)")
    p.add_argument("--batch", type=int, default=None, help="global batch in sequences (default: 1 per device)")
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's max, at most 2048")
    p.add_argument("--vocab-multiple", type=int, default=None,
                   help="pad the vocab to a multiple of N (so tensor parallelism can split it)")
    p.add_argument("--compute-dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--top", type=int, default=10, help="plans to list")
    p.add_argument("--confirm-limit", type=int, default=16,
                   help="compile the top (or given) plan on fake CPU devices if --devices is at most this (0: never)")
    g = p.add_argument_group("one given configuration (with --mesh)")
    g.add_argument("--mesh", default=None, help="evaluate this layout instead of ranking: AXIS=SIZE,... "
                                                "outermost first (devices fill hosts in this order)")
    g.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage over the data axis")
    g.add_argument("--sequence-parallel", action="store_true", help="with tensor > 1")
    g.add_argument("--context-parallel", default="ring", choices=("ring", "ulysses"),
                   help="with sequence > 1: ring (not priced: XLA's blocks) or ulysses (the dense kernel)")
    g.add_argument("--microbatches", type=int, default=1,
                   help="a pipeline's microbatches (stage axis), or gradient accumulation without one")
    g.add_argument("--virtual-stages", type=int, default=1, help="interleaved: layer chunks per stage")
    g.add_argument("--remat", default="none", help="recompute policy (none, full, dots, selective, ...)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write the prediction of the given (or top) plan: step_s, tokens_per_s_per_device, "
                        "model_tflops_per_device, memory, time")
    return p


def build_model(a: argparse.Namespace):
    """The preset with the shape flags' overrides, or --family's model of that shape."""
    from models import TransformerLM, get_preset
    from models.presets import of_shape

    shape = {k: getattr(a, k) for k in SHAPE if getattr(a, k) is not None}
    if a.model and a.family:
        raise ConfigError("--model and --family both name the model: give one")
    if not (a.model or a.family):
        raise ConfigError("give --model PRESET, or --family with the shape flags")
    cfg = of_shape(a.family, a.seq_len or 2048, **shape) if a.family else get_preset(a.model).with_shape(**shape)
    if a.vocab_multiple is not None:
        cfg = cfg.replace(vocab_multiple=a.vocab_multiple)
    return TransformerLM(cfg, remat=a.remat)


def main(argv: list[str] | None = None) -> int:
    with cli.one_line_errors():
        a = parser().parse_args(argv)
        defaults = parser().parse_args(["--devices", "1"])
        if a.mesh is None:
            given = [f"--{k.replace('_', '-')}" for k in GIVEN if getattr(a, k) != getattr(defaults, k)]
            if given:
                raise ConfigError(f"{', '.join(given)}: for one given configuration, with --mesh")
        confirm = 0 < a.devices <= a.confirm_limit
        from jaxshard import runtime

        runtime.configure(runtime.RuntimeConfig(cpu_devices=a.devices if confirm else None,
                                                platform="cpu" if confirm else None))
        from jaxshard.analysis import devices, planner, timing

        if a.inter_bw is not None and a.hosts == 1:
            raise ConfigError("--inter-bw prices the links between hosts; --hosts is 1")
        device = devices.device_spec(
            a.device, memory=devices.parse_bytes(a.device_memory) if a.device_memory else None,
            peak_tflops=a.peak_tflops, intra_gbs=a.intra_bw, inter_gbs=a.inter_bw, hbm_gbs=a.hbm_bw)
        software = timing.SOFTWARE[a.software]
        model = build_model(a)
        model_cfg = model.cfg
        batch = a.devices if a.batch is None else a.batch
        a.seq_len = min(2048, model_cfg.max_seq_len) if a.seq_len is None else a.seq_len
        name = a.model or model_cfg.name
        if a.mesh is not None:
            return _given(a, model, device, batch, name, planner, software, confirm)
        plans = planner.plan(model, a.devices, device, batch, a.seq_len, hosts=a.hosts,
                             compute_dtype=a.compute_dtype, software=software)
        print(f"{name}: {model.n_params():,} params on {a.devices} x {device.name} "
              f"({device.memory / 1e9:g} GB) in {a.hosts} host(s); batch {batch} x {a.seq_len}, "
              f"{a.compute_dtype}; step times by the time model, priced as {a.software}\n")
        print(planner.format_plans(plans[:a.top], device))
        print()
        for line in planner.explain(model, plans, device, a.hosts, a.compute_dtype):
            print(f"- {line}")
        top = next((p for p in plans if p.fits), None)
        if top is not None and a.json:
            _write(a.json, planner.prediction(model, top, device, batch, a.seq_len))
        if top is not None and confirm:
            print()
            print(planner.confirm(model, top, batch, a.seq_len))
        return 0 if top is not None else 1


def _given(a, model, device, batch, name, planner, software, confirm) -> int:
    """--mesh: one configuration, its memory and its time by part."""
    from jaxshard.mesh import MeshSpec
    from jaxshard.rules import Strategy

    spec = MeshSpec.parse(a.mesh)
    mesh = {str(axis): size for axis, size in spec.axes}
    if -1 in mesh.values() or math.prod(mesh.values()) != a.devices:
        raise ConfigError(f"--mesh {a.mesh} must lay out exactly --devices {a.devices} (no -1)")
    strategy = Strategy(zero=a.zero, sequence_parallel=a.sequence_parallel, context_parallel=a.context_parallel)
    plan = planner.given(model, mesh, strategy, device, batch, a.seq_len, hosts=a.hosts,
                         compute_dtype=a.compute_dtype, microbatches=a.microbatches,
                         virtual_stages=a.virtual_stages, software=software)
    out = planner.prediction(model, plan, device, batch, a.seq_len)
    print(f"{name}: {model.n_params():,} params on --mesh {a.mesh} ({a.devices} x {device.name}, {a.hosts} "
          f"host(s)); batch {batch} x {a.seq_len}, {a.compute_dtype}, remat {model.remat}, priced as {a.software}")
    print(planner.format_given(out, plan.time))
    if a.json:
        _write(a.json, out)
    if confirm:
        print()
        print(planner.confirm(model, plan, batch, a.seq_len))
    return 0 if plan.fits else 1


def _write(path: str, prediction: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(prediction, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
