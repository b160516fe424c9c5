"""What each device holds and sends: live array shards, the compiled step's memory analysis,
and the collectives XLA inserted into it."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import jax


def bytes_per_device(tree: Any) -> dict[int, int]:
    """Bytes of ``tree``'s arrays that each device holds, measured from the live shards."""
    held: dict[int, int] = defaultdict(int)
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            held[shard.device.id] += shard.data.nbytes
    return dict(held)


def max_bytes_per_device(tree: Any) -> int:
    """The most any one device holds of ``tree`` (what decides whether it fits)."""
    return max(bytes_per_device(tree).values(), default=0)


def xla_memory(compiled: jax.stages.Compiled) -> dict[str, int]:
    """Per-device bytes XLA planned for the compiled step."""
    m = compiled.memory_analysis()
    if m is None:  # some backends do not report
        return {}
    return {"argument": int(m.argument_size_in_bytes), "output": int(m.output_size_in_bytes),
            "temp": int(m.temp_size_in_bytes), "alias": int(m.alias_size_in_bytes),
            "generated_code": int(m.generated_code_size_in_bytes)}


def saved_residual_bytes(program: Any, batch_size: int, seq_len: int) -> int:
    """Bytes per device that the forward pass saves for the backward pass (activations under
    the remat policy, and what else autodiff keeps), from the shardings XLA gives them."""

    def residuals(params, batch):
        return jax.vjp(lambda p: program.loss(p, batch, None)[0], params)[1]

    abstract = program.layout.abstract.params
    compiled = jax.jit(residuals, in_shardings=(program.layout.shardings.params, program.batch_sharding)) \
        .lower(abstract, program.abstract_batch(batch_size, seq_len)).compile()
    return sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
               for x, s in zip(jax.tree.leaves(compiled.out_info), jax.tree.leaves(compiled.output_shardings)))


# ---- collectives in the compiled HLO --------------------------------------------------------
# The partitioned module is per device: shapes below are what one device sends or receives.

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+) = (?P<shape>\(.*?\)|\S+) "
                    r"(?P<op>[\w\-]+)\((?P<operands>[^)]*)\)(?P<attrs>.*)$")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s*\((?P<params>.*)\)\s*->.*\{\s*$")
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")


@dataclass(frozen=True)
class Collective:
    """One collective instruction of the compiled step, as one device sees it."""

    kind: str  # one of COLLECTIVE_KINDS; "reduce-scatter" also for all-reduce + dynamic-slice
    name: str
    shapes: tuple[tuple[int, ...], ...]  # result arrays (one per tuple element)
    operand_shapes: tuple[tuple[int, ...], ...]
    bytes: int  # result bytes (for reduce-scatter spelled as all-reduce: the all-reduce's)
    group_size: int  # devices in each replica group (0 if unknown)
    spelled_as: str  # the HLO opcode
    executions: int = 1  # times one step runs it (trip counts of the loops around it)

    def dims(self) -> set[int]:
        return {d for shape in self.shapes + self.operand_shapes for d in shape}


def _arrays(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(m["dtype"], tuple(int(d) for d in m["dims"].split(",") if d))
            for m in _ARRAY.finditer(text) if m["dtype"] in _DTYPE_BYTES]


def _group_size(attrs: str) -> int:
    if m := re.search(r"replica_groups=\{\{([\d,]*)\}", attrs):
        return len(m[1].split(","))
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs):
        return int(m[2])
    if m := re.search(r"replica_groups=mesh\[(.*?)\]\s*\{(.*?)\}", attrs):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m[1]))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m[2]))
    return 0


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective in ``compiled.as_text()``. An all-reduce whose every user takes a
    slice of it (a dynamic-slice, or a fusion that returns a smaller array) is a
    reduce-scatter that XLA:CPU spelled that way; it is reported as one."""
    shapes: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    instrs, users = [], defaultdict(list)
    fused_slices = set()  # computations that contain a dynamic-slice
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)  # caller -> (callee, times)
    where: dict[str, str] = {}  # instruction -> its computation
    computation = entry = ""
    for line in hlo_text.splitlines():
        if h := _HEADER.match(line):
            computation = h["name"]
            if line.startswith("ENTRY"):
                entry = computation
            for pname, ptype in re.findall(r"([\w.\-]+):\s*(\([^)]*\)|[^,()]+)", h["params"]):
                shapes[pname] = _arrays(ptype)
            continue
        m = _INSTR.match(line)
        if m is None:
            continue
        shapes[m["name"]] = _arrays(m["shape"])
        where[m["name"]] = computation
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', m["attrs"])
        for role, callee in re.findall(r"\b(body|condition|calls|to_apply|branch_computations|"
                                       r"true_computation|false_computation)=\{?%([\w.\-]+)", m["attrs"]):
            calls[computation].append((callee, int(trips[1]) if trips and role == "body" else 1))
        if m["op"] == "dynamic-slice":
            fused_slices.add(computation)
        for operand in re.findall(r"%([\w.\-]+)", m["operands"]):
            users[operand].append(m)
        if m["op"] in COLLECTIVE_KINDS or m["op"].removesuffix("-start") in COLLECTIVE_KINDS:
            instrs.append(m)

    runs = _executions(entry, calls)
    found = []
    for m in instrs:
        op = m["op"].removesuffix("-start")
        result = shapes[m["name"]]
        operands = [a for o in re.findall(r"%([\w.\-]+)", m["operands"]) for a in shapes.get(o, [])]
        # XLA combines small collectives into one with a tuple result; each element is its own
        # transfer (and may be a reduce-scatter while its neighbours are not).
        parts = [(m["name"], result, operands, users[m["name"]])]
        if len(result) > 1 and len(operands) == len(result):
            gtes = defaultdict(list)
            for u in users[m["name"]]:
                if u["op"] == "get-tuple-element" and (i := re.search(r"index=(\d+)", u["attrs"])):
                    gtes[int(i[1])].extend(users[u["name"]])
            parts = [(f"{m['name']}#{i}", [r], [o], gtes[i]) for i, (r, o) in enumerate(zip(result, operands))]
        for name, res, ops, used_by in parts:
            kind = op
            if op == "all-reduce" and len(res) == 1 and _is_sliced(res[0][1], used_by, shapes, fused_slices):
                kind = "reduce-scatter"
            found.append(Collective(
                kind=kind, name=name, shapes=tuple(s for _, s in res),
                operand_shapes=tuple(s for _, s in ops),
                bytes=sum(_DTYPE_BYTES[t] * math.prod(s) for t, s in res),
                group_size=_group_size(m["attrs"]), spelled_as=op,
                executions=runs.get(where[m["name"]], 1)))
    return found


def _executions(entry: str, calls: dict[str, list[tuple[str, int]]]) -> dict[str, int]:
    """How many times one run of ``entry`` runs each computation (while bodies: trip count)."""
    runs: dict[str, int] = defaultdict(int)

    def visit(comp: str, times: int, depth: int = 0) -> None:
        runs[comp] += times
        if depth < 64:
            for callee, n in calls.get(comp, ()):
                visit(callee, times * n, depth + 1)

    visit(entry, 1)
    return dict(runs)


def _is_sliced(shape, users, shapes, fused_slices) -> bool:
    if not users:
        return False
    for u in users:
        if u["op"] == "dynamic-slice":
            continue
        out = shapes[u["name"]]
        called = re.search(r"calls=%([\w.\-]+)", u["attrs"])
        smaller = len(out) == 1 and len(out[0][1]) == len(shape) and math.prod(out[0][1]) < math.prod(shape)
        if u["op"] == "fusion" and called and called[1] in fused_slices and smaller:
            continue
        return False
    return True


def collective_summary(found: list[Collective]) -> list[dict]:
    """``[{kind, count, bytes}]`` per kind, per device per step: the report's ``collectives``
    field. A collective inside the layer scan counts once per layer."""
    by_kind: dict[str, list[Collective]] = defaultdict(list)
    for c in found:
        by_kind[c.kind].append(c)
    return [{"kind": k, "count": sum(c.executions for c in cs),
             "bytes": sum(c.bytes * c.executions for c in cs)} for k, cs in sorted(by_kind.items())]
