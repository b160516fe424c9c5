"""jaxshard.mechanics.collectives: each collective against its numpy definition (on 8 devices, and across
2 real processes), what it compiles to and the bytes each device sends, its argument checks,
and the demo script."""

import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import collectives_worker as worker
from jaxshard.errors import ConfigError
from jaxshard.mechanics import collectives as C
from jaxshard.mesh import build_mesh

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("JAXSHARD_TEST_CACHE", str(ROOT / ".cache" / "xla-tests")))


@pytest.fixture(scope="module")
def mesh_2x4():
    return build_mesh("data=2,tensor=4")


@pytest.mark.parametrize("seed, axis", list(enumerate((*worker.AXES, "fsdp", ("fsdp", "tensor")))), ids=str)
def test_every_collective_matches_numpy(mesh_2x4, seed, axis):
    """On data=2,tensor=4: a group of 2 (data), 4 (tensor), 8 in both orders of the tuple, and
    with an axis of size 1 (fsdp); random inputs, roots first/middle/last, every op, two shifts."""
    compared, failures = worker.check(mesh_2x4, axis, seed=seed)
    assert not failures, "\n".join(failures)
    members = math.prod(mesh_2x4.shape[a] for a in ((axis,) if isinstance(axis, str) else axis))
    assert compared == 8 * len(worker.cases(members))  # every case on every device


def test_the_numpy_check_catches_a_wrong_result(mesh_2x4):
    _, failures = worker.check(mesh_2x4, "tensor", seed=1, corrupt="scatter root=2")
    assert len(failures) == 1 and failures[0].startswith("scatter root=2 over 'tensor'"), failures


def test_numpy_grouping_follows_the_tuple_order():
    """The reference's own numbering: member i of ("tensor", "data") on data=2,tensor=4 is
    tensor * 2 + data, so gathering over it interleaves the two data rows."""
    x = np.arange(8)[:, None]  # device d holds [d]
    got = worker.per_group(x, {"data": 2, "tensor": 4}, ("tensor", "data"),
                           lambda xs: worker.np_collective("all_gather", xs))
    np.testing.assert_array_equal(got[0], [0, 4, 1, 5, 2, 6, 3, 7])
    got = worker.per_group(x, {"data": 2, "tensor": 4}, ("tensor",),
                           lambda xs: worker.np_collective("send_recv_ring", xs))
    np.testing.assert_array_equal(got[:, 0], [3, 0, 1, 2, 7, 4, 5, 6])


def test_two_processes_agree_with_numpy():
    """2 processes x 4 CPU devices, gloo between them: the data axis of data=2,tensor=4 crosses
    the processes, tensor stays within each."""
    cmd = [sys.executable, str(ROOT / "scripts" / "launch_local.py"), "--processes", "2",
           "--devices-per-process", "4", "--script", str(ROOT / "tests" / "collectives_worker.py"),
           "--timeout", "100", "--init-timeout", "60"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    for p in (0, 1):  # 108 cases over the 4 axis choices, on each of the process's 4 devices
        assert f"[p{p}] process {p} of 2: 432 results on this process's 4 devices agree with numpy " \
               "(4 axis choices, 8 devices in all)" in r.stdout, r.stdout[-3000:]


# One device's x: f32[8, 16], 512 bytes, on an axis of 8; the root is member 5.
N, ROOT_MEMBER = 512, 5
CALLS = {
    "broadcast": (lambda x: C.broadcast(x, "data", ROOT_MEMBER), "all-reduce", 1, lambda i: 2 * 7 / 8 * N),
    "reduce": (lambda x: C.reduce(x, "data", ROOT_MEMBER, "max"), "all-reduce", 1, lambda i: 2 * 7 / 8 * N),
    "all_reduce": (lambda x: C.all_reduce(x, "data", "mean"), "all-reduce", 1, lambda i: 2 * 7 / 8 * N),
    "scatter": (lambda x: C.scatter(x, "data", ROOT_MEMBER), "collective-permute", 7,
                lambda i: 7 / 8 * N if i == ROOT_MEMBER else 0),
    "gather": (lambda x: C.gather(x, "data", ROOT_MEMBER), "collective-permute", 7,
               lambda i: 0 if i == ROOT_MEMBER else N),
    "all_gather": (lambda x: C.all_gather(x, "data"), "all-gather", 1, lambda i: 7 * N),
    "reduce_scatter": (lambda x: C.reduce_scatter(x, "data"), "reduce-scatter", 1, lambda i: 7 / 8 * N),
    "all_to_all": (lambda x: C.all_to_all(x, "data"), "all-to-all", 1, lambda i: 7 / 8 * N),
    "barrier": (lambda x: C.barrier("data"), "all-reduce", 1, lambda i: 2 * 7 / 8 * 4),
    "send_recv_ring": (lambda x: C.send_recv_ring(x, "data", 3), "collective-permute", 1, lambda i: N),
}


@pytest.mark.parametrize("name", CALLS)
def test_what_each_collective_compiles_to_and_sends(name):
    mesh = build_mesh("data=8")
    f, op, count, sent = CALLS[name]
    program = C.each_device(f, mesh)
    x = jax.ShapeDtypeStruct((8, 8, 16), jnp.float32)
    found = C.collectives_of(program, x)
    instructions = Counter(c.spelled_as for c in {c.name.split("#")[0]: c for c in found}.values())
    assert instructions == {op: count}, found
    got = C.bytes_sent(program, mesh, x)
    assert got == {d.id: round(sent(i)) for i, d in enumerate(mesh.devices.flat)}


def test_bytes_sent_follow_the_groups_of_a_2d_mesh(mesh_2x4):
    x = jax.ShapeDtypeStruct((8, 8, 16), jnp.float32)
    program = C.each_device(lambda x: C.all_reduce(x, "tensor"), mesh_2x4)
    (found,) = C.collectives_of(program, x)
    assert sorted(map(sorted, found.groups)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert set(C.bytes_sent(program, mesh_2x4, x).values()) == {2 * 3 / 4 * N}  # the ring model
    assert set(C.buffer_bytes(program, mesh_2x4, x).values()) == {N}  # the compiled buffer
    # gather over data to member 1: the data=0 row sends its block, the data=1 row (the roots) nothing
    program = C.each_device(lambda x: C.gather(x, "data", 1), mesh_2x4)
    sent = C.bytes_sent(program, mesh_2x4, x)
    assert [sent[d.id] for d in mesh_2x4.devices.flat] == [N] * 4 + [0] * 4
    held = C.buffer_bytes(program, mesh_2x4, x)  # each permute's buffer at its source and target
    assert [held[d.id] for d in mesh_2x4.devices.flat] == [N] * 8


def test_a_ring_shift_of_a_whole_turn_sends_nothing():
    mesh = build_mesh("data=8")
    program = C.each_device(lambda x: C.send_recv_ring(x, "data", -8), mesh)
    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    assert C.collectives_of(program, x) == []
    np.testing.assert_array_equal(program(x), x)


X8 = np.zeros((8, 6), np.float32)  # one [6] row per device: 6 is not divisible by 8


@pytest.mark.parametrize("call, message", [
    (lambda x: C.all_reduce(x, "data", op="prod"),
     "unknown op 'prod' for all_reduce; expected one of sum, max, min, mean"),
    (lambda x: C.reduce_scatter(x, "data", op="avg"), "unknown op 'avg' for reduce_scatter"),
    (lambda x: C.broadcast(x, "data", root=8), "root 8 is out of range for axis 'data' of size 8"),
    (lambda x: C.gather(x, "data", root=-1), "root -1 is out of range for axis 'data' of size 8"),
    (lambda x: C.reduce(x, "data", root=1.0), "root 1.0 is out of range"),
    (lambda x: C.scatter(x, "data"), "scatter: dim 0 of x (6) is not divisible by the size 8 of axis 'data'"),
    (lambda x: C.reduce_scatter(x, "data"), "reduce_scatter: dim 0 of x (6) is not divisible by the size 8"),
    (lambda x: C.all_to_all(x, ("data",)), "all_to_all: dim 0 of x (6) is not divisible by the size 8"),
    (lambda x: C.all_gather(x[0], "data"), "all_gather concatenates along dim 0: x must have one, got a scalar"),
    (lambda x: C.send_recv_ring(x, "data", shift=0.5), "shift must be an integer, got 0.5"),
    (lambda x: C.all_reduce(x, "nope"), "axis ('nope',) is not a manual axis here"),
    (lambda x: C.barrier(()), "axis must be a mesh axis name or a non-empty tuple of distinct ones, got ()"),
    (lambda x: C.all_gather(x, ("data", "data")), "tuple of distinct ones, got ('data', 'data')"),
])
def test_bad_arguments_are_one_line_config_errors(call, message):
    program = C.each_device(call, build_mesh("data=8"))
    with pytest.raises(ConfigError) as e:
        program(X8)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def demo(*args):
    return subprocess.run([sys.executable, str(ROOT / "experiments" / "collectives_demo.py"), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "JAXSHARD_CACHE": str(CACHE.parent / "demo")})


def lines(text):
    return [" ".join(line.split()) for line in text.splitlines()]


def test_demo_shows_each_device_before_and_after():
    r = demo()
    assert r.returncode == 0, r.stderr
    out = lines(r.stdout)
    assert out[0] == ("8 cpu devices, mesh data=8; collectives over 'data' (8 members). "
                      "Each device's x: int32[8], 32 bytes.")
    for name in CALLS:  # each collective once, with a row per device
        i = next(i for i, line in enumerate(out) if line.startswith(f"{name}("))
        assert [line.split(" ")[1] for line in out[i + 1:i + 9]] == [str(d) for d in range(8)], name
    assert "scatter(x, 'data', root=0) -> 7 x collective-permute" in out
    i = out.index("scatter(x, 'data', root=0) -> 7 x collective-permute")
    assert out[i + 1] == "device 0 data=0 member 0 buffers 28 B, sends 28 B [0 1 2 3 4 5 6 7] -> [0]"
    assert out[i + 4] == "device 3 data=3 member 3 buffers 4 B, sends 0 B [30 31 32 33 34 35 36 37] -> [3]"


def test_demo_on_one_axis_of_a_2d_mesh():
    r = demo("--mesh", "data=2,tensor=4", "--axis", "tensor", "--root", "1", "--only", "gather,reduce_scatter")
    assert r.returncode == 0, r.stderr
    out = lines(r.stdout)
    assert "gather(x, 'tensor', root=1) -> 3 x collective-permute" in out
    assert "device 5 data=1,tensor=1 member 1 buffers 48 B, sends 0 B [50 51 52 53] -> " \
           "[40 41 42 43 50 51 52 53 60 61 62 63 70 71 72 73]" in out
    assert "device 6 data=1,tensor=2 member 2 buffers 16 B, sends 16 B [60 61 62 63] -> [0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0]" in out
    assert "device 7 data=1,tensor=3 member 3 buffers 16 B, sends 12 B [70 71 72 73] -> [232]" in out  # 43+53+63+73
    assert not any(line.startswith("broadcast(") for line in out)


@pytest.mark.parametrize("args, message", [
    (["--axis", "fsdp"], "error: --axis 'fsdp' is not an axis of --mesh data=-1 (its axes: data)"),
    (["--mesh", "data=2,tensor=4", "--axis", "tensor", "--root", "4"],
     "error: root 4 is out of range for axis 'tensor' of size 4"),
    (["--bogus"], "error: unrecognized arguments: --bogus"),
])
def test_demo_bad_arguments_are_one_line_errors(args, message):
    r = demo(*args)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == message
