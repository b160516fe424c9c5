"""A backward pass split in two: the input gradient now (B), the weight gradient later (W).

Zero-bubble pipeline schedules (Qi et al. 2023) run a stage's backward pass as two parts: B,
the gradient of the stage's input, which the previous stage waits for, and W, the gradient of
its weights, which nothing waits for and so can fill the pipeline's idle ticks. A weight's
gradient needs the cotangent of each matmul it feeds, which B computes on its way to the
input; so B hands W what it needs (those cotangents, and whatever else W reads of B's work) and
W computes the rest, with no matmul run twice.

JAX gives the backward pass as one function (a ``jax.vjp`` pullback). :func:`split` traces it
to a jaxpr and partitions its equations by what each output needs: B is what the input's
gradient needs; W what the weights' gradients need beyond it. The two parts run as
interpreters of that jaxpr, binding each equation's primitive where it is traced, so they
become ordinary parts of the program they are called in. A ``scan`` (the layer stack) is split
the same way inside: B scans its part of the body and stacks, per iteration, what W reads of
it; W scans the rest over that stack. Calls (``jit``, ``remat``) are entered as if inlined. A
``shard_map`` region (tensor parallelism's column projections, the experts' dispatch) is split
into two regions over the same mesh axes: B's hands W, per device, what W reads of it (each
value out of the region and back in with a leading dim split over the axes it varies over), so
the matmuls of the weights a region takes run in W like any other's.
An equation both parts need that is cheap (no matmul, no collective) and made from the
residuals alone -- what a remat policy recomputes of the forward pass, such as a norm's output,
or a region that only reshapes a saved matmul output -- runs in both, so W keeps no copy of
it from B; any other runs in B, its outputs handed to W. A matmul W alone reads that runs
the forward pass again (made from the residuals alone: the attention's output under
``dots_no_batch``) runs in B where its output is smaller than its inputs, so W is handed the
output rather than the inputs (the L x L probabilities). A weight whose gradient takes no
matmul beyond B's (a norm's scale, a bias) B computes whole where that hands W fewer bytes:
the gradient is the weight's size, the cotangent W would reduce for it an activation's (weights
that reduce the same cotangent, a LayerNorm's scale and bias, are weighed together).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import numpy as np
from jax.extend import core
from jax.sharding import PartitionSpec as P

from jaxshard import remat

_CALLS = ("jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint")
_MANUAL = ("shard_map",)


def _is_var(v) -> bool:
    return isinstance(v, core.Var) and not isinstance(v, core.Literal)


def _inner(eqn) -> tuple[core.Jaxpr, list]:
    """A call's body and its constants."""
    j = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if isinstance(j, core.ClosedJaxpr):
        return j.jaxpr, list(j.consts)
    return j, []


@dataclass
class _Plan:
    """How one jaxpr's equations split. ``role[i]``: "B", "W", "BW" (run by both), "call",
    "scan" or "manual" (a ``shard_map`` region; split inside: ``sub[i]``), or None (needed by
    neither). ``stash``: the variables B defines (or the jaxpr takes but W will not be given)
    that W reads."""

    jaxpr: core.Jaxpr
    role: list = field(default_factory=list)
    sub: dict = field(default_factory=dict)
    stash: list = field(default_factory=list)
    in_b: list = field(default_factory=list)  # per invar: B reads it
    in_w: list = field(default_factory=list)  # per invar: W reads it
    # A split scan's carries: which B carries, which W carries (the rest dead); per output of
    # the scan, whether B's scan makes it and whether W's does.
    b_carry: list = field(default_factory=list)
    w_carry: list = field(default_factory=list)
    out_b: list = field(default_factory=list)
    w_outs: list = field(default_factory=list)
    # A split region's hand-over from B to W: the stash's tree and, per leaf, the region's axes
    # it varies over (its specs out of B's region and into W's); set when B is first traced.
    carried: tuple | None = None


def _cheap(eqn) -> bool:
    """An equation W may run again rather than be handed its result: no matmul, no body of its
    own, no effects or randomness (an elementwise op, a reduction, a reshape); a call or a
    ``shard_map`` region made of such equations alone. (A collective is not one: its named
    axis is an effect. W would send its bytes again.)"""
    name = eqn.primitive.name
    if name in _CALLS or name in _MANUAL:  # (jax.nn.silu is a jit call; a TP region may only reshape)
        return not eqn.effects and all(_cheap(e) for e in _inner(eqn)[0].eqns)
    return (name not in _COSTLY and "random" not in name and "rng" not in name and not eqn.effects
            and not any(isinstance(v, (core.Jaxpr, core.ClosedJaxpr)) for v in eqn.params.values()))


_COSTLY = ("dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general", "threefry2x32")


def _gathered(eqn) -> bool:
    """ZeRO-3/FSDP's gather of a weight for compute (a sharding constraint the partitioner
    makes an all-gather): B runs it and hands W its result, a weight, rather than W sending its
    bytes again."""
    return remat.is_gathered(eqn.primitive, eqn.params)


def _derivable(jaxpr: core.Jaxpr, free: set) -> set:
    """``free`` (the variables W has without B: the residuals it is given), what cheap
    equations make of them alone, in order, and the weights :func:`_gathered` makes of them (B
    hands those on: the size of a weight, where what W makes of them, a norm's output or an
    activation, is the size of an activation)."""
    free = set(free) | set(jaxpr.constvars)
    for eqn in jaxpr.eqns:
        if (_cheap(eqn) or _gathered(eqn)) and all(not _is_var(v) or v in free for v in eqn.invars):
            free |= set(eqn.outvars)
    return free


def _forward(jaxpr: core.Jaxpr, free: set) -> set:
    """The variables made from ``free`` (the residuals) by any equations: the forward pass a
    remat policy runs again, matmuls included (what the cotangent reaches is not in it)."""
    made = set(free) | set(jaxpr.constvars)
    for eqn in jaxpr.eqns:
        if not eqn.effects and all(not _is_var(v) or v in made for v in eqn.invars):
            made |= set(eqn.outvars)
    return made


def _b_needs(jaxpr: core.Jaxpr, out_b: list[bool]) -> set:
    """What B's outputs are made from (a nested equation taken whole): what B makes anyway."""
    live = {v for v, b in zip(jaxpr.outvars, out_b) if b and _is_var(v)}
    for eqn in reversed(jaxpr.eqns):
        if any(v in live for v in eqn.outvars):
            live |= {v for v in eqn.invars if _is_var(v)}
    return live


def _b_runs_it(eqn, again: set, forward: set, b_needs: set) -> bool:
    """Whether B, not W, runs a matmul only W needs: where it is the forward pass run again
    (made from the residuals alone: the attention's output under ``dots_no_batch``, which the
    output projection's weight gradient reads), B makes its inputs anyway (or W makes them
    from the residuals cheaply), and its output is smaller than those W would be handed to run
    it (the attention's probabilities: 8x its output at 8 heads of 8). It runs once either
    way; W is handed it instead of its inputs. (An input W would make with a matmul of its
    own, handing nothing, keeps the matmul in W: B would make that input too.)"""
    ins = {v for v in eqn.invars if _is_var(v)}
    if eqn.primitive.name not in _COSTLY or not ins <= forward or not ins <= again | b_needs:
        return False
    return sum(_bytes(v) for v in eqn.outvars) < sum(_bytes(v) for v in ins - again)


def _plan(jaxpr: core.Jaxpr, out_b: list[bool], out_w: list[bool], w_has: set, free: set = frozenset(),
          out: bool = False) -> _Plan:
    """Partition ``jaxpr`` given which outputs B and W produce. ``w_has``: the invars W is
    given (others it reads are stashed). B defines whatever B needs; W what only W needs. What
    both need, W runs again where it is cheap and made from ``free`` invars alone (the
    residuals: a norm's output, an activation under the ``dots`` policies), rather than keep
    B's result from B to W; else B runs it and hands it over."""
    plan = _Plan(jaxpr, [None] * len(jaxpr.eqns))
    live_b = {v for v, b in zip(jaxpr.outvars, out_b) if b and _is_var(v)}
    live_w = {v for v, w in zip(jaxpr.outvars, out_w) if w and _is_var(v)}
    w_side: set = set()  # variables W defines
    again = _derivable(jaxpr, free)
    forward, b_needs = _forward(jaxpr, free), _b_needs(jaxpr, out_b)
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        ob = [v in live_b for v in eqn.outvars]
        ow = [v in live_w for v in eqn.outvars]
        if not any(ob) and not any(ow):
            continue
        name = eqn.primitive.name
        if any(ob) and any(ow) and eqn.outvars[0] in again and _cheap(eqn):
            plan.role[i] = "BW"  # run by both
            live_b |= {v for v in eqn.invars if _is_var(v)}
            live_w |= {v for v in eqn.invars if _is_var(v)}
            w_side |= set(eqn.outvars)
        elif (name in _CALLS or name in _MANUAL) and any(ow):
            inner, _ = _inner(eqn)
            sub = _plan(inner, ob, [w and not b for b, w in zip(ob, ow)], set(inner.invars),
                        {iv for iv, v in zip(inner.invars, eqn.invars) if not _is_var(v) or v in again}, out)
            plan.role[i], plan.sub[i] = "call" if name in _CALLS else "manual", sub
            sub.out_b = ob
            _mark(eqn.invars, sub.in_b, sub.in_w, live_b, live_w)
            w_side |= {v for v, d in zip(eqn.outvars, _w_defined(sub)) if d}
        elif name == "scan" and any(ow) and not all(ob[k] or not ow[k] for k in range(len(ob))):
            sub = _plan_scan(eqn, ob, ow, again, out)
            plan.role[i], plan.sub[i] = "scan", sub
            _mark(eqn.invars, sub.in_b, sub.in_w, live_b, live_w)
            w_side |= {v for v, d in zip(eqn.outvars, sub.w_outs) if d}
        elif any(ob) or _b_runs_it(eqn, again, forward, b_needs):
            plan.role[i] = "B"
            live_b |= {v for v in eqn.invars if _is_var(v)}
        else:
            plan.role[i] = "W"
            live_w |= {v for v in eqn.invars if _is_var(v)}
            w_side |= set(eqn.outvars)
    stash = {v for v in live_w if v not in w_side and v not in w_has}
    # (a split call only where B reads all it takes, so that B can run it whole too)
    whole = {i for i, sub in plan.sub.items() if plan.role[i] == "call"
             and all(b or not _is_var(v) for v, b in zip(jaxpr.eqns[i].invars, sub.in_b))}
    for i in _fewer_bytes(jaxpr, plan.role, stash, w_side | (w_has & live_w) | set(jaxpr.constvars), free, out,
                          whole):
        plan.role[i] = "BW"  # W makes it again from fewer bytes (a cheap call whole, not split)
        plan.sub.pop(i, None)
        live_w |= {v for v in jaxpr.eqns[i].invars if _is_var(v)}
        w_side |= set(jaxpr.eqns[i].outvars)
    plan.in_b = [v in live_b for v in jaxpr.invars]
    plan.in_w = [v in live_w for v in jaxpr.invars]
    plan.stash = [v for v in _ordered(jaxpr, live_w) if v not in w_side and v not in w_has]
    return plan


def _fewer_bytes(jaxpr: core.Jaxpr, role: list, stash: set, has: set, free: set, out: bool,
                 whole: set) -> list[int]:
    """The equations B runs that W should run too, so that B hands W the fewest bytes: a
    minimum cut between what only B can make (a matmul's output, a collective's, a nested
    part's, an input W is not given) and what W reads of B's work (``stash``), through cheap
    equations W can run again, each value costing its bytes if handed over (``has``: what W
    has without being handed it; ``free``: the inputs made of residuals alone; ``out``: an
    input made by B outside wins a tie; ``whole``: the split calls B can run whole). So a
    SwiGLU's two gates' gradients, each made from the gradient of their product and the
    residual gates by elementwise ops, are made again by W from that one gradient: half the
    bytes."""
    if not stash:
        return []
    producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    rerun = {i for i, e in enumerate(jaxpr.eqns) if (role[i] == "B" or i in whole) and _cheap(e)}
    # The values W reads, and what the cheap equations make them from, back to what it has.
    need, todo = set(), list(stash)
    while todo:
        v = todo.pop()
        if v in need or v in has:
            continue
        need.add(v)
        if producer.get(v) in rerun:
            todo += [u for u in jaxpr.eqns[producer[v]].invars if _is_var(u)]
    # Each value a pair of nodes (v, 0) -> (v, 1), its bytes apart; from the source where only
    # B makes it; each rerun equation's inputs into its outputs; what W reads into the sink.
    inf = 1 << 62
    cap: dict = {"s": {}, "t": {}}

    def edge(a, b, c):
        cap.setdefault(a, {})[b] = cap.get(a, {}).get(b, 0) + c
        cap.setdefault(b, {}).setdefault(a, 0)

    invars = set(jaxpr.invars)
    for v in need:
        # A tie goes to what is handed now over a residual W does not read yet; and (``out``)
        # to an input made by B outside over what is made of it here, so that the level
        # outside decides how W gets it (it may make it again there, out of a region's way).
        edge((v, 0), (v, 1), 2 * _bytes(v) + (v in invars) * (1 if v in free or not out else -1))
        if producer.get(v) not in rerun:
            edge("s", (v, 0), inf)
        else:
            for u in jaxpr.eqns[producer[v]].invars:
                if _is_var(u) and u in need:
                    edge((u, 1), (v, 0), inf)
        if v in stash:
            edge((v, 1), "t", inf)
    # The cut nearest the sink: W makes again only what it must.
    sink = _sink_side(cap)
    return sorted({producer[v] for v in need if (v, 0) in sink and producer.get(v) in rerun})


def _sink_side(cap: dict) -> set:
    """The nodes on the sink's side of the minimum cut from ``"s"`` to ``"t"`` nearest the
    sink, for residual capacities ``cap[a][b]`` (every edge's reverse present, at 0): a
    maximum flow by shortest augmenting paths (Edmonds-Karp), then what still reaches ``"t"``
    in the residual graph. ``cap`` is used up."""
    while True:
        back, queue = {"s": None}, collections.deque(["s"])
        while queue and "t" not in back:
            a = queue.popleft()
            for b, c in cap[a].items():
                if c > 0 and b not in back:
                    back[b] = a
                    queue.append(b)
        if "t" not in back:
            break
        path, b = [], "t"
        while back[b] is not None:
            path.append((back[b], b))
            b = back[b]
        flow = min(cap[a][b] for a, b in path)
        for a, b in path:
            cap[a][b] -= flow
            cap[b][a] += flow
    sink, queue = {"t"}, ["t"]
    while queue:
        b = queue.pop()
        for a in cap[b]:
            if a not in sink and cap[a][b] > 0:
                sink.add(a)
                queue.append(a)
    return sink


def _ordered(jaxpr: core.Jaxpr, vs: set) -> list:
    """``vs`` in a fixed order: invars, then equation outputs as defined."""
    order = list(jaxpr.invars) + list(jaxpr.constvars) + [v for e in jaxpr.eqns for v in e.outvars]
    return [v for v in order if v in vs]


def _mark(invars, in_b, in_w, live_b, live_w) -> None:
    for v, b, w in zip(invars, in_b, in_w):
        if _is_var(v):
            if b:
                live_b.add(v)
            if w:
                live_w.add(v)


def _w_defined(plan: _Plan) -> list[bool]:
    """Per outvar of a planned jaxpr: W defines it (an input W reads, passed through, too)."""
    defined = {v for v, w in zip(plan.jaxpr.invars, plan.in_w) if w}
    for i, eqn in enumerate(plan.jaxpr.eqns):
        if plan.role[i] in ("W", "BW"):
            defined |= set(eqn.outvars)
        elif plan.role[i] in ("call", "manual"):
            defined |= {v for v, d in zip(eqn.outvars, _w_defined(plan.sub[i])) if d}
        elif plan.role[i] == "scan":
            defined |= {v for v, d in zip(eqn.outvars, plan.sub[i].w_outs) if d}
    return [_is_var(v) and v in defined for v in plan.jaxpr.outvars]


def _b_wants(sub: _Plan) -> list[bool]:
    """Per output of a split call or region: B's part makes it -- what B reads of it after
    the call (even where W makes it too) and whatever W does not make."""
    return [b or not w for b, w in zip(sub.out_b, _w_defined(sub))]


def _plan_scan(eqn, ob: list[bool], ow: list[bool], free: set = frozenset(), out: bool = False) -> _Plan:
    """A scan split in two scans: B's carries are those B needs or B's part of the body reads;
    W's the rest that W needs. Per iteration B stacks what W's part of the body reads of it.
    ``free``: the outer variables W has without B (its consts and xs among them are free in
    the body; its carries are not)."""
    p = eqn.params
    body = p["jaxpr"].jaxpr
    n_c, n_k = p["num_consts"], p["num_carry"]
    n_y = len(body.outvars) - n_k
    inner_free = {iv for k, (iv, v) in enumerate(zip(body.invars, eqn.invars))
                  if not n_c <= k < n_c + n_k and (not _is_var(v) or v in free)}
    b_carry = [ob[k] for k in range(n_k)]
    while True:
        out_b = b_carry + ob[n_k:]
        out_w = [ow[k] and not b_carry[k] for k in range(n_k)] + [ow[n_k + j] and not ob[n_k + j] for j in range(n_y)]
        # W's carries are its own (given); B's carried values W reads are stashed per iteration.
        w_carry_in = [body.invars[n_c + k] for k in range(n_k) if not b_carry[k]]
        w_has = set(body.invars[:n_c]) | set(w_carry_in) | set(body.invars[n_c + n_k:])
        sub = _plan(body, out_b, out_w, w_has, inner_free, out)
        grown = [b or sub.in_b[n_c + k] for k, b in enumerate(b_carry)]
        if grown == b_carry:
            break
        b_carry = grown
    # A W carry lives if W reads it or needs its final value.
    sub.b_carry = b_carry
    sub.w_carry = [not b_carry[k] and (out_w[k] or sub.in_w[n_c + k]) for k in range(n_k)]
    if any(w and not o for w, o in zip(sub.w_carry, out_w[:n_k])):
        # A carry W reads but whose update W does not make: make it (W's part of the body
        # computes the carry's new value too).
        out_w = [o or w for o, w in zip(out_w[:n_k], sub.w_carry)] + out_w[n_k:]
        w_carry_in = [body.invars[n_c + k] for k in range(n_k) if not b_carry[k]]
        w_has = set(body.invars[:n_c]) | set(w_carry_in) | set(body.invars[n_c + n_k:])
        sub2 = _plan(body, out_b, out_w, w_has, inner_free, out)
        sub2.b_carry, sub2.w_carry = sub.b_carry, sub.w_carry
        sub = sub2
    sub.w_outs = out_w[:n_k] + out_w[n_k:]  # per scan output: W's scan makes it
    sub.out_b = out_b
    # The outer operands: B needs the consts and xs its body reads and the B carries' inits;
    # W the consts and xs its body reads and the W carries' inits.
    in_b = list(sub.in_b)
    in_w = list(sub.in_w)
    for k in range(n_k):
        in_b[n_c + k] = b_carry[k]
        in_w[n_c + k] = sub.w_carry[k]
    sub.in_b, sub.in_w = in_b, in_w
    return sub


# ---- running the two parts ---------------------------------------------------------------

def _read(env: dict, v):
    return v.val if isinstance(v, core.Literal) else env[v]


def _bind(eqn, args: list) -> list:
    """The equation's primitive applied to ``args`` where it is traced (as ``eval_jaxpr``
    binds it: call primitives such as ``shard_map`` take their body as a function)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns = ()
    if isinstance(params, tuple):  # (some versions: the subfunctions, then the params)
        subfuns, params = params
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*subfuns, *args, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _run_b(plan: _Plan, consts: list, args: list, want: list[bool]) -> tuple[list, list]:
    """B's part of ``plan.jaxpr`` on ``args`` (None where B does not read an input): the
    outputs ``want`` marks (None elsewhere) and the stash."""
    jaxpr = plan.jaxpr
    env = dict(zip(jaxpr.constvars, consts))
    env.update({v: a for v, a in zip(jaxpr.invars, args) if a is not None})
    for i, eqn in enumerate(jaxpr.eqns):
        role = plan.role[i]
        if role in ("B", "BW"):
            env.update(zip(eqn.outvars, _bind(eqn, [_read(env, v) for v in eqn.invars])))
        elif role == "call":
            inner, inner_consts = _inner(eqn)
            sub = plan.sub[i]
            outs, stash = _run_b(sub, inner_consts, [_read(env, v) if b else None
                                                     for v, b in zip(eqn.invars, sub.in_b)],
                                 _b_wants(sub))
            env.update({v: o for v, o in zip(eqn.outvars, outs) if o is not None})
            env[("stash", i)] = stash
        elif role == "manual":
            outs, stash = _region_b(eqn, plan.sub[i], env)
            env.update({v: o for v, o in zip(eqn.outvars, outs) if o is not None})
            env[("stash", i)] = stash
        elif role == "scan":
            outs, stash = _scan_b(eqn, plan.sub[i], env)
            env.update({v: o for v, o in zip(eqn.outvars, outs) if o is not None})
            env[("stash", i)] = stash
    outs = [_read(env, v) if w and (not _is_var(v) or v in env) else None for v, w in zip(jaxpr.outvars, want)]
    return outs, _collect(plan, env)


def _collect(plan: _Plan, env: dict) -> list:
    """The stash: this level's variables, then each split equation's own, in order."""
    own = [env[v] for v in plan.stash]
    nested = [env[("stash", i)] for i in sorted(plan.sub)]
    return [own, nested]


def _run_w(plan: _Plan, consts: list, args: list, stash: list) -> list:
    """W's part: ``args`` the inputs W is given (None elsewhere), ``stash`` B's."""
    jaxpr = plan.jaxpr
    env = dict(zip(jaxpr.constvars, consts))
    env.update({v: a for v, a in zip(jaxpr.invars, args) if a is not None})
    own, nested = stash
    env.update(zip(plan.stash, own))
    nested = dict(zip(sorted(plan.sub), nested))
    for i, eqn in enumerate(jaxpr.eqns):
        role = plan.role[i]
        if role in ("W", "BW"):
            env.update(zip(eqn.outvars, _bind(eqn, [_read(env, v) for v in eqn.invars])))
        elif role == "call":
            inner, inner_consts = _inner(eqn)
            sub = plan.sub[i]
            outs = _run_w(sub, inner_consts, [_read(env, v) if w and (not _is_var(v) or v in env) else None
                                              for v, w in zip(eqn.invars, sub.in_w)], nested[i])
            env.update({v: o for v, o, d in zip(eqn.outvars, outs, _w_defined(sub)) if d})
        elif role == "manual":
            outs = _region_w(eqn, plan.sub[i], env, nested[i])
            env.update({v: o for v, o in zip(eqn.outvars, outs) if o is not None})
        elif role == "scan":
            outs = _scan_w(eqn, plan.sub[i], env, nested[i])
            env.update({v: o for v, o in zip(eqn.outvars, outs) if o is not None})
    return [_read(env, v) if (not _is_var(v) or v in env) else None for v in jaxpr.outvars]


def _scan_b(eqn, sub: _Plan, env: dict) -> tuple[list, list]:
    p = eqn.params
    body, body_consts = p["jaxpr"].jaxpr, list(p["jaxpr"].consts)
    n_c, n_k = p["num_consts"], p["num_carry"]
    operands = [_read(env, v) if b else None for v, b in zip(eqn.invars, sub.in_b)]
    consts, init, xs = operands[:n_c], operands[n_c:n_c + n_k], operands[n_c + n_k:]
    b_idx = [k for k in range(n_k) if sub.b_carry[k]]
    x_idx = [j for j, x in enumerate(xs) if x is not None]
    y_idx = [j for j, b in enumerate(sub.out_b[n_k:]) if b]

    def step(carry, x):
        args = list(consts) + [None] * n_k + [None] * len(xs)
        for k, c in zip(b_idx, carry):
            args[n_c + k] = c
        for j, v in zip(x_idx, x):
            args[n_c + n_k + j] = v
        want = sub.out_b
        outs, stash = _run_b(sub, body_consts, args, want)
        return [outs[k] for k in b_idx], ([outs[n_k + j] for j in y_idx], stash)

    carry, (ys, stash) = jax.lax.scan(step, [init[k] for k in b_idx], [xs[j] for j in x_idx],
                                      length=p["length"], reverse=p["reverse"])
    outs = [None] * (n_k + len(body.outvars) - n_k)
    for k, c in zip(b_idx, carry):
        outs[k] = c
    for j, y in zip(y_idx, ys):
        outs[n_k + j] = y
    return outs, stash


def _scan_w(eqn, sub: _Plan, env: dict, stash: list) -> list:
    p = eqn.params
    body, body_consts = p["jaxpr"].jaxpr, list(p["jaxpr"].consts)
    n_c, n_k = p["num_consts"], p["num_carry"]
    operands = [_read(env, v) if w and (not _is_var(v) or v in env) else None
                for v, w in zip(eqn.invars, sub.in_w)]
    consts, init, xs = operands[:n_c], operands[n_c:n_c + n_k], operands[n_c + n_k:]
    w_idx = [k for k in range(n_k) if sub.w_carry[k]]
    x_idx = [j for j, x in enumerate(xs) if x is not None]
    n_y = len(body.outvars) - n_k
    y_idx = [j for j in range(n_y) if sub.w_outs[n_k + j]]

    def step(carry, x):
        x_vals, stash_i = x
        args = list(consts) + [None] * n_k + [None] * len(xs)
        for k, c in zip(w_idx, carry):
            args[n_c + k] = c
        for j, v in zip(x_idx, x_vals):
            args[n_c + n_k + j] = v
        outs = _run_w(sub, body_consts, args, stash_i)
        return [outs[k] for k in w_idx], [outs[n_k + j] for j in y_idx]

    carry, ys = jax.lax.scan(step, [init[k] for k in w_idx], ([xs[j] for j in x_idx], stash),
                             length=p["length"], reverse=p["reverse"])
    outs = [None] * len(body.outvars)
    for k, c in zip(w_idx, carry):
        outs[k] = c
    for j, y in zip(y_idx, ys):
        outs[n_k + j] = y
    return outs


# ---- shard_map regions -------------------------------------------------------------------

def _varying(aval) -> frozenset:
    """The manual axes a value inside a ``shard_map`` varies over (its type says so)."""
    kind = getattr(aval, "manual_axis_type", None)
    return frozenset(kind.varying if kind is not None else getattr(aval, "vma", ()))


def _devices(aval, region: tuple | None) -> int:
    """The devices of a region's axes a value of it varies over (1 outside a region)."""
    if region is None:
        return 1
    sizes, typed = region
    return int(np.prod([n for a, n in sizes.items() if a in _varying(aval) or not typed]))


def _region(eqn) -> tuple:
    """A ``shard_map`` equation's (mesh, in_specs, out_specs, {its manual axes: size}, check_vma)."""
    p = eqn.params
    axes = p.get("newly_manual_axes", p.get("axis_names", p.get("manual_axes")))
    mesh = p["mesh"]
    return (mesh, p["in_specs"], p["out_specs"], {a: dict(mesh.shape)[a] for a in axes},
            p["check_vma"] if "check_vma" in p else p["check_rep"])


def _hand_out(leaves: list, axes: frozenset, typed: bool) -> tuple[list, list]:
    """Per-device values out of a region: each with a leading dim split over the region's axes
    it varies over (a value that varies over none is the same on each and leaves as it is).
    ``typed``: the region checks what varies (else every value is taken to vary over all)."""
    specs, out = [], []
    for x in leaves:
        over = tuple(sorted(_varying(jax.typeof(x)) & axes if typed else axes))
        specs.append(P(over) if over else P())
        out.append(x[None] if over else x)
    return out, specs


def _region_b(eqn, sub: _Plan, env: dict) -> tuple[list, list]:
    """B's part of a ``shard_map`` region, a region of its own over the same axes: the
    region's outputs B makes (None elsewhere) and, handed out per device, its stash."""
    mesh, in_specs, out_specs, sizes, check = _region(eqn)
    inner, inner_consts = _inner(eqn)
    reads = [k for k, b in enumerate(sub.in_b) if b]
    want = _b_wants(sub)
    found: dict = {}

    def body(*xs):
        args = [None] * len(inner.invars)
        for k, x in zip(reads, xs):
            args[k] = x
        outs, stash = _run_b(sub, inner_consts, args, want)
        leaves, tree = jax.tree.flatten(stash)
        leaves, specs = _hand_out(leaves, frozenset(sizes), check)
        made = [k for k, o in enumerate(outs) if o is not None]
        found.update(made=made, carried=(tree, tuple(specs)))
        return [outs[k] for k in made], leaves

    args = [_read(env, eqn.invars[k]) for k in reads]
    specs_in = tuple(in_specs[k] for k in reads)

    def region(fn, specs_out):
        return jax.shard_map(fn, mesh=mesh, in_specs=specs_in, out_specs=specs_out,
                             axis_names=frozenset(sizes), check_vma=check)(*args)

    # Traced once for what B makes and how its stash leaves (both static), then run.
    jax.eval_shape(lambda: region(lambda *xs: (body(*xs), ())[1], ()))
    made, (tree, specs) = found["made"], found["carried"]
    sub.carried = (tree, specs)
    outs_made, stash = region(body, ([out_specs[k] for k in made], list(specs)))
    outs = [None] * len(inner.outvars)
    for k, o in zip(made, outs_made):
        outs[k] = o
    return outs, stash


def _region_w(eqn, sub: _Plan, env: dict, stash: list) -> list:
    """W's part of a ``shard_map`` region, a region of its own over the same axes, given
    B's stash as :func:`_region_b` handed it out: the region's outputs W makes."""
    if sub.carried is None:
        raise AssertionError("a region's W traced before its B")
    mesh, in_specs, out_specs, sizes, check = _region(eqn)
    inner, inner_consts = _inner(eqn)
    tree, specs = sub.carried
    reads = [k for k, (v, w) in enumerate(zip(eqn.invars, sub.in_w)) if w and (not _is_var(v) or v in env)]
    made = [k for k, d in enumerate(_w_defined(sub)) if d]

    def body(xs, leaves):
        args = [None] * len(inner.invars)
        for k, x in zip(reads, xs):
            args[k] = x
        leaves = [x[0] if spec != P() else x for x, spec in zip(leaves, specs)]
        outs = _run_w(sub, inner_consts, args, jax.tree.unflatten(tree, leaves))
        return [outs[k] for k in made]

    made_outs = jax.shard_map(body, mesh=mesh, in_specs=([in_specs[k] for k in reads], list(specs)),
                              out_specs=[out_specs[k] for k in made], axis_names=frozenset(sizes),
                              check_vma=check)([_read(env, eqn.invars[k]) for k in reads], stash)
    outs = [None] * len(inner.outvars)
    for k, o in zip(made, made_outs):
        outs[k] = o
    return outs


def _matmuls(eqn) -> int:
    """The matmuls an equation runs (a scan's body's, times its length)."""
    name = eqn.primitive.name
    if name in _COSTLY:
        return 1
    if name in _CALLS or name in _MANUAL:
        return sum(_matmuls(e) for e in _inner(eqn)[0].eqns)
    if name == "scan":
        return eqn.params["length"] * sum(_matmuls(e) for e in eqn.params["jaxpr"].jaxpr.eqns)
    return 0


def _b_matmuls(plan: _Plan) -> int:
    """The matmuls B runs under ``plan``."""
    n = 0
    for i, eqn in enumerate(plan.jaxpr.eqns):
        if plan.role[i] in ("B", "BW"):
            n += _matmuls(eqn)
        elif plan.role[i] in ("call", "manual"):
            n += _b_matmuls(plan.sub[i])
        elif plan.role[i] == "scan":
            n += eqn.params["length"] * _b_matmuls(plan.sub[i])
    return n


def _bytes(v) -> int:
    return v.aval.size * v.aval.dtype.itemsize


def _stash_bytes(plan: _Plan, region: tuple | None = None) -> int:
    """The bytes B hands W under ``plan`` (a scan's, per iteration, times its length; a
    region's, per device, times the devices of the axes each value varies over). ``region``:
    ({axis: size}, whether it checks what varies) of the region ``plan`` is the body of."""
    n = sum(_bytes(v) * _devices(v.aval, region) for v in plan.stash)
    for i, sub in plan.sub.items():
        eqn = plan.jaxpr.eqns[i]
        if plan.role[i] == "manual":
            n += _stash_bytes(sub, (_region(eqn)[3], _region(eqn)[4]))
        else:
            n += _stash_bytes(sub, region) * (eqn.params["length"] if plan.role[i] == "scan" else 1)
    return n


@dataclass(frozen=True)
class Split:
    """A pullback split in two. ``b(residuals, cotangent) -> (the input gradient's leaves,
    stash)``; ``w(residuals, stash) -> the weight gradients' leaves``; ``out_tree``: the
    pullback's output structure (the weights' leaves first)."""

    b: Callable[..., Any]
    w: Callable[..., Any]
    out_tree: Any
    w_reads: tuple[bool, ...]  # per leaf of the residuals: W reads it (else it is B's alone)
    in_b: tuple[int, ...] = ()  # the weight gradients B computes and hands W whole


def split(pullback: Callable, residuals: Any, cotangent: Any, n_weights: int) -> Split:
    """Split ``pullback(residuals, cotangent)`` -- whose output's first ``n_weights`` leaves
    are the weight gradients and the rest the input's -- into B and W (module docstring).
    Traced once, with the shapes of ``residuals`` and ``cotangent``; W is given the residuals
    again (it reads them where it needs them), not the cotangent (what it reads of that is in
    the stash)."""
    n_res = len(jax.tree.leaves(residuals))
    closed, out_shape = jax.make_jaxpr(pullback, return_shape=True)(residuals, cotangent)
    jaxpr, consts = closed.jaxpr, list(closed.consts)
    n_out = len(jaxpr.outvars)

    def make(early: set, out: bool) -> tuple[_Plan, list[bool], list[bool]]:
        out_b = [k >= n_weights or k in early for k in range(n_out)]
        out_w = [k < n_weights and k not in early for k in range(n_out)]
        return _plan(jaxpr, out_b, out_w, set(jaxpr.invars[:n_res]), set(jaxpr.invars[:n_res]), out), out_b, out_w

    def kept(plan: _Plan) -> int:  # what B hands W and the residuals W reads (not B's alone)
        return _stash_bytes(plan) + sum(_bytes(v) for v, w in zip(jaxpr.invars[:n_res], plan.in_w) if w)

    def choose() -> tuple[int, set, tuple]:
        """(the bytes kept, the weights B makes whole, the plan).

        A weight whose gradient takes no matmul beyond B's (a norm's scale, a bias) is B's to
        compute, where that hands W less: W would need the cotangent it reduces, as large as an
        activation, where B hands on the gradient, as small as the weight. One at a time, then
        those left together (a LayerNorm's scale and bias reduce the same cotangent: either
        alone leaves W needing it), then each of those dropped again where that hands less."""
        early: set = set()
        made = make(early, False)
        matmuls, handed = _b_matmuls(made[0]), kept(made[0])

        def trial(ks: set):
            t = make(ks, False)
            if _b_matmuls(t[0]) != matmuls:
                return None, t
            return kept(t[0]) + sum(_bytes(jaxpr.outvars[k]) for k in ks), t

        rest = []
        for k in range(n_weights):
            cost, t = trial(early | {k})
            if cost is not None and cost <= handed:  # (a tie: B reduces it, not W)
                early.add(k)
                made, handed = t, cost
            elif cost is not None:
                rest.append(k)
        if len(rest) > 1:
            cost, t = trial(early | set(rest))
            if cost is not None and cost < handed:
                early |= set(rest)
                made, handed = t, cost
                for k in rest:
                    cost, t = trial(early - {k})
                    if cost is not None and cost < handed:
                        early.discard(k)
                        made, handed = t, cost
        return handed, early, made

    # An input of a call or region made outside goes out where that hands W no more bytes, the
    # same weights made whole: W makes a SwiGLU's gates' gradients outside tensor parallelism's
    # column regions from their product's, and where it does not (``selective``, whose gates
    # are B's alone) it is handed them outside the region, laid out as the gates B read, whose
    # place they then take (``pipeline.Handover``), not as each device's share out of the region.
    _, early, (plan, out_b, out_w) = choose()
    if kept((outside := make(early, True))[0]) <= kept(plan):
        plan, out_b, out_w = outside
    early_at = sorted(early)

    def b(res, cot):
        args = jax.tree.leaves(res) + jax.tree.leaves(cot)
        # (what B reads, and what it hands W as it is: the cotangent where W alone reads it)
        handed = set(plan.stash)
        outs, stash = _run_b(plan, consts, [a if r or v in handed else None
                                            for a, r, v in zip(args, plan.in_b, jaxpr.invars)], out_b)
        if any(outs[k] is None for k in range(len(outs)) if out_b[k]):
            raise AssertionError("B's part of the split backward pass left an output it owns unmade")
        return outs[n_weights:], [stash, [outs[k] for k in early_at]]

    def w(res, stash):
        stash, made = stash
        args = [a if r else None for a, r in zip(jax.tree.leaves(res), plan.in_w)]
        outs = _run_w(plan, consts, args + [None] * (len(jaxpr.invars) - n_res), stash)[:n_weights]
        for k, g in zip(early_at, made):
            outs[k] = g
        return outs

    return Split(b=b, w=w, out_tree=jax.tree.structure(out_shape), w_reads=tuple(plan.in_w[:n_res]),
                 in_b=tuple(early_at))
