"""Loss curves of several runs on one figure: the metric as a line, its validation points as
markers (where the run evaluated).

    python experiments/plot.py runs/ddp runs/fsdp/metrics.jsonl --out loss.png

Each RUN is a metrics file (train.py's ``--metrics``, JSON lines), a folder holding
``metrics.jsonl``, or a folder of TensorBoard event files.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __name__ == "__main__":  # (imported, e.g. by the tests, it leaves sys.path alone)
    # The repository root instead of this folder, whose inspect.py would shadow the standard library's.
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxshard import cli  # noqa: E402
from jaxshard.training.observe import read_curve  # noqa: E402


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = cli.Parser(description=__doc__.split("\n\n")[0],
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="a metrics JSON-lines file, or a folder holding metrics.jsonl or event files")
    p.add_argument("--out", default="loss.png", metavar="FILE.png", help="the figure (default %(default)s)")
    p.add_argument("--metric", default="loss",
                   help="the key to draw; val_<metric> as markers where present (default %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    with cli.one_line_errors():
        args = parse(argv)
        curves = [read_curve(run, args.metric) for run in args.runs]  # every run read before drawing

        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(8, 5), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for i, c in enumerate(curves):
            color = f"C{i % 10}"
            if c.train:
                ax.plot(*zip(*c.train), color=color, label=c.name)
            if c.val:
                ax.plot(*zip(*c.val), "o", color=color, markersize=5,
                        label=f"{c.name} (val)")
        ax.set_xlabel("step")
        ax.set_ylabel(args.metric)
        ax.grid(alpha=0.3)
        ax.legend()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.out, dpi=120)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
