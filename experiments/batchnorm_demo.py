"""BatchNorm under data parallelism: per-device statistics (PyTorch DDP's BatchNorm) and
synchronised ones (SyncBatchNorm), each against one device.

    python experiments/batchnorm_demo.py --cpu-devices 8 --steps 20

Trains the small CNN of models/cnn.py on synthetic images three times, from the same init on
the same batches: on one device; on N devices (``data=N``) with the statistics reduced over the
whole batch; on N devices with each device's own. Prints the loss curves and their differences
from one device, then the largest parameter and running-statistic differences after the last
step and the held-out accuracy with the running statistics.
"""

from __future__ import annotations

import argparse
import os
import sys

# The repository root instead of this folder, whose inspect.py would shadow the standard library's.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxshard import cli, runtime  # noqa: E402
from jaxshard.errors import ConfigError  # noqa: E402


def _max_diff(a, b) -> float:
    import jax
    import numpy as np

    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def main(argv: list[str] | None = None) -> int:
    p = cli.Parser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64, help="global batch, in images")
    p.add_argument("--devices", type=int, default=None, help="devices of the data-parallel runs (default: all)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (momentum 0.9)")
    p.add_argument("--seed", type=int, default=0, help="init and data")
    p.add_argument("--eval-size", type=int, default=512, help="held-out images")
    p.add_argument("--cpu-devices", type=int, default=None, help="force N host devices when on CPU")
    with cli.one_line_errors():
        a = p.parse_args(argv)
        if a.steps < 1 or a.batch_size < 1 or a.eval_size < 1:
            raise ConfigError("--steps, --batch-size and --eval-size must be >= 1")
        runtime.configure(runtime.RuntimeConfig(cpu_devices=a.cpu_devices))
        import jax
        import numpy as np
        import optax

        from jaxshard.mechanics import batchnorm as bn
        from jaxshard.mesh import build_mesh
        from models.cnn import CNN, CNNConfig, SyntheticImages

        n = a.devices or len(jax.devices())
        if not 1 <= n <= len(jax.devices()):
            raise ConfigError(f"--devices {n}: {len(jax.devices())} devices are available")
        cfg = CNNConfig()
        data = SyntheticImages(a.seed, cfg)
        batches = data.batches(a.steps, a.batch_size)
        held_out = data.held_out(a.eval_size)
        tx = optax.sgd(a.lr, momentum=0.9)
        runs = {"1 device": (1, bn.Sync.GLOBAL), f"{n} dev, sync": (n, bn.Sync.GLOBAL),
                f"{n} dev, per device": (n, bn.Sync.DEVICE)}
        meshes = {1: build_mesh("data=1", jax.devices()[:1]), n: build_mesh(f"data={n}", jax.devices()[:n])}
        bn.check_batch(meshes[n], a.batch_size)
        results = {}
        for name, (devices, sync) in runs.items():
            model = CNN(cfg.replace(bn=bn.BatchNormConfig(sync=sync)))
            params, stats = model.init(jax.random.key(a.seed))
            mesh = meshes[devices]
            losses, state = bn.train(model.loss, params, stats, tx, mesh, batches)
            logits, _ = jax.jit(model.apply, static_argnames="train")(
                state.params, state.stats, held_out["images"], train=False)
            accuracy = float((np.asarray(logits).argmax(-1) == held_out["labels"]).mean())
            results[name] = (losses, jax.device_get(state), accuracy)

    one, sync, per_device = results.values()
    names = list(results)
    print(f"small CNN {cfg.channels} on synthetic {cfg.image_size}x{cfg.image_size}x{cfg.in_channels} "
          f"images, {cfg.n_classes} classes; batch {a.batch_size} ({a.batch_size // n} per device on "
          f"{n}), SGD lr {a.lr} momentum 0.9, {a.steps} steps, seed {a.seed}\n")
    print(f"{'step':>5} {names[0]:>12} {names[1]:>14} {'- 1 device':>11} {names[2]:>20} {'- 1 device':>11}")
    every = max(1, a.steps // 20)
    for i in range(a.steps):
        if i % every and i != a.steps - 1:
            continue
        print(f"{i + 1:>5} {one[0][i]:>12.6f} {sync[0][i]:>14.6f} {sync[0][i] - one[0][i]:>11.2e} "
              f"{per_device[0][i]:>20.6f} {per_device[0][i] - one[0][i]:>11.2e}")
    rows = [("max |loss - 1 device| over the steps", lambda r: f"{np.abs(r[0] - one[0]).max():.2e}"),
            (f"max |param - 1 device| after step {a.steps}",
             lambda r: f"{_max_diff(r[1].params, one[1].params):.2e}"),
            ("max |running stat - 1 device|", lambda r: f"{_max_diff(r[1].stats, one[1].stats):.2e}"),
            (f"held-out accuracy, running stats (1 device: {one[2]:.1%})", lambda r: f"{r[2]:.1%}")]
    print(f"\n{'':<52} {'sync (SyncBatchNorm)':>22} {'per device (DDP)':>18}")
    for label, cell in rows:
        print(f"{label:<52} {cell(sync):>22} {cell(per_device):>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
