"""Show what each collective does on a device mesh: every device's x before and after, the HLO
collectives it compiles to, and each device's collective buffers (read from the HLO) and the bytes
it sends under the ring model.

    python experiments/collectives_demo.py                       # 8 CPU devices, one axis of 8
    python experiments/collectives_demo.py --mesh data=2,tensor=4 --axis tensor --root 1
    python experiments/collectives_demo.py --mesh data=2,tensor=4 --axis data,tensor --only gather,scatter

Device d starts with x = 10*d + [0, 1, ..., m-1] (int32; 100*d from m = 11 on), m being the
axis size, so that x splits into one element per member. Per device: "buffers", the bytes of
the collective buffers it takes part in, read from the compiled program's HLO (measured); and
"sends", those collectives' bytes under the ring model of jaxshard.analysis.hlo (modelled: the HLO says
what moves, not how the transport routes it), as ``--report``'s ``sent_bytes`` are.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

# The repository root instead of this folder, whose inspect.py would shadow the standard library's.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxshard import cli  # noqa: E402
from jaxshard.errors import ConfigError  # noqa: E402

NAMES = ("broadcast", "reduce", "all_reduce", "scatter", "gather", "all_gather", "reduce_scatter",
         "all_to_all", "barrier", "send_recv_ring")


def parser() -> argparse.ArgumentParser:
    p = cli.Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mesh", default="data=-1",
                   help="AXIS=SIZE,... outermost first, one -1 filling the devices (default: data=-1)")
    p.add_argument("--axis", default=None,
                   help="the axis, or AXIS,AXIS for a tuple of axes (default: the axes of --mesh)")
    p.add_argument("--root", type=int, default=0,
                   help="root member of broadcast, reduce, scatter and gather (default: 0)")
    p.add_argument("--op", default="sum",
                   help="op of reduce, all_reduce and reduce_scatter: sum, max, min, mean (default: sum)")
    p.add_argument("--shift", type=int, default=1, help="send_recv_ring: member i sends to i+shift (default: 1)")
    p.add_argument("--only", default=None, help=f"comma-separated subset of: {', '.join(NAMES)} (default: all)")
    p.add_argument("--cpu-devices", type=int, default=8, help="devices to fake when running on CPU (default: 8)")
    p.add_argument("--platform", default=None, help="cpu, gpu or tpu (default: JAX's)")
    return p


def main(argv: list[str] | None = None) -> int:
    with cli.one_line_errors():
        a = parser().parse_args(argv)
        names = NAMES if a.only is None else tuple(n.strip() for n in a.only.split(","))
        unknown = [n for n in names if n not in NAMES]
        if unknown:
            raise ConfigError(f"--only: unknown collective(s) {', '.join(unknown)}; known: {', '.join(NAMES)}")
        from jaxshard.mesh import MeshSpec

        spec = MeshSpec.parse(a.mesh)
        given = [str(axis) for axis, _ in spec.axes]
        axes = tuple(x.strip() for x in a.axis.split(",")) if a.axis else tuple(given)
        if len(set(axes)) < len(axes):
            raise ConfigError(f"--axis {a.axis}: each axis may appear once")
        for axis in axes:
            if axis not in given:
                raise ConfigError(f"--axis {axis!r} is not an axis of --mesh {spec} "
                                  f"(its axes: {', '.join(given)})")
        from jaxshard import runtime

        runtime.configure(runtime.RuntimeConfig(cpu_devices=a.cpu_devices, platform=a.platform))
        from jaxshard.mesh import build_mesh

        mesh = build_mesh(spec)
        show(mesh, axes[0] if len(axes) == 1 else axes, names, a)
    return 0


def show(mesh, axis, names, a) -> None:
    import numpy as np

    from jaxshard.analysis import hlo
    from jaxshard.mechanics import collectives

    axes = (axis,) if isinstance(axis, str) else axis
    sizes = {str(k): int(v) for k, v in mesh.shape.items()}
    m = int(np.prod([sizes[x] for x in axes]))
    calls = {
        "broadcast": (f"root={a.root}", lambda x: collectives.broadcast(x, axis, a.root)),
        "reduce": (f"root={a.root}, op={a.op!r}", lambda x: collectives.reduce(x, axis, a.root, a.op)),
        "all_reduce": (f"op={a.op!r}", lambda x: collectives.all_reduce(x, axis, a.op)),
        "scatter": (f"root={a.root}", lambda x: collectives.scatter(x, axis, a.root)),
        "gather": (f"root={a.root}", lambda x: collectives.gather(x, axis, a.root)),
        "all_gather": ("", lambda x: collectives.all_gather(x, axis)),
        "reduce_scatter": (f"op={a.op!r}", lambda x: collectives.reduce_scatter(x, axis, a.op)),
        "all_to_all": ("", lambda x: collectives.all_to_all(x, axis)),
        "barrier": ("", lambda x: collectives.barrier(axis)),
        "send_recv_ring": (f"shift={a.shift}", lambda x: collectives.send_recv_ring(x, axis, a.shift)),
    }
    devices = list(mesh.devices.flat)
    coords = np.stack(np.unravel_index(np.arange(len(devices)), mesh.devices.shape), axis=1)
    shown = [str(k) for k, s in sizes.items() if s > 1] or list(sizes)[:1]
    member = np.ravel_multi_index([coords[:, list(sizes).index(x)] for x in axes], [sizes[x] for x in axes])
    labels = [f"device {d.id:>4} " + ",".join(f"{k}={c[list(sizes).index(k)]}" for k in shown) + f" member {i}"
              for d, c, i in zip(devices, coords, member)]
    scale = 10 ** len(str(m - 1))  # device d's values read as d followed by the element's index
    x = (scale * np.arange(len(devices))[:, None] + np.arange(m)[None, :]).astype(np.int32)
    print(f"{len(devices)} {devices[0].platform} devices, mesh "
          + ",".join(f"{k}={s}" for k, s in sizes.items() if s > 1 or k in shown)
          + f"; collectives over {axis!r} ({m} members). Each device's x: int32[{m}], {x[0].nbytes} bytes.")
    for name in names:
        args, f = calls[name]
        fn = collectives.each_device(f, mesh)
        compiled = fn.lower(x).compile()
        found = hlo.parse(compiled.as_text())
        sent = collectives.bytes_sent(compiled, mesh)
        held = collectives.buffer_bytes(compiled, mesh)
        after = np.asarray(compiled(x))
        ops = Counter(c.spelled_as if c.kind == c.spelled_as else f"{c.spelled_as} (read as {c.kind})"
                      for c in {c.name.split("#")[0]: c for c in found}.values())  # a tuple op once
        compiled_to = ", ".join(f"{n} x {k}" for k, n in ops.items()) or "no collective"
        call = ", ".join(([] if name == "barrier" else ["x"]) + [repr(axis)] + ([args] if args else []))
        print(f"\n{name}({call})  ->  {compiled_to}")
        width = max(len(_row(row)) for row in x)
        sent_width = max(len(str(b)) for b in sent.values())
        held_width = max(len(str(b)) for b in held.values())
        for label, d, before, now in zip(labels, devices, x, after):
            print(f"  {label}  buffers {held[d.id]:>{held_width}} B, sends {sent[d.id]:>{sent_width}} B"
                  f"   {_row(before):<{width}}  ->  {_row(now)}")


def _row(values) -> str:
    import numpy as np

    return np.array2string(values, max_line_width=10**6)


if __name__ == "__main__":
    sys.exit(main())
