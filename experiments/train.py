"""Train a transformer LM on a device mesh. ``--help`` lists the flags.

    python experiments/train.py --model tiny --mesh data=2,fsdp=4 --cpu-devices 8 --steps 100
"""

from __future__ import annotations

import os
import sys

# The repository root instead of this folder, whose inspect.py would shadow the standard library's.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxshard import cli, distributed, runtime  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    with cli.one_line_errors():
        cfg = cli.parse_train(argv)
        runtime.configure(cfg.runtime)  # before anything touches a device
        distributed.initialize(cfg.distributed, cfg.runtime.platform)

        from experiments.common import build_model
        from jaxshard import loop

        loop.train(cfg, build_model(cfg))


if __name__ == "__main__":
    main()
