"""PyTorch's single-process DataParallel next to GSPMD DDP and one device: losses, params, bytes.

    python experiments/data_parallel_demo.py --cpu-devices 8 --model tiny --steps 5

Trains the same model on the same random batches three ways -- one device, DDP
(``--mesh data=N``) and the DataParallel pattern of :mod:`jaxshard.mechanics.data_parallel` (params and
optimizer state on device 0; each step a broadcast of the params, a scatter of the batch, a
gather of the gradients and loss sums to device 0, the update there) -- and prints the losses
side by side, each run's largest param difference from one device, the bytes each device
moves per step (DataParallel's transfers counted from the moved arrays' shardings, a model;
DDP's collectives read from its compiled HLO; both against a prediction from the parameter
count) and the step times.
"""

from __future__ import annotations

import argparse
import os
import sys

# The repository root instead of this folder, whose inspect.py would shadow the standard library's.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxshard import cli, runtime  # noqa: E402
from jaxshard.errors import ConfigError  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = cli.Parser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help="a preset (models/presets.py)")
    p.add_argument("--devices", type=int, default=None, help="devices to use (default: all)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8, help="global batch in sequences")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--cpu-devices", type=int, default=None,
                   help="force N host devices when running on CPU (acts before JAX starts)")
    p.add_argument("--platform", default=None, help="cpu, gpu or tpu (default: JAX's choice)")
    p.add_argument("--compile-cache", default=str(runtime.DEFAULT_CACHE),
                   help="persistent XLA compilation cache directory; '' disables")
    return p


def main(argv: list[str] | None = None) -> int:
    with cli.one_line_errors():
        a = parser().parse_args(argv)
        for flag, value in (("--steps", a.steps), ("--batch-size", a.batch_size), ("--seq-len", a.seq_len)):
            if value < 1:
                raise ConfigError(f"{flag} must be >= 1, got {value}")
        runtime.configure(runtime.RuntimeConfig(cpu_devices=a.cpu_devices, platform=a.platform,
                                                compile_cache=a.compile_cache or None))
        import jax

        from jaxshard.mechanics import data_parallel
        from jaxshard.training.optim import OptimConfig
        from models import TransformerLM, get_preset

        n = a.devices or jax.device_count()
        if not 1 <= n <= jax.device_count():
            raise ConfigError(f"--devices {n} but {jax.device_count()} are available")
        if a.batch_size % n:
            raise ConfigError(f"--batch-size {a.batch_size} is not divisible by the {n} devices")
        model = TransformerLM(get_preset(a.model))
        optim_cfg = OptimConfig(lr=a.lr, warmup_steps=min(2, a.steps), total_steps=max(a.steps, 1))
        print(f"{model.cfg.name}: {model.n_params():,} params, batch {a.batch_size} x {a.seq_len}, "
              f"{n} {jax.devices()[0].platform} devices, {a.steps} steps")
        result = data_parallel.compare(model, jax.devices()[:n], optim_cfg, a.steps, a.batch_size,
                                       a.seq_len, a.seed)
        print(data_parallel.format_comparison(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
