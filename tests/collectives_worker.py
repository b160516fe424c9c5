"""Every collective of jaxshard.mechanics.collectives against its numpy definition, in one process or as one
process of a multi-process job; exits 0 when all agree, 1 (naming those that do not) otherwise.

    python tests/collectives_worker.py --cpu-devices 8
    python scripts/launch_local.py --processes 2 --devices-per-process 4 \\
        --script tests/collectives_worker.py

The numpy definitions and :func:`check` are also what tests/test_collectives.py runs in-process.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# The axis choices checked on data=2,tensor=4: one axis, the other, both, both in the other order.
AXES = ("data", "tensor", ("data", "tensor"), ("tensor", "data"))
ROWS, COLS = 8, 3  # each device's x: dim 0 divisible by every axis size above
NP_OPS = {"sum": np.sum, "max": np.max, "min": np.min, "mean": np.mean}


def np_collective(name: str, xs: np.ndarray, root: int = 0, op: str = "sum", shift: int = 1) -> np.ndarray:
    """What each member of one group holds after ``name``, from ``xs[i]`` = member i's x:
    the torch.distributed definitions (non-roots of reduce and gather hold zeros)."""
    m = len(xs)
    if name == "broadcast":
        return np.stack([xs[root]] * m)
    if name == "reduce":
        out = np.zeros((m, *xs.shape[1:]), np.result_type(NP_OPS[op](xs[:1], axis=0)))
        out[root] = NP_OPS[op](xs, axis=0)
        return out
    if name == "all_reduce":
        return np.stack([NP_OPS[op](xs, axis=0)] * m)
    if name == "scatter":
        return np.stack(np.split(xs[root], m))
    if name == "gather":
        out = np.zeros((m, m * xs.shape[1], *xs.shape[2:]), xs.dtype)
        out[root] = np.concatenate(list(xs))
        return out
    if name == "all_gather":
        return np.stack([np.concatenate(list(xs))] * m)
    if name == "reduce_scatter":
        return np.stack(np.split(NP_OPS[op](xs, axis=0), m))
    if name == "all_to_all":
        pieces = [np.split(x, m) for x in xs]  # pieces[j][i]: member j's chunk for member i
        return np.stack([np.concatenate([pieces[j][i] for j in range(m)]) for i in range(m)])
    if name == "barrier":
        return np.full((m,), m, np.int32)
    if name == "send_recv_ring":
        return np.stack([xs[(i - shift) % m] for i in range(m)])
    raise ValueError(name)


def per_group(x: np.ndarray, mesh_shape: dict[str, int], axes: tuple[str, ...],
              f: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """``f`` applied to every group of members of ``axes``: ``x[d]`` is device d's value (the mesh
    in row-major order); members are numbered row-major in ``axes``' order."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    k = len(sizes)
    inner = [names.index(a) for a in axes]
    perm = [i for i in range(k) if i not in inner] + inner
    grid = x.reshape(*sizes, *x.shape[1:]).transpose(*perm, *range(k, x.ndim - 1 + k))
    groups = grid.reshape(-1, math.prod(sizes[i] for i in inner), *x.shape[1:])
    out = np.stack([f(g) for g in groups])
    out = out.reshape(*(sizes[i] for i in perm), *out.shape[2:])
    out = out.transpose(*np.argsort(perm), *range(k, out.ndim))
    return out.reshape(-1, *out.shape[k:])


def cases(m: int) -> dict[str, tuple[str, dict]]:
    """Label -> (collective, keyword arguments) for an axis of ``m`` members: each root-taking
    collective at the first, a middle and the last root; every op; two shifts."""
    roots = sorted({0, m // 2, m - 1})
    out: dict[str, tuple[str, dict]] = {}
    for r in roots:
        out[f"broadcast root={r}"] = ("broadcast", {"root": r})
        out[f"scatter root={r}"] = ("scatter", {"root": r})
        out[f"gather root={r}"] = ("gather", {"root": r})
        out[f"reduce root={r} op=sum"] = ("reduce", {"root": r, "op": "sum"})
    for op in NP_OPS:
        out[f"reduce root={roots[-1]} op={op}"] = ("reduce", {"root": roots[-1], "op": op})
        out[f"all_reduce op={op}"] = ("all_reduce", {"op": op})
        out[f"reduce_scatter op={op}"] = ("reduce_scatter", {"op": op})
    out["all_gather"] = ("all_gather", {})
    out["all_to_all"] = ("all_to_all", {})
    out["barrier"] = ("barrier", {})
    out["send_recv_ring shift=1"] = ("send_recv_ring", {"shift": 1})
    out["send_recv_ring shift=-3"] = ("send_recv_ring", {"shift": -3})
    return out


def global_input(mesh, seed: int) -> np.ndarray:
    """Random small integers as float32 (sums exact), one [ROWS, COLS] block per device."""
    rng = np.random.default_rng(seed)
    return rng.integers(-50, 50, (mesh.devices.size, ROWS, COLS)).astype(np.float32)


def check(mesh, axis, seed: int = 0, corrupt: str | None = None) -> tuple[int, list[str]]:
    """Runs every case of :func:`cases` on ``mesh`` over ``axis`` in one program and compares
    this process's devices' results with numpy. ``(results compared, failures)``, a result being
    one case on one device; ``corrupt`` (a case label) perturbs that case's expectation, to see
    the check fail."""
    import jax

    from jaxshard.mechanics import collectives

    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    shape = {str(a): int(s) for a, s in mesh.shape.items()}
    todo = cases(math.prod(shape[a] for a in axes))

    def run_all(x):
        return {label: getattr(collectives, name)(*(() if name == "barrier" else (x,)), axis, **kw)
                for label, (name, kw) in todo.items()}

    x = global_input(mesh, seed)
    spec = jax.sharding.PartitionSpec(tuple(mesh.axis_names))
    x_dev = jax.make_array_from_callback(x.shape, jax.sharding.NamedSharding(mesh, spec), lambda i: x[i])
    got = collectives.each_device(run_all, mesh)(x_dev)
    compared, failures = 0, []
    for label, (name, kw) in todo.items():
        want = per_group(x, shape, axes, lambda xs: np_collective(name, xs, **kw))
        if label == corrupt:
            want = want + 1
        for shard in got[label].addressable_shards:
            compared += 1
            have, expect = np.asarray(shard.data), want[shard.index[0]]
            if have.shape != expect.shape:
                failures.append(f"{label} over {axis!r}: device {shard.device.id} holds shape "
                                f"{have.shape[1:]}, numpy says {expect.shape[1:]}")
                break
            wrong = ~np.isclose(have, expect, rtol=1e-6, atol=0)
            if wrong.any():
                at = tuple(int(i) for i in np.argwhere(wrong)[0][1:])
                failures.append(f"{label} over {axis!r}: device {shard.device.id} holds {have[0][at]} "
                                f"at {at}, numpy says {expect[0][at]}")
                break
    return compared, failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--coordinator", default=None)
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    p.add_argument("--cpu-devices", type=int, default=8, help="devices of this process")
    p.add_argument("--platform", default="cpu", choices=("cpu",))  # as scripts/launch_local.py passes
    p.add_argument("--init-timeout", type=float, default=60.0)
    p.add_argument("--mesh", default="data=2,tensor=4")
    p.add_argument("--corrupt", default=None, help="a case label whose expectation is perturbed")
    a = p.parse_args(argv)

    from jaxshard import distributed, runtime

    runtime.configure(runtime.RuntimeConfig(
        cpu_devices=a.cpu_devices, platform="cpu",
        compile_cache=os.environ.get("JAXSHARD_TEST_CACHE", os.path.join(ROOT, ".cache", "xla-tests"))))
    distributed.initialize(distributed.DistributedConfig(a.coordinator, a.num_processes, a.process_id,
                                                         timeout_s=a.init_timeout), platform="cpu")
    import jax

    from jaxshard.mesh import build_mesh

    mesh = build_mesh(a.mesh)
    me = f"process {jax.process_index()} of {jax.process_count()}"
    total, failures = 0, []
    for seed, axis in enumerate(AXES):
        n, bad = check(mesh, axis, seed, a.corrupt)
        total, failures = total + n, failures + bad
    for line in failures:
        print(f"{me}: MISMATCH {line}", flush=True)
    if failures:
        return 1
    print(f"{me}: {total} results on this process's {jax.local_device_count()} devices agree with "
          f"numpy ({len(AXES)} axis choices, {jax.device_count()} devices in all)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
