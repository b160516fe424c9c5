"""Every test sees 8 fake CPU devices: set before any backend starts."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxshard import runtime  # noqa: E402

runtime.configure(runtime.RuntimeConfig(
    cpu_devices=8, platform="cpu",
    compile_cache=os.environ.get("JAXSHARD_TEST_CACHE", str(ROOT / ".cache" / "xla-tests"))))
