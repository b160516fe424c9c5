"""JAX settings that must be made before the backend starts (``--cpu-devices``, caches)."""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from jaxshard.errors import ConfigError
from jaxshard.options import flag, option

DEFAULT_CACHE = Path(os.environ.get("JAXSHARD_CACHE", Path.home() / ".cache" / "jaxshard")) / "xla"


def _cache(text: str) -> str | None:
    return text or None


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    cpu_devices: int | None = option(None, "force N host devices when running on CPU (acts before "
                                           "JAX starts)")
    platform: str | None = option(None, "cpu, gpu or tpu", default_text="JAX's choice")
    compile_cache: str | None = option(
        str(DEFAULT_CACHE), "persistent XLA compilation cache directory; '' disables", parse=_cache,
        show=lambda path: path or "", default_text="~/.cache/jaxshard/xla ($JAXSHARD_CACHE/xla if set)")

    def __post_init__(self) -> None:
        if self.cpu_devices is not None and self.cpu_devices < 1:
            raise ConfigError(f"{flag(RuntimeConfig, 'cpu_devices')} must be >= 1, got {self.cpu_devices}")
        if self.platform not in (None, "cpu", "gpu", "cuda", "tpu"):
            raise ConfigError(f"{flag(RuntimeConfig, 'platform')} must be cpu, gpu or tpu, got {self.platform}")


# The packages that bring each accelerator's backend (jax[cuda12], jax[cuda13], jax[rocm],
# jax[tpu]); where none is installed the platform cannot start.
_CUDA = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
_ROCM = ("jax_rocm60_plugin", "jax_rocm7_plugin", "jax_plugins.xla_rocm60", "jax_plugins.xla_rocm7")
PLATFORM_PACKAGES = {"gpu": _CUDA + _ROCM, "cuda": _CUDA, "tpu": ("libtpu",)}


def check_platform(platform: str) -> None:
    """One line (not JAX's traceback at the first device query) when the installation has no
    backend for ``platform``. Looks for the package only: starting a backend here would come
    before ``jax.distributed.initialize``, which must be first."""
    wanted = PLATFORM_PACKAGES.get(platform, ())
    if wanted and not any(_installed(name) for name in wanted):
        extra = "jax[cuda12]" if platform in ("gpu", "cuda") else "jax[tpu]"
        raise ConfigError(f"--platform {platform}: this installation has no {platform} backend "
                          f"(install the {extra} extra on a machine with one)")


def _installed(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


# The share of a GPU's memory XLA's allocator takes for its pool, which the planner's memory
# check counts as usable (``planner.evaluate``). JAX's default is 0.75 of total memory (its
# "GPU memory allocation" page; newer releases start there and grow), so a plan counted
# against 0.90 could not run under it. The rest is for what CUDA keeps outside the pool: its
# context, cuBLAS's and cuDNN's workspaces, NCCL's channel buffers -- an allowance, not
# measured here.
GPU_MEMORY_FRACTION = 0.90
POOL_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
                   "XLA_PYTHON_CLIENT_ALLOCATOR")


def gpu_pool_environment(env: dict[str, str]) -> dict[str, str]:
    """The variables to set for the GPU allocator's pool: :data:`GPU_MEMORY_FRACTION`, unless
    the user set the pool (its fraction, under either name, preallocation or the allocator)."""
    if any(name in env for name in POOL_VARIABLES):
        return {}
    return {"XLA_CLIENT_MEM_FRACTION": f"{GPU_MEMORY_FRACTION:.2f}"}


def configure(cfg: RuntimeConfig) -> None:
    """Apply ``cfg``; call before any jax computation or device query."""
    import jax

    # (read when a GPU backend starts; nothing else reads them)
    os.environ.update(gpu_pool_environment(dict(os.environ)))
    if cfg.platform is not None:
        check_platform(cfg.platform)
        jax.config.update("jax_platforms", cfg.platform)
    if cfg.cpu_devices is not None:
        try:
            jax.config.update("jax_num_cpu_devices", cfg.cpu_devices)
        except RuntimeError as e:  # the backend already started
            raise ConfigError(f"--cpu-devices must act before JAX starts: {e}") from None
    # Random bits independent of sharding, so init and dropout match one device on any mesh.
    jax.config.update("jax_threefry_partitionable", True)
    if cfg.compile_cache:
        enable_compile_cache(cfg.compile_cache)


def enable_compile_cache(path: str | os.PathLike) -> None:
    import jax

    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# XLA options per backend, passed to every jitted train/eval step (``compiler_options``), so
# the same code picks them by the backend it runs on. GPU: the latency-hiding scheduler, which
# overlaps collectives with compute, and the pipelining of the layer scan's collectives (the
# next layer's FSDP all-gather and the previous layer's gradient reduce-scatter run while a
# layer computes) with the scan double-buffered for it -- MaxText's and JAX-Toolbox's settings
# for FSDP on GPUs. Compiled on one H100 (docs/gpus.md), where jaxlib 0.11 lacks the three
# pipelining options (:func:`xla_options` leaves them out); their overlap needs several GPUs and
# is not measured yet. On CPU none of these apply.
XLA_OPTIONS: dict[str, dict[str, bool | int]] = {
    "gpu": {
        "xla_gpu_enable_latency_hiding_scheduler": True,
        "xla_gpu_enable_pipelined_all_gather": True,
        "xla_gpu_enable_pipelined_reduce_scatter": True,
        "xla_gpu_enable_pipelined_all_reduce": True,
        "xla_gpu_enable_while_loop_double_buffering": True,
        "xla_gpu_enable_highest_priority_async_stream": True,
    },
}


def xla_options(backend: str | None = None) -> dict[str, bool | int]:
    """The XLA options jaxshard compiles its steps with on ``backend`` (default: JAX's): those
    of :data:`XLA_OPTIONS` that this jaxlib knows. XLA retires options (jaxlib 0.11 has no
    ``xla_gpu_enable_pipelined_*``), and an unknown one fails every compile, so each is tried
    once on a trivial program; one it lacks is left out with a warning naming it."""
    import jax

    wanted = XLA_OPTIONS.get(backend or jax.default_backend(), {})
    return {name: value for name, value in wanted.items() if _known_option(name, value)}


@functools.cache
def _known_option(name: str, value: bool | int) -> bool:
    import jax
    import jax.numpy as jnp

    try:
        jax.jit(lambda x: x + 1, compiler_options={name: value}).lower(jnp.zeros(())).compile()
    except Exception as e:  # XlaRuntimeError: INVALID_ARGUMENT
        if "No such compile option" not in str(e):
            raise
        warnings.warn(f"this jaxlib ({jax.__version__}) has no XLA option {name}: compiling without it",
                      stacklevel=3)
        return False
    return True
