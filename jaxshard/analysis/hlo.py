"""The collectives of a compiled step, read from its HLO text (``compiled.as_text()``).

The partitioned module is per device, so every size here is what one device sends or
receives. Handles the text of jax 0.10-0.12: tuple-shaped (combined) collectives, replica
groups written out (``{{0,1},{2,3}}``), as iota lists (``[2,4]<=[4,2]T(1,0)``) or as meshes
(``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}``, optionally with ``device_ids=(...)``), async
``-start`` forms, and XLA:CPU's reduce-scatter spelled as an all-reduce whose users only
take slices of it. A collective inside a loop counts once per iteration (``known_trip_count``).
"""

from __future__ import annotations

import functools
import math
import re
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
                **dict.fromkeys(("f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3fnuz", "f8e5m2fnuz", "f8e4m3b11fnuz"), 1)}
_INSTR = re.compile(r"^\s*(?P<root>ROOT\s+)?%(?P<name>[\w.\-]+) = (?P<shape>\(.*?\)|\S+) "
                    r"(?P<op>[\w\-]+)\((?P<operands>[^)]*)\)(?P<attrs>.*)$")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s*\((?P<params>.*)\)\s*->.*\{\s*$")
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+\d*(?:[a-z]+\d*)*)\[(?P<dims>[\d,]*)\]")
_CALLS = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")

Groups = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Collective:
    """One transfer of the compiled step, as one device sees it."""

    kind: str  # one of KINDS; "reduce-scatter" also for all-reduce + slice
    name: str  # instruction name; "#i" marks element i of a combined (tuple) collective
    shapes: tuple[tuple[int, ...], ...]  # result arrays
    operand_shapes: tuple[tuple[int, ...], ...]
    bytes: int  # the full buffer: all-reduce's, all-gather's result, reduce-scatter's input
    groups: Groups  # partition ids per replica group (collective-permute: source/target pairs)
    spelled_as: str  # the HLO opcode
    executions: int = 1  # runs per step (trip counts of the loops around it)
    # In a branch of a conditional: ``executions`` counts every run of the conditional, an upper
    # bound (which branch runs is decided at run time).
    conditional: bool = False
    axes: tuple[str, ...] = ()  # mesh axes its groups span (see attribute())
    n_partitions: int = 0  # devices of the program (0: unknown)
    reduction: str = ""  # a reducing collective's op ("add", "maximum"); "" for the others

    @property
    def group_size(self) -> int:
        return len(self.groups[0]) if self.groups else 0

    @property
    def sent_bytes(self) -> float:
        """Bytes one device sends per execution, on average over the program's devices: under
        the ring algorithm for the grouped collectives; a collective-permute's buffer from each
        device that is a source of its pairs (a partial permute -- a pipeline's last stage,
        say -- sends nothing from the others)."""
        if self.kind == "collective-permute" and self.n_partitions:
            senders = {s for s, t in self.groups if s != t}
            return self.bytes * len(senders) / self.n_partitions
        return ring_sent_bytes(self.kind, self.bytes, self.group_size)

    def dims(self) -> set[int]:
        return {d for shape in self.shapes + self.operand_shapes for d in shape}


def ring_sent_bytes(kind: str, nbytes: float, group: int) -> float:
    """Bytes one device sends for a collective on a ``group``-device ring, ``nbytes`` being the
    full buffer: 2(n-1)/n for an all-reduce, (n-1)/n for the others, all of it for a permute
    every device takes part in. A model, not a measurement."""
    if kind == "collective-permute":
        return float(nbytes)
    if group <= 1:
        return 0.0
    return (2 if kind == "all-reduce" else 1) * (group - 1) / group * nbytes


def _arrays(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(m["dtype"], tuple(int(d) for d in m["dims"].split(",") if d))
            for m in _ARRAY.finditer(text) if m["dtype"] in DTYPE_BYTES]


def _nbytes(arrays) -> int:
    return sum(DTYPE_BYTES[t] * math.prod(s) for t, s in arrays)


def _iota(dims: str, perm: str | None) -> np.ndarray:
    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(math.prod(shape)).reshape(shape)
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def parse_groups(attrs: str, n_partitions: int) -> Groups:
    """Replica groups (or collective-permute pairs) as tuples of partition ids."""
    if m := re.search(r"source_target_pairs=\{(.*?)\}\}", attrs + "}"):
        return tuple(tuple(int(x) for x in p.split(",")) for p in re.findall(r"\{([\d,]+)\}", m[1] + "}"))
    if m := re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs):
        groups = tuple(tuple(int(x) for x in g.split(",") if x) for g in re.findall(r"\{([\d,]*)\}", m[1]))
        return groups or (tuple(range(n_partitions)),)
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs):
        return tuple(map(tuple, _iota(m[3], m[4]).reshape(int(m[1]), int(m[2])).tolist()))
    if m := re.search(r"replica_groups=mesh\[(.*?)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
                      r"\s*(?:\{(.*?)\})?", attrs):
        names = re.findall(r"'(\w+)'=(\d+)", m[1])
        sizes = [int(s) for _, s in names]
        ids = (_iota(m[2], m[3]) if m[2] else np.arange(math.prod(sizes))).reshape(sizes)
        listed = re.findall(r"'(\w+)'", m[4]) if m[4] else [n for n, _ in names]
        inner = [i for i, (n, _) in enumerate(names) if n in listed]
        outer = [i for i in range(len(names)) if i not in inner]
        size = math.prod(sizes[i] for i in inner)
        return tuple(map(tuple, ids.transpose(outer + inner).reshape(-1, size).tolist()))
    return (tuple(range(n_partitions)),)


@dataclass
class _Module:
    """One pass over a module's HLO text: every instruction, where it is, what it calls."""

    n_partitions: int
    shapes: dict[str, list[tuple[str, tuple[int, ...]]]]  # value -> its arrays
    body: dict[str, list]  # computation -> its instructions (regex matches)
    users: dict[str, list]  # value -> the instructions that take it
    where: dict[str, str]  # instruction -> its computation
    runs: dict[str, int]  # computation -> runs per run of the entry (loops by trip count)
    in_branch: set[str]  # computations run by a branch of a conditional
    data_dependent: set[str]  # computations run by a loop whose trip count is known only at run time
    entry: str
    edges: dict[str, list[tuple[str, int, str]]]  # computation -> (callee, trips, the calling op's op_name)

    def scopes(self, scoped: re.Pattern) -> Callable[[str, str], str | None]:
        """``scope_of(op_name, computation)``: the NAME of the outermost scope that ``scoped``
        finds in an instruction's ``op_name``; for an instruction XLA made without one (a
        fusion, a dot it rewrote), the one scope every named instruction of its computation
        that names one names (None where they name several)."""
        named: dict[str, set[str]] = {}
        for comp, instrs in self.body.items():
            named[comp] = {op[1] for m in instrs if (op := scoped.search(_op_name(m)))}

        def scope_of(name: str, computation: str) -> str | None:
            if name:
                return op[1] if (op := scoped.search(name)) else None
            only = named.get(computation, set())
            return next(iter(only)) if len(only) == 1 else None

        return scope_of

    def shared_runs(self, share: Mapping[str, float], scope_of: Callable[[str, str], str | None]
                    ) -> tuple[dict, dict]:
        """Runs of each computation per run of the entry, as :func:`_executions`, split by
        whether a call on the way is in a scope of ``share`` (``scope_of``: :meth:`scopes`; the
        first such call scales the runs below it by ``share[NAME]``): (runs under such a
        scope, runs under none)."""
        inside: dict[str, float] = defaultdict(float)
        outside: dict[str, float] = defaultdict(float)

        def visit(comp: str, times: float, scaled: bool, depth: int = 0) -> None:
            (inside if scaled else outside)[comp] += times
            if depth < 64:
                for callee, n, name in self.edges.get(comp, ()):
                    t, below = times * n, scaled
                    if not scaled and (op := scope_of(name, comp)) in share:
                        t, below = t * share[op], True
                    visit(callee, t, below, depth + 1)

        visit(self.entry, 1.0, False)
        return inside, outside


@functools.lru_cache(maxsize=2)  # a run reads its step's module for its collectives and its FLOPs
def _read(hlo_text: str) -> _Module:
    n_partitions = int(m[1]) if (m := re.search(r"num_partitions=(\d+)", hlo_text)) else 1
    shapes: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    users = defaultdict(list)
    body: dict[str, list] = defaultdict(list)
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    where: dict[str, str] = {}
    branches: set[str] = set()
    unknown: set[str] = set()
    edges: dict[str, list[tuple[str, int, str]]] = defaultdict(list)
    computation = entry = ""
    for line in hlo_text.splitlines():
        if h := _HEADER.match(line):
            computation = h["name"]
            entry = computation if line.startswith("ENTRY") else entry
            for pname, ptype in re.findall(r"([\w.\-]+):\s*(\([^)]*\)|[^,()]+)", h["params"]):
                shapes[pname] = _arrays(ptype)
            continue
        m = _INSTR.match(line)
        if m is None:
            continue
        shapes[m["name"]] = _arrays(m["shape"])
        where[m["name"]] = computation
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', m["attrs"])
        name = _op_name(m)
        for role, callee in _CALLS.findall(m["attrs"]):
            calls[computation].append((callee, int(trips[1]) if trips and role == "body" else 1))
            edges[computation].append((callee, calls[computation][-1][1], name))
            if m["op"] == "while" and not trips:
                unknown.add(callee)  # (its condition too: it runs once more than the body)
        for listed in _BRANCHES.findall(m["attrs"]):
            for callee in re.findall(r"%([\w.\-]+)", listed):
                calls[computation].append((callee, 1))
                edges[computation].append((callee, 1, name))
                branches.add(callee)
        if m["op"] == "conditional":
            branches.update(c for role, c in _CALLS.findall(m["attrs"]) if role.endswith("_computation"))
        body[computation].append(m)
        for operand in re.findall(r"%([\w.\-]+)", m["operands"]):
            users[operand].append(m)
    return _Module(n_partitions, shapes, body, users, where, _executions(entry, calls),
                   _reachable(branches, calls), _reachable(unknown, calls), entry, edges)


def _op_name(m: dict) -> str:
    """An instruction's ``op_name``: the JAX name stack it was traced under ('' where XLA
    made it without one, as some dots it rewrites)."""
    return name[1] if (name := re.search(r'op_name="([^"]*)"', m["attrs"])) else ""


def scan_copies(hlo_text: str) -> dict[str, Any]:
    """The copies through the layer scans' stacked buffers in an optimized GPU module: the
    asynchronous dynamic-update-slice and dynamic-slice fusions (XLA:GPU runs them as memcpy: a
    kernel's output into a slice of the stack, or a slice out of it), each run as often as its
    loop runs. Per computation holding them: copies and bytes per run (the slice's, read once
    and written once) and runs; ``moved_bytes``: reads and writes in all."""
    module = _read(hlo_text)
    loops: dict[str, dict[str, int]] = {}
    for comp, instructions in module.body.items():
        for m in instructions:
            if m["op"] != "async-start" or not re.search(r"/dynamic_(update_)?slice\b", m["attrs"]):
                continue
            arrays = _arrays(m["shape"])  # ((operands...), result, context)
            operands, result = arrays[:-2], arrays[-2]
            # A dynamic-update-slice returns its buffer (the first operand) and moves the update,
            # its other array operand; a dynamic-slice moves its result.
            update = [a for a in operands[1:] if a[1]] if operands and operands[0] == result else []
            moved = max(_nbytes([a]) for a in update) if update else _nbytes([result])
            loop = loops.setdefault(comp, {"copies": 0, "bytes_per_run": 0, "runs": module.runs.get(comp, 0)})
            loop["copies"] += 1
            loop["bytes_per_run"] += moved
    return {"loops": [{"body": k, **v} for k, v in loops.items()],
            "moved_bytes": sum(2 * v["bytes_per_run"] * v["runs"] for v in loops.values())}


def dot_flops(hlo_text: str, share: Mapping[str, float] | None = None, scope: str = "") -> float:
    """The matmul FLOPs one run of a compiled module executes on one device: every ``dot``
    (fused ones too), 2 x its output's elements x its contracted size, times the runs of the
    computation it is in -- a loop body once per iteration (``known_trip_count``), which XLA's
    own cost analysis counts once. Every branch of a conditional counts once per run of it
    (an upper bound where branches differ), but where a call on the way to a dot, or the dot
    itself, is in a scope ``scope + NAME`` with NAME in ``share`` (its ``op_name``; the first
    such on the path; :meth:`_Module.scopes` for instructions without one): its runs below
    count ``share[NAME]`` times, the fraction in which that branch is taken on this device (a
    pipeline's tick ops: ``pipeline.TICK_SCOPE``, ``Schedule.op_runs`` over the ticks).
    Loops whose trip count is known only at run time (a grouped matmul's tiles) are left out:
    :func:`loop_dot_flops` gives their FLOPs per iteration. Counts what XLA:CPU compiles; a
    GPU's library calls (cuBLAS, cuDNN custom calls) are not ``dot``s and are not counted."""
    return _dot_flops(hlo_text, data_dependent=False, share=share, scope=scope)


def loop_dot_flops(hlo_text: str, share: Mapping[str, float] | None = None, scope: str = "") -> float:
    """The matmul FLOPs of one iteration of every loop whose trip count is known only at run
    time, summed (each times the runs of the loops around it of known trip count, and
    ``share`` as in :func:`dot_flops`): times the iterations a run made, what those loops
    executed."""
    return _dot_flops(hlo_text, data_dependent=True, share=share, scope=scope)


def _dot_flops(hlo_text: str, data_dependent: bool, share: Mapping[str, float] | None, scope: str) -> float:
    mod = _read(hlo_text)
    scope_of = mod.scopes(re.compile(rf"(?:^|/){re.escape(scope)}(\w+)(?:/|$)")) if share else None
    inside, outside = mod.shared_runs(share, scope_of) if share else ({}, mod.runs)
    total = 0.0
    for computation, instrs in mod.body.items():
        if (computation in mod.data_dependent) != data_dependent:
            continue
        for m in instrs:
            if m["op"] != "dot":
                continue
            lhs = re.findall(r"%([\w.\-]+)", m["operands"])[0]
            lhs_shape = mod.shapes[lhs][0][1]
            contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", m["attrs"])
            k = math.prod(lhs_shape[int(d)] for d in contracted[1].split(",") if d) if contracted else 1
            runs = outside.get(computation, 0)
            if share:  # runs under a scoped call, and the rest under the dot's own scope
                runs = inside.get(computation, 0) + runs * share.get(scope_of(_op_name(m), computation), 1.0)
            total += 2 * math.prod(mod.shapes[m["name"]][0][1]) * k * runs
    return total


def parse(hlo_text: str) -> list[Collective]:
    """Every collective in the per-device HLO, combined ones split into their elements."""
    mod = _read(hlo_text)
    n_partitions, shapes, users, body, where = mod.n_partitions, mod.shapes, mod.users, mod.body, mod.where
    instrs = [m for ms in body.values() for m in ms if m["op"].removesuffix("-start") in KINDS]
    runs, in_branch = mod.runs, mod.in_branch
    found = []
    for m in instrs:
        op = m["op"].removesuffix("-start")
        result = shapes[m["name"]]
        if m["op"].endswith("-start") and len(result) > 1:  # async: (operands, results, ...)
            result = result[len(result) // 2:]
        operands = [a for o in re.findall(r"%([\w.\-]+)", m["operands"]) for a in shapes.get(o, [])]
        groups = parse_groups(m["attrs"], n_partitions)
        applied = re.search(r"\bto_apply=%([\w.\-]+)", m["attrs"])
        roots = [r["op"] for r in body.get(applied[1], ()) if r["root"]] if applied else []
        reduction = roots[0] if roots else ""
        # XLA combines small collectives into one with a tuple result; each element is its own
        # transfer (and may be a reduce-scatter while its neighbours are not).
        parts = [(m["name"], result, operands, {m["name"]})]
        if len(result) > 1 and len(operands) == len(result):
            elements = defaultdict(set)  # index -> names of its get-tuple-elements
            for u in users[m["name"]]:
                if u["op"] == "get-tuple-element" and (i := re.search(r"index=(\d+)", u["attrs"])):
                    elements[int(i[1])].add(u["name"])
            parts = [(f"{m['name']}#{i}", [r], [o], elements[i])
                     for i, (r, o) in enumerate(zip(result, operands))]
        for name, res, ops, values in parts:
            kind = op
            if op == "all-reduce" and len(res) == 1 and _only_sliced(values, users, body):
                kind = "reduce-scatter"
            full = ops if op == "reduce-scatter" else res
            found.append(Collective(
                kind=kind, name=name, shapes=tuple(s for _, s in res),
                operand_shapes=tuple(s for _, s in ops), bytes=_nbytes(full), groups=groups,
                spelled_as=op, executions=runs.get(where[m["name"]], 1),
                conditional=where[m["name"]] in in_branch, n_partitions=n_partitions, reduction=reduction))
    return found


def _only_sliced(values: set[str], users, body) -> bool:
    """Every use of ``values`` takes a slice: a dynamic-slice, or a fusion inside which the
    parameter the value arrives as is only sliced. (Cut by several fixed slices -- the
    pieces of an all-to-all -- all of the sum is used: an all-reduce.)"""
    uses = [u for v in values for u in users[v]]
    if not uses:
        return False
    ops = []
    for u in uses:
        if u["op"] in ("dynamic-slice", "slice"):
            ops.append(u["op"])
            continue
        called = re.search(r"calls=%([\w.\-]+)", u["attrs"])
        if u["op"] != "fusion" or not called:
            return False
        fused = body[called[1]]
        operands = re.findall(r"%([\w.\-]+)", u["operands"])
        for index in (i for i, o in enumerate(operands) if o in values):
            param = next((f["name"] for f in fused
                          if f["op"] == "parameter" and f["operands"].strip() == str(index)), None)
            inside = [f for f in fused if param and re.search(rf"%{re.escape(param)}(?![\w.\-])", f["operands"])]
            if not inside or any(f["op"] not in ("dynamic-slice", "slice") for f in inside):
                return False
            ops += [f["op"] for f in inside]
    return "dynamic-slice" in ops or len(ops) == 1


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


def _reachable(roots: set[str], calls: dict[str, list[tuple[str, int]]]) -> set[str]:
    """``roots`` and every computation they call, directly or not."""
    seen, todo = set(), list(roots)
    while todo:
        comp = todo.pop()
        if comp not in seen:
            seen.add(comp)
            todo.extend(callee for callee, _ in calls.get(comp, ()))
    return seen


def attribute(found: list[Collective], axis_names: tuple[str, ...],
              axis_sizes: tuple[int, ...]) -> list[Collective]:
    """Name the mesh axes each collective's groups span. Partition ``i`` is the ``i``-th device
    of the mesh in row-major order (how jit assigns a mesh's devices)."""
    coords = np.stack(np.unravel_index(np.arange(math.prod(axis_sizes)), axis_sizes), axis=1)
    out = []
    for c in found:
        varying = set()
        for g in c.groups:
            members = coords[list(g)]
            varying |= {axis_names[i] for i in np.flatnonzero((members != members[0]).any(axis=0))}
        out.append(replace(c, axes=tuple(a for a in axis_names if a in varying)))
    return out


def summary(found: list[Collective]) -> list[dict]:
    """``[{kind, count, bytes}]`` per kind, per device per step (the report's ``collectives``),
    with ``sent_bytes`` of the ring model."""
    by_kind: dict[str, list[Collective]] = defaultdict(list)
    for c in found:
        by_kind[c.kind].append(c)
    return [{"kind": k, "count": sum(c.executions for c in cs),
             "bytes": sum(c.bytes * c.executions for c in cs),
             "sent_bytes": round(sum(c.sent_bytes * c.executions for c in cs))}
            for k, cs in sorted(by_kind.items())]


def loop_states(text: str) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The arrays each while loop of the module carries (its tuple's elements), per device.

    A scanned model's forward loop hands everything the backward loop needs through its state,
    stacked over the layers: what is kept for the backward pass can be read off these."""
    out = []
    for line in text.splitlines():
        m = _INSTR.match(line)
        if m and m["op"] == "while":
            out.append(_arrays(m["shape"]))
    return out


def fingerprint(hlo_text: str) -> str:
    """A short hash of a compiled program's HLO without its source metadata: two runs compiled
    the same program exactly when their fingerprints agree (what a flag changed, at a glance)."""
    import hashlib

    # The module's header (entry layout, aliasing, partitions) and its computations: the source
    # tables between them (file names, stack frames) and each instruction's metadata say where
    # the code came from, and a program loaded from the compilation cache carries fewer of them.
    lines = [line for line in hlo_text.splitlines() if re.match(r"\s*(?:ROOT |ENTRY )?%|HloModule ", line)]
    text = re.sub(r",? metadata=\{[^{}]*\}", "", "\n".join(lines))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# A layout's memory space: S(5) is the host (XLA's kHostMemorySpace), as in f32[8]{0:S(5)}.
_HOST_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+\d*(?:[a-z]+\d*)*)\[(?P<dims>[\d,]*)\]\{[^}]*S\(5\)[^}]*\}")


def host_argument_bytes(hlo_text: str) -> int:
    """Bytes of the compiled step's arguments that its entry layout places in host memory
    (``--offload``), per device. XLA:CPU keeps the annotation but backs both spaces with the
    same RAM, so its memory analysis counts them as ordinary arguments."""
    m = re.search(r"entry_computation_layout=\{\((?P<args>.*?)\)->", hlo_text)
    if m is None:
        return 0
    return sum(DTYPE_BYTES[a["dtype"]] * math.prod(int(d) for d in a["dims"].split(",") if d)
               for a in _HOST_ARRAY.finditer(m["args"]))
