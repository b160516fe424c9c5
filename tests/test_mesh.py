import jax
import pytest

from jaxshard.axes import MESH_AXES
from jaxshard.errors import MeshError
from jaxshard.mesh import MeshSpec, axis_sizes, build_mesh


def test_parse_keeps_given_order_then_fills_missing_axes_with_one():
    sizes = MeshSpec.parse("tensor=2, data=2,fsdp=2").resolve(8)
    assert list(sizes)[:3] == ["tensor", "data", "fsdp"]
    assert sizes == {"tensor": 2, "data": 2, "fsdp": 2, "stage": 1, "expert": 1, "sequence": 1}


@pytest.mark.parametrize("spec, n, expected", [
    ("data=-1", 8, {"data": 8}),
    ("data=2,fsdp=-1", 8, {"data": 2, "fsdp": 4}),
    ("fsdp=-1,tensor=4", 8, {"fsdp": 2, "tensor": 4}),
    ("data=1", 1, {"data": 1}),
])
def test_minus_one_fills_the_remaining_devices(spec, n, expected):
    sizes = MeshSpec.parse(spec).resolve(n)
    assert {k: v for k, v in sizes.items() if k in expected} == expected
    assert all(v == 1 for k, v in sizes.items() if k not in expected)


@pytest.mark.parametrize("spec, message", [
    ("data=2,foo=4", "unknown mesh axis 'foo'"),
    ("data=4", "needs 4 devices but 8 are available"),
    ("data=4,fsdp=4", "needs 16 devices but 8 are available"),
    ("data=0,fsdp=8", "has size 0"),
    ("data=-2,fsdp=4", "has size -2"),
    ("data=-1,fsdp=-1", "more than one -1"),
    ("data=-1,fsdp=3", "cannot fill -1"),
    ("data2", "malformed --mesh"),
    ("data=2;fsdp=4", "malformed --mesh"),
    ("data=two", "malformed --mesh"),
    ("", "--mesh is empty"),
    ("data=2,data=4", "given twice"),
])
def test_bad_mesh_specs_fail_with_one_clear_line(spec, message):
    with pytest.raises(MeshError, match=message) as e:
        MeshSpec.parse(spec).resolve(8)
    assert "\n" not in str(e.value)


def test_build_mesh_has_every_axis_and_auto_types():
    mesh = build_mesh("data=2,fsdp=4")
    assert axis_sizes(mesh) == {"data": 2, "fsdp": 4, "stage": 1, "expert": 1, "sequence": 1, "tensor": 1}
    assert set(mesh.axis_names) == set(MESH_AXES)
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())


def test_build_mesh_on_a_subset_of_devices():
    mesh = build_mesh("data=1", jax.devices()[:1])
    assert mesh.devices.size == 1
    with pytest.raises(MeshError, match="needs 2 devices but 1 are available"):
        build_mesh("data=2", jax.devices()[:1])


def test_hybrid_mesh_needs_one_process_per_dcn_position():
    # one process here: a --dcn-mesh over two hosts cannot be laid out
    with pytest.raises(MeshError, match=r"--dcn-mesh data=2 lays out 2 processes but the job has 1"):
        build_mesh("fsdp=4", dcn="data=2")
    mesh = build_mesh("fsdp=8", dcn="data=1")  # a trivial one is the plain mesh
    assert axis_sizes(mesh)["fsdp"] == 8
