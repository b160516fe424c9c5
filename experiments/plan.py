"""Rank meshes and strategies for a model on a cluster, then confirm the top one by compiling.

    python experiments/plan.py --model llama-1b --devices 64 --device-memory 80GB --hosts 8 --device h100

Prints the ranked plans (memory per device, predicted step time split into compute and
communication, which axes cross hosts), the reasoning in the classic terms, and -- where the
device count allows it (``--confirm-limit``) -- compiles the top plan's step for the real model
on that many fake CPU devices and checks the prediction against XLA.
"""

from __future__ import annotations

import argparse
import os
import sys

# The repository root instead of this folder, whose inspect.py would shadow the standard library's.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxshard import cli  # noqa: E402
from jaxshard.errors import ConfigError  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = cli.Parser(description=__doc__.split("\n")[0],
                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="preset name")
    p.add_argument("--devices", type=int, required=True, help="accelerators in all")
    p.add_argument("--hosts", type=int, default=1, help="hosts they are spread over (evenly)")
    p.add_argument("--device", default=None, help="h100, h200, a100-80gb, a100-40gb, v100")
    p.add_argument("--device-memory", default=None, help="memory per device, e.g. 80GB (overrides --device's)")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense peak per device (overrides --device's)")
    p.add_argument("--intra-bw", type=float, default=None, help="GB/s per device within a host")
    p.add_argument("--inter-bw", type=float, default=None, help="GB/s per device between hosts")
    p.add_argument("--batch", type=int, default=None, help="global batch in sequences (default: 1 per device)")
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's max, at most 2048")
    p.add_argument("--vocab-multiple", type=int, default=None,
                   help="pad the vocab to a multiple of N (so tensor parallelism can split it)")
    p.add_argument("--compute-dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--mfu", type=float, default=0.5, help="assumed fraction of peak the matmuls reach")
    p.add_argument("--top", type=int, default=10, help="plans to list")
    p.add_argument("--confirm-limit", type=int, default=16,
                   help="compile the top plan on fake CPU devices if --devices is at most this (0: never)")
    return p


def main(argv: list[str] | None = None) -> int:
    with cli.one_line_errors():
        a = parser().parse_args(argv)
        confirm = 0 < a.devices <= a.confirm_limit
        from jaxshard import runtime

        runtime.configure(runtime.RuntimeConfig(cpu_devices=a.devices if confirm else None,
                                                platform="cpu" if confirm else None))
        from jaxshard.analysis import devices, planner
        from models import TransformerLM, get_preset

        if not 0 < a.mfu <= 1:
            raise ConfigError(f"--mfu must be in (0, 1], got {a.mfu}")
        if a.inter_bw is not None and a.hosts == 1:
            raise ConfigError("--inter-bw prices the links between hosts; --hosts is 1")
        device = devices.device_spec(
            a.device, memory=devices.parse_bytes(a.device_memory) if a.device_memory else None,
            peak_tflops=a.peak_tflops, intra_gbs=a.intra_bw, inter_gbs=a.inter_bw)
        model_cfg = get_preset(a.model)
        if a.vocab_multiple is not None:
            model_cfg = model_cfg.replace(vocab_multiple=a.vocab_multiple)
        model = TransformerLM(model_cfg)
        batch = a.devices if a.batch is None else a.batch
        a.seq_len = min(2048, model_cfg.max_seq_len) if a.seq_len is None else a.seq_len
        plans = planner.plan(model, a.devices, device, batch, a.seq_len, hosts=a.hosts,
                             compute_dtype=a.compute_dtype, mfu=a.mfu)
        print(f"{a.model}: {model.n_params():,} params on {a.devices} x {device.name} "
              f"({device.memory / 1e9:g} GB) in {a.hosts} host(s); batch {batch} x {a.seq_len}, "
              f"{a.compute_dtype}, assumed MFU {a.mfu:g}\n")
        print(planner.format_plans(plans[:a.top], device))
        print()
        for line in planner.explain(model, plans, device, a.hosts, a.compute_dtype):
            print(f"- {line}")
        top = next((p for p in plans if p.fits), None)
        if top is not None and confirm:
            print()
            print(planner.confirm(model, top, batch, a.seq_len))
        return 0 if top is not None else 1


if __name__ == "__main__":
    sys.exit(main())
