"""Where a traced step's device time went: the kernels of a ``jax.profiler`` trace (the
``.xplane.pb`` that ``--profile-steps`` writes), each tied to its HLO instruction and, through the
optimized HLO that XLA dumps (``--xla_dump_to``), to the JAX source line that made it, and summed
into the parts the time model prices (:mod:`jaxshard.analysis.timing`): matmuls, the attention
kernel, collectives, the loss, the optimizer and the other (memory-bound) work.

On GPUs the kernels are the device plane's (``/device:GPU:N``, one line per stream); on CPU,
where there is no device plane, the host threads' XLA thunks stand in, which is enough to test
the plumbing, not to time anything."""

from __future__ import annotations

import glob
import os
import re
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

# The parts of a step, in the time model's terms, and how a kernel is put in one (first match
# wins): by its kernel name, the HLO instruction's opcode or custom-call target, or the source
# file of the JAX code that made it.
COLLECTIVE = re.compile(r"nccl|all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all", re.I)
ATTENTION = re.compile(r"cudnn|fmha|flash|sdpa", re.I)
MATMUL = re.compile(r"gemm|nvjet|cutlass|xmma|cublas|\bdot\b|dot_general\.|matmul", re.I)
COPY = re.compile(r"memcpy|memset", re.I)
LOSS_SOURCES = ("jaxshard/parallel/vocab.py", "optax/losses")
OPTIMIZER_SOURCES = ("optax/", "jaxshard/training/optim.py")
CONTAINERS = ("while", "conditional", "call")  # thunks that run others (CPU): not counted
PARTS = ("matmul", "attention", "collective", "loss", "optimizer", "copy", "other")

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([\w\-]+)\(")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_TABLE_ROW = re.compile(r"^(\d+) (.*)$")
_FIELDS = re.compile(r"(\w+)=(\d+)")


@dataclass(frozen=True)
class Source:
    """What an HLO instruction is and where it came from."""

    opcode: str
    target: str = ""  # a custom call's target, e.g. "__cublas$gemm", "__cudnn$fmhaSoftmax"
    op_name: str = ""
    source: str = ""  # "file.py:line" of the innermost JAX frame that made it, "" when XLA did
    files: tuple[str, ...] = ()  # every frame's file, innermost first


def _tables(text: str) -> dict[str, dict[int, str]]:
    """The module text's ``FileNames``, ``FunctionNames``, ``FileLocations`` and ``StackFrames``
    tables (id: row), which instructions' ``stack_frame_id`` points into."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif current is not None and (m := _TABLE_ROW.match(line)):
            current[int(m.group(1))] = m.group(2).strip('"')
        else:
            current = None
    return tables


def _frames(tables: dict[str, dict[int, str]]) -> dict[int, tuple[str, tuple[str, ...]]]:
    """Each stack frame id: its innermost ``file:line`` and the files of the frames up its chain."""
    files, locations, frames = tables.get("FileNames", {}), tables.get("FileLocations", {}), tables.get("StackFrames", {})

    def where(frame: int) -> tuple[str, int]:
        f = dict((k, int(v)) for k, v in _FIELDS.findall(frames.get(frame, "")))
        loc = dict((k, int(v)) for k, v in _FIELDS.findall(locations.get(f.get("file_location_id", 0), "")))
        return f"{_short(files.get(loc.get('file_name_id', 0), '?'))}:{loc.get('line', '?')}", f.get("parent_frame_id", 0)

    out = {}
    for frame in frames:
        chain, seen, at = [], set(), frame
        while at and at not in seen and at in frames:
            seen.add(at)
            here, parent = where(at)
            chain.append(here)
            at = parent - 1  # the text prints a frame's parent id plus one (0: it has none)
        out[frame] = (chain[0], tuple(c.rsplit(":", 1)[0] for c in chain))
    return out


def hlo_sources(text: str) -> dict[str, Source]:
    """Each instruction of an HLO module's text by name: opcode, custom-call target, op name
    and the source lines its stack frame points to."""
    frames = _frames(_tables(text))
    out = {}
    for line in text.splitlines():
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        target, op_name, frame = _TARGET.search(line), _OP_NAME.search(line), _FRAME.search(line)
        source, files = frames.get(int(frame.group(1)), ("", ())) if frame else ("", ())
        out[m.group(1)] = Source(m.group(2), target.group(1) if target else "",
                                 op_name.group(1) if op_name else "", source, files)
    return out


def _short(path: str) -> str:
    """A source path from the package it lies in: ``jaxshard/model.py``, ``optax/...``."""
    for root in ("jaxshard/", "models/", "optax/", "flax/", "jax/"):
        if (i := path.rfind(root)) >= 0:
            return path[i:]
    return os.path.basename(path)


def dumped_sources(dump_dir: str, module: str = "jit_step") -> dict[str, Source]:
    """The instructions of the optimized HLO XLA dumped for ``module`` (the last such file)."""
    files = sorted(glob.glob(os.path.join(dump_dir, f"*{module}*after_optimizations.txt")))
    files = [f for f in files if "buffer" not in f and "memory" not in f]
    return hlo_sources(open(files[-1]).read()) if files else {}


@dataclass(frozen=True)
class Kernel:
    name: str  # the kernel's (GPU) or thunk's (CPU) name
    hlo_op: str  # the HLO instruction that launched it ("" if none is recorded)
    start_ns: float
    duration_ns: float
    line: str  # the stream (GPU) or thread (CPU) it ran on
    plane: str = ""  # the device (GPU) or host it ran on
    module: str = ""  # the HLO module that launched it ("" if not recorded)
    device: str = ""  # the device it ran for: its plane (GPU), the thunk's device ordinal (CPU)


def kernels(xplane: str) -> list[Kernel]:
    """The device work in a trace: the device planes' kernels, or without one (CPU) the host's
    XLA thunks (events with an ``hlo_op``)."""
    import jax.profiler

    data = jax.profiler.ProfileData.from_file(xplane)
    devices = [p for p in data.planes if p.name.startswith("/device:")]
    out = []
    for plane in devices or [p for p in data.planes if p.name.startswith("/host:")]:
        for line in plane.lines:
            for e in line.events:
                stats = dict(e.stats)
                hlo = hlo_op(stats)
                if not devices and not hlo:
                    continue
                out.append(Kernel(e.name, hlo, float(e.start_ns), float(e.duration_ns), line.name, plane.name,
                                  str(stats.get("hlo_module", "")),
                                  plane.name if devices else str(stats.get("device_ordinal", ""))))
    return out


_ANNOTATED = re.compile(r"hlo_op=([\w.\-]+)")


def hlo_op(stats: dict[str, Any]) -> str:
    """The HLO instruction an event ran: its ``hlo_op`` stat, or the one named in its kernel
    annotation (``name:#hlo_op=name,hlo_module=...#``, as XLA:GPU's thunks annotate launches)."""
    if op := stats.get("hlo_op"):
        return str(op)
    for value in stats.values():
        if isinstance(value, str) and (m := _ANNOTATED.search(value)):
            return m.group(1)
    note = stats.get("kernel_annotation")
    return str(note).split(":")[0].strip("#") if note else ""


def sample_stats(xplane: str, n: int = 4) -> list[dict[str, str]]:
    """The stats of the first ``n`` device events (what a trace records, to check the parsing)."""
    import jax.profiler

    data = jax.profiler.ProfileData.from_file(xplane)
    out = []
    for plane in data.planes:
        if plane.name.startswith("/device:"):
            for line in plane.lines:
                for e in list(line.events)[:n]:
                    out.append({"plane": plane.name, "line": line.name, "name": e.name[:200],
                                **{k: str(v)[:200] for k, v in e.stats}})
    return out[: 3 * n]


def part(k: Kernel, src: Source | None) -> str:
    """The time-model part a kernel belongs to (see :data:`PARTS`)."""
    names = " ".join([k.name, k.hlo_op, src.opcode if src else "", src.target if src else ""])
    if COLLECTIVE.search(names):
        return "collective"
    if ATTENTION.search(names):
        return "attention"
    if MATMUL.search(names) or (src and src.opcode in ("dot", "convolution")):
        return "matmul"
    if COPY.search(k.name):
        return "copy"
    files = src.files if src else ()
    if any(s in f for f in files for s in LOSS_SOURCES):
        return "loss"
    if any(s in f for f in files for s in OPTIMIZER_SOURCES) and not any("optax/losses" in f for f in files):
        return "optimizer"
    return "other"


def busy_ns(ks: list[Kernel]) -> float:
    """Nanoseconds in which at least one kernel ran (the union of their intervals)."""
    total, end = 0.0, float("-inf")
    for k in sorted(ks, key=lambda k: k.start_ns):
        stop = k.start_ns + k.duration_ns
        if stop > end:
            total += stop - max(k.start_ns, end)
            end = stop
    return total


def summarize(ks: list[Kernel], sources: dict[str, Source], steps: int, top: int = 40,
              module: str | None = None) -> dict[str, Any]:
    """Per step and device (the mean over the trace's device planes): seconds by part, the
    span from first kernel to last and the busy time, and the ``top`` instructions by time with
    their kernels and source lines. ``sources`` are ``module``'s instructions: a kernel another
    module launched (recorded as such) is not looked up in them."""
    by_part: dict[str, float] = defaultdict(float)
    by_op: dict[str, dict[str, Any]] = {}
    if module is not None:
        mine = {k for k in ks if not k.module or k.module == module}
        ks = [k if k in mine else replace(k, hlo_op=f"{k.module}/{k.hlo_op}") for k in ks]
    ks = [k for k in ks if not (k.hlo_op in sources and sources[k.hlo_op].opcode in CONTAINERS)]
    planes = sorted({k.plane for k in ks}) or [""]
    per = steps * len(planes)
    # Inside a CUDA graph (XLA's command buffers) a kernel's annotation names the graph, not the
    # instruction; an XLA kernel is named after its fusion then ("loop_add_fusion_3" for
    # "loop_add_fusion.3"). Library kernels (cuBLAS, cuDNN) keep only their own names.
    flat = {name.replace(".", "_"): name for name in sources}
    ours = lambda k: module is None or not k.module or k.module == module  # noqa: E731
    ks = [replace(k, hlo_op=flat[k.name]) if k.hlo_op not in sources and k.name in flat and ours(k) else k
          for k in ks]
    for k in ks:
        src = sources.get(k.hlo_op)
        p = part(k, src)
        by_part[p] += k.duration_ns
        # A row per instruction; a library kernel in a graph (its instruction unknown) by its name.
        key = k.hlo_op if src else k.name
        row = by_op.setdefault(key, {
            "hlo_op": k.hlo_op if src else "", "kernels": set(), "part": p, "ms": 0.0, "launches": 0,
            "opcode": src.opcode if src else "", "target": src.target if src else "",
            "source": src.source if src else "", "op_name": (src.op_name if src else "")[-160:]})
        row["kernels"].add(k.name[:100])
        row["ms"] += k.duration_ns / 1e6 / per
        row["launches"] += 1
    rows = sorted(by_op.values(), key=lambda r: -r["ms"])[:top]
    for r in rows:
        r["kernels"] = sorted(r["kernels"])[:3]
        r["launches"] //= per
    on = [[k for k in ks if k.plane == p] for p in planes]
    span = sum(max(k.start_ns + k.duration_ns for k in p) - min(k.start_ns for k in p) for p in on if p)
    return {"steps": steps, "devices": len(planes), "parts_s": {p: by_part.get(p, 0.0) / 1e9 / per for p in PARTS},
            "kernel_s": sum(by_part.values()) / 1e9 / per, "busy_s": sum(busy_ns(p) for p in on) / 1e9 / per,
            "span_s": span / 1e9 / per, "kernels": len(ks) // max(per, 1), "top": rows,
            "sources_found": sum(k.hlo_op in sources for k in ks) / max(len(ks), 1)}


# A pipeline executor's tick (jaxshard.parallel.pipeline): its ops run under named scopes
# (``pipeline_tick_F``, ``_B``, ``_W``, ...), its ticks are the loop inside the step's shard_map.
_TICK_OP = re.compile(r"pipeline_tick_(\w+)")
_IN_TICK = "shard_map/while/body"


def tick_part(src: Source | None) -> str:
    """Which part of a pipeline step an instruction is: the executor's op whose scope it runs
    in (``F``, ``B``, ``W``, ``W_first``: a W in the forward slot, ``last``, ``head``, ``embed``,
    ...), ``send`` (a collective-permute between stages, its waiting included), ``tick`` (the
    tick loop's own work: stashes, accumulating gradients, picking slots), ``outside`` (the step around the
    loop: the optimizer, the final reductions) or ``xla`` (what XLA made with no source: its
    copies, an instruction not in ``sources``)."""
    if src is None or not src.op_name:
        return "xla"
    if ops := _TICK_OP.findall(src.op_name):
        return ops[-1]
    if _IN_TICK not in src.op_name:
        return "outside"
    return "send" if src.opcode == "collective-permute" else "tick"


def tick_parts(ks: list[Kernel], sources: dict[str, Source], steps: int = 1) -> dict[str, dict[str, float]]:
    """Per device and step, seconds of a pipeline step by :func:`tick_part`: each device's
    kernels (on CPU its thunks; the loops and conditionals that run others are not counted,
    their own time being left out of the parts), summed by the part its instruction is in."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for k in ks:
        src = sources.get(k.hlo_op)
        if src is not None and src.opcode in CONTAINERS:
            continue
        out[k.device or k.plane][tick_part(src)] += k.duration_ns / 1e9 / steps
    return {d: dict(parts) for d, parts in sorted(out.items())}


def latest_xplane(trace_dir: str) -> str:
    """The last ``.xplane.pb`` that ``jax.profiler`` wrote under ``trace_dir``."""
    found = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not found:
        raise FileNotFoundError(f"no .xplane.pb under {trace_dir}")
    return found[-1]


def profile(trace_dir: str, dump_dir: str | None, steps: int, top: int = 40) -> dict[str, Any]:
    """:func:`summarize` for the (last) trace under ``trace_dir`` and the HLO dumped to ``dump_dir``."""
    xplane = latest_xplane(trace_dir)
    out = summarize(kernels(xplane), dumped_sources(dump_dir) if dump_dir else {}, steps, top,
                    module="jit_step" if dump_dir else None)
    out["sample_stats"] = sample_stats(xplane)
    return out


def table(summary: dict[str, Any], rows: int = 25) -> str:
    """The summary as text: seconds by part, then the costliest instructions."""
    s = summary
    lines = [f"{s['kernels']} kernels a step per device ({s['devices']} traced): {s['kernel_s'] * 1e3:.1f} ms of kernels, busy {s['busy_s'] * 1e3:.1f} ms "
             f"of a {s['span_s'] * 1e3:.1f} ms span; {s['sources_found']:.0%} tied to an HLO instruction"]
    lines += [f"  {p:<11} {sec * 1e3:9.2f} ms" for p, sec in s["parts_s"].items()]
    lines += ["", f"{'ms':>9}  {'part':<10} {'launches':>8}  instruction / kernel  (source)"]
    for r in s["top"][:rows]:
        what = r["hlo_op"] or r["kernels"][0]
        lines.append(f"{r['ms']:9.2f}  {r['part']:<10} {r['launches']:>8}  {what[:60]}  ({r['source'] or '-'})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m jaxshard.analysis.profile",
                                description="Where a traced training step's device time went.")
    p.add_argument("trace_dir", help="the --profile-dir of a run with --profile-steps A:B")
    p.add_argument("--steps", type=int, required=True, help="how many steps the trace holds (B - A + 1)")
    p.add_argument("--hlo", metavar="DIR", help="where XLA dumped the step's optimized HLO "
                   "(XLA_FLAGS='--xla_dump_to=DIR --xla_dump_hlo_as_text'): ties kernels to source lines")
    p.add_argument("--top", type=int, default=25, help="instructions to list")
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error("--steps must be at least 1")
    try:
        print(table(profile(a.trace_dir, a.hlo, a.steps, a.top), a.top))
    except FileNotFoundError as e:
        print(f"error: {e}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
