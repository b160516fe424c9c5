"""Every test sees 8 fake CPU devices: set before any backend starts."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Tests run tiny programs a few times each: compile time dominates. Two XLA:CPU options cut it, and
# both sides of every comparison compile with the same flags: LLVM's optimisation passes off (~25%
# of it), and the older elemental emitters for fusions instead of the MLIR fusion emitters (the
# whole suite ~29 -> ~19 min on 2 cores). The emitters decide where float16 rounds inside a
# fusion, so the few tests that compare two differently fused programs at rounding level (a
# recompute policy against none) are marked `default_emitters` and run in a second session with
# JAXSHARD_TEST_EMITTERS=default (scripts/test.sh does both). Set in the environment so the
# subprocesses of the command-line tests (and the xdist workers) inherit them.
DEFAULT_EMITTERS = os.environ.get("JAXSHARD_TEST_EMITTERS") == "default"
FAST_COMPILE = ("--xla_backend_optimization_level=0",) + (
    () if DEFAULT_EMITTERS else ("--xla_cpu_use_fusion_emitters=false",))


def _xla_accepts(flag: str) -> bool:
    """Whether this jaxlib knows ``flag`` (XLA aborts on an unknown one; a newer jaxlib may
    have dropped the option), tried once in a child process."""
    import subprocess

    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True)
    return probe.returncode == 0


# XLA:CPU ends the process when a collective's participants -- the fake devices' threads -- do
# not all arrive within its termination timeout ("Termination timeout ... exceeded. Exiting to
# ensure a consistent program state"); on 2 cores shared with another worker's compile a device
# thread can be that late, and a worker dies with "Fatal Python error: Aborted". Tests wait longer.
PATIENT = ("--xla_cpu_collective_call_terminate_timeout_seconds=600",)

_flags = os.environ.get("XLA_FLAGS", "")
for _flag in FAST_COMPILE + PATIENT:
    if _flag.split("=")[0] not in _flags and (_flag == FAST_COMPILE[0] or _xla_accepts(_flag)):
        _flags = f"{_flags} {_flag}".strip()
os.environ["XLA_FLAGS"] = _flags
FAST_EMITTERS = "--xla_cpu_use_fusion_emitters=false" in _flags


def pytest_collection_modifyitems(config, items):
    """Under the fast emitters, the `default_emitters` tests are left to the second session
    (reported as deselected); under the default ones, they run like any other."""
    if not FAST_EMITTERS:
        return
    kept = [item for item in items if item.get_closest_marker("default_emitters") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


from jaxshard import runtime  # noqa: E402

runtime.configure(runtime.RuntimeConfig(
    cpu_devices=8, platform="cpu",
    compile_cache=os.environ.get("JAXSHARD_TEST_CACHE", str(ROOT / ".cache" / "xla-tests"))))
