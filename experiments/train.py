"""Train a transformer LM on a device mesh. ``--help`` lists the flags.

    python experiments/train.py --model tiny --mesh data=2,fsdp=4 --cpu-devices 8 --steps 100
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxshard import cli, runtime  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    with cli.one_line_errors():
        cfg = cli.parse_train(argv)
        runtime.configure(cfg.runtime)  # before anything touches a device

        from jaxshard import loop
        from models import TransformerLM, get_preset

        model_cfg = get_preset(cfg.model)
        if cfg.dropout is not None:
            model_cfg = model_cfg.replace(dropout=cfg.dropout)
        if cfg.vocab_multiple is not None:
            model_cfg = model_cfg.replace(vocab_multiple=cfg.vocab_multiple)
        loop.train(cfg, TransformerLM(model_cfg, remat=cfg.remat))


if __name__ == "__main__":
    main()
