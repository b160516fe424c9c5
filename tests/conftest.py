"""Every test sees 8 fake CPU devices: set before any backend starts."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Tests run tiny programs a few times each: compile time dominates, and LLVM's optimisation passes
# are ~25% of it. Both sides of every comparison compile with the same flags. Set in the environment so
# the subprocesses of the command-line tests inherit it.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

from jaxshard import runtime  # noqa: E402

runtime.configure(runtime.RuntimeConfig(
    cpu_devices=8, platform="cpu",
    compile_cache=os.environ.get("JAXSHARD_TEST_CACHE", str(ROOT / ".cache" / "xla-tests"))))
