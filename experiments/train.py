"""Train a transformer LM on a device mesh. ``--help`` lists the flags.

    python experiments/train.py --model tiny --mesh data=2,fsdp=4 --cpu-devices 8 --steps 100

The same command is ``jaxshard-train`` (or ``python -m jaxshard.train``) once the package is
installed.
"""

from __future__ import annotations

import os
import sys

# The repository root instead of this folder, whose inspect.py would shadow the standard library's.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxshard.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
