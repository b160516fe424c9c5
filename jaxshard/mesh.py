"""``--mesh data=2,fsdp=2,tensor=2``: parsing, validation, ``-1`` fill, and the jax Mesh.

Parsing needs no jax, so a malformed spec fails before the backend starts. Every mesh
built here has all :data:`~jaxshard.axes.MESH_AXES` (absent ones with size 1), with Auto
axis types so XLA's partitioner (GSPMD/Shardy) inserts the collectives.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from jaxshard.axes import MESH_AXES, MeshAxis
from jaxshard.errors import MeshError

if TYPE_CHECKING:
    import jax

_ITEM = re.compile(r"^\s*([A-Za-z_]\w*)\s*=\s*(-?\d+)\s*$")
_KNOWN = ", ".join(MESH_AXES)


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """Axis sizes in the order given (outermost first); at most one size is -1."""

    axes: tuple[tuple[MeshAxis, int], ...]

    def __post_init__(self) -> None:
        names = [a for a, _ in self.axes]
        for axis in names:
            if names.count(axis) > 1:
                raise MeshError(f"mesh axis '{axis}' is given twice in --mesh {self}")
        for axis, size in self.axes:
            if size == 0 or size < -1:
                raise MeshError(
                    f"mesh axis '{axis}' has size {size} in --mesh {self}; sizes are positive "
                    "integers, or -1 once to fill the remaining devices")
        if sum(size == -1 for _, size in self.axes) > 1:
            raise MeshError(f"--mesh {self} has more than one -1; at most one axis may fill the rest")

    @classmethod
    def parse(cls, text: str) -> MeshSpec:
        if not text or not text.strip():
            raise MeshError("--mesh is empty; expected AXIS=SIZE[,AXIS=SIZE...], e.g. data=2,fsdp=4")
        axes = []
        for item in text.split(","):
            m = _ITEM.match(item)
            if m is None:
                raise MeshError(
                    f"malformed --mesh '{text}': '{item.strip()}' is not AXIS=SIZE "
                    "(expected e.g. data=2,fsdp=4)")
            name, size = m.group(1), int(m.group(2))
            try:
                axis = MeshAxis(name)
            except ValueError:
                raise MeshError(
                    f"unknown mesh axis '{name}' in --mesh '{text}'; known axes: {_KNOWN}") from None
            axes.append((axis, size))
        return cls(tuple(axes))

    def __str__(self) -> str:
        return ",".join(f"{a}={s}" for a, s in self.axes)

    def resolve(self, n_devices: int) -> dict[MeshAxis, int]:
        """Sizes of all mesh axes for ``n_devices``, in nesting order (given axes first)."""
        fixed = math.prod(s for _, s in self.axes if s != -1)
        sizes = {}
        for axis, size in self.axes:
            if size == -1:
                if n_devices % fixed:
                    raise MeshError(
                        f"--mesh {self}: cannot fill -1, {n_devices} devices are not divisible "
                        f"by the other axes' product {fixed}")
                size = n_devices // fixed
            sizes[axis] = size
        if math.prod(sizes.values()) != n_devices:
            raise MeshError(
                f"--mesh {self} needs {math.prod(sizes.values())} devices but {n_devices} are "
                "available; the sizes must multiply to the device count (or use -1 to fill)")
        for axis in MESH_AXES:
            sizes.setdefault(axis, 1)
        return sizes


def build_mesh(spec: MeshSpec | str, devices: Sequence[jax.Device] | None = None,
               dcn: MeshSpec | str | None = None) -> jax.sharding.Mesh:
    """The mesh for ``spec`` over ``devices`` (default: all devices of the default backend).

    With ``dcn`` (``--dcn-mesh``), a hybrid mesh: ``spec`` lays out the devices within each
    host (or TPU slice) and ``dcn`` the hosts, so each axis's size is the product of the two
    and only the ``dcn`` axes cross the slow network between hosts.
    """
    import jax
    import numpy as np
    from jax.experimental import mesh_utils

    if isinstance(spec, str):
        spec = MeshSpec.parse(spec)
    if isinstance(dcn, str):
        dcn = MeshSpec.parse(dcn)
    all_devices = jax.devices()
    devices = list(all_devices if devices is None else devices)
    if dcn is not None and any(size != 1 for _, size in dcn.axes):
        return _hybrid_mesh(spec, dcn, devices)
    try:
        sizes = spec.resolve(len(devices))
    except MeshError as e:
        raise MeshError(f"{e}{_per_process(devices, all_devices)}") from None
    shape = tuple(sizes.values())
    if len(devices) == len(all_devices) and len(devices) > 1:
        # Lets XLA order devices along the physical topology (rings on TPU/NVLink islands).
        grid = mesh_utils.create_device_mesh(shape, devices)
    else:
        grid = np.asarray(devices, dtype=object).reshape(shape)
    axis_types = (jax.sharding.AxisType.Auto,) * len(shape)
    return jax.sharding.Mesh(grid, tuple(str(a) for a in sizes), axis_types=axis_types)


def _per_process(devices: list, all_devices: list) -> str:
    """What each process of a multi-process job sees: the usual cause of a short device count."""
    import jax

    if jax.process_count() == 1 or len(devices) != len(all_devices):
        return ""
    return (f" (the job's {jax.process_count()} processes see {jax.local_device_count()} each: "
            "is each process given the GPUs it should drive? see scripts/slurm/train.sbatch)")


def _hybrid_mesh(spec: MeshSpec, dcn: MeshSpec, devices: list) -> jax.sharding.Mesh:
    import jax
    from jax.experimental import mesh_utils

    # TPU slices are the units of the slow network; on GPUs and CPUs, processes (hosts).
    by_slice = devices[0].platform == "tpu" and getattr(devices[0], "slice_index", None) is not None
    granules = len({getattr(d, "slice_index" if by_slice else "process_index") for d in devices})
    unit = "TPU slices" if by_slice else "processes"
    try:
        outer = dcn.resolve(granules)
    except MeshError:
        need = math.prod(s for _, s in dcn.axes if s != -1)
        raise MeshError(f"--dcn-mesh {dcn} lays out {need}{'x' if len(dcn.axes) > 1 else ''} {unit} "
                        f"but the job has {granules} (launch one process per host)") from None
    inner = spec.resolve(len(devices) // granules)
    # Axes that cross hosts outermost: a process then holds a contiguous block of the batch.
    names = [a for a in outer if outer[a] > 1] + [a for a in inner if outer[a] == 1]
    grid = mesh_utils.create_hybrid_device_mesh(
        [inner[a] for a in names], [outer[a] for a in names], devices, process_is_granule=not by_slice)
    axis_types = (jax.sharding.AxisType.Auto,) * len(names)
    return jax.sharding.Mesh(grid, tuple(str(a) for a in names), axis_types=axis_types)


def axis_sizes(mesh: jax.sharding.Mesh) -> dict[str, int]:
    """``{axis: size}`` in the mesh's nesting order (the report's ``mesh`` field)."""
    return {str(name): int(size) for name, size in mesh.shape.items()}


def abstract_mesh(sizes: dict[str, int]) -> jax.sharding.AbstractMesh:
    """A mesh of no devices with every axis (those not in ``sizes`` of size 1), in ``sizes``'
    order: rules for a cluster this machine does not have (the planner, the time model)."""
    import jax

    full = dict(sizes)
    for a in MESH_AXES:
        full.setdefault(str(a), 1)
    return jax.sharding.AbstractMesh(tuple(full.values()), tuple(full),
                                     axis_types=(jax.sharding.AxisType.Auto,) * len(full))
