"""Pipeline parallelism over the ``stage`` mesh axis: static schedules, one executor.

The layer stack is split along ``layers`` into P stages, stage ``s`` holding layers
``[s L/P, (s+1) L/P)``. A schedule is a table of ticks: at tick ``t`` stage ``s`` runs at most
one forward (of microbatch ``fwd[t, s]``) and one backward (of microbatch ``bwd[t, s]``); -1 is
an idle slot. One executor runs every table: a ``lax.scan`` over the ticks inside a
``shard_map`` manual over ``stage`` (the other axes stay with the partitioner), with
``ppermute`` carrying activations to the next stage and their gradients to the previous one
between ticks, and an explicit ``jax.vjp`` per stage and microbatch. Idle slots skip their work
(``lax.cond``), they do not compute and mask it; each op runs under a name scope of its own
(``TICK_SCOPE``), by which the waste figure counts its matmuls as the tables run it.

What a stage keeps between a microbatch's forward and its backward is what the backward pass
needs: the forward slot runs the stage's layers under ``jax.vjp`` and keeps the pullback's
residuals (what the model's remat policy saves: ``--remat full`` keeps each layer's input); the
backward slot applies them. So every stage does one forward and one backward per microbatch
-- the cost the bubble theory assumes -- and keeps ``slots`` microbatches' residuals, which the
schedule fixes: GPipe all M microbatches, 1F1B at most 2P - 1 whatever M is.

A zero-bubble schedule (ZB-H1) splits the backward slot: B computes the stage input's gradient
and hands W (``parallel.split_backward``) what the weights' gradients need, in the place of
the residuals only B read (:class:`Handover`), and W runs in a slot of its own, later; what a
neighbour sends and its F or B does not take in the tick it lands waits in an inbox slot until
then.

The two ends run inside the executor: stage 0 embeds its microbatch's tokens (and, backward,
takes the embedding's gradient), the last stage applies the head and the loss in its backward
slot, the same tick as its forward. The outer params (token table, final norm, head) are
replicated over ``stage``; their gradients -- the embedding's from stage 0, the head's from the
last stage -- are summed over ``stage`` once at the end, so a tied table's two uses make one
gradient before the update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxshard.axes import MeshAxis
from jaxshard.errors import ConfigError
from jaxshard.parallel import split_backward
from jaxshard.remat import Remat
from jaxshard.rules import StateKind

STAGE = str(MeshAxis.STAGE)
_BATCH = (str(MeshAxis.FSDP), str(MeshAxis.DATA))  # the axes that split a batch by its rows
SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1")
DEFAULT_SCHEDULE = "1f1b"  # with a stage axis and no --pipeline-schedule
DEFAULT_VIRTUAL = 2  # interleaved: chunks per stage without --virtual-stages
# Each op of a tick runs under a name scope of its own, ``TICK_SCOPE`` + its name, which the
# compiled program's instructions carry (their ``op_name``): so a branch's matmuls are counted
# as often as the tables run that op on a stage (``Schedule.op_runs``, ``hlo.dot_flops``), not
# once a tick. An idle branch runs under none: what it computed would count every tick.
TICK_SCOPE = "pipeline_tick_"


def _op(name: str):
    return jax.named_scope(TICK_SCOPE + name)


@dataclass(frozen=True)
class StageLayout:
    """Which layers each virtual stage runs, and where the stored stack keeps them.

    ``layers[u]`` consecutive layers make virtual stage ``u``; device ``u % P`` runs it as its
    chunk ``u // P`` (V = 1: chunk 0, stage ``u``). The stack is stored as P x V chunks of
    ``depth`` slots, device-major, so sharding its leading dim over ``stage`` gives each device
    its chunks; a chunk with fewer layers than ``depth`` has zero slots its stage skips. An even
    split without virtual stages (``trivial``) is the plain stack, unchanged.
    """

    stages: int
    virtual: int
    layers: tuple[int, ...]  # per virtual stage, in pipeline order

    @classmethod
    def make(cls, n_layers: int, stages: int, virtual: int = 1,
             stage_layers: tuple[int, ...] | None = None) -> "StageLayout":
        parts = stages * virtual
        if stage_layers is None:
            if n_layers % parts:
                split = f"stage={stages}" + (f" x --virtual-stages {virtual}" if virtual > 1 else "")
                raise ConfigError(f"{n_layers} layers are not divisible by {split}; "
                                  f"give --stage-layers or --balance")
            return cls(stages, virtual, (n_layers // parts,) * parts)
        stage_layers = tuple(stage_layers)
        if len(stage_layers) != parts:
            what = f"stage={stages} x --virtual-stages {virtual}" if virtual > 1 else f"stage={stages}"
            raise ConfigError(f"--stage-layers needs {parts} counts ({what}), got {len(stage_layers)}")
        if sum(stage_layers) != n_layers or min(stage_layers) < 1:
            raise ConfigError(f"--stage-layers {','.join(map(str, stage_layers))} must be counts >= 1 "
                              f"that sum to the model's {n_layers} layers")
        return cls(stages, virtual, stage_layers)

    @property
    def n_layers(self) -> int:
        return sum(self.layers)

    @property
    def depth(self) -> int:
        """Layer slots per chunk: the most layers any virtual stage runs."""
        return max(self.layers)

    @property
    def size(self) -> int:
        """Slots in the stored stack."""
        return self.stages * self.virtual * self.depth

    @property
    def padded(self) -> bool:
        return min(self.layers) < self.depth

    @property
    def trivial(self) -> bool:
        return self.virtual == 1 and not self.padded

    def layer_ids(self) -> np.ndarray:
        """``[P, V, depth]``: the model layer in each slot of each device's chunks (-1: none)."""
        ids = np.full((self.stages, self.virtual, self.depth), -1, np.int32)
        first = np.cumsum((0,) + self.layers[:-1])
        for u, (start, n) in enumerate(zip(first, self.layers)):
            ids[u % self.stages, u // self.stages, :n] = np.arange(start, start + n)
        return ids

    def index(self) -> np.ndarray:
        """``[n_layers]``: where the stored stack keeps each model layer."""
        flat = self.layer_ids().reshape(-1)
        where = np.empty(self.n_layers, np.int32)
        where[flat[flat >= 0]] = np.flatnonzero(flat >= 0)
        return where

    def to_stored(self, x: jax.Array) -> jax.Array:
        """A ``[n_layers, ...]`` stack laid out as stored (zeros in the empty slots)."""
        if self.trivial:
            return x
        return jnp.zeros((self.size, *x.shape[1:]), x.dtype).at[self.index()].set(x)

    def to_model(self, x: jax.Array) -> jax.Array:
        """The stored stack back in model order, ``[n_layers, ...]``."""
        return x if self.trivial else jnp.take(x, self.index(), axis=0)

    def describe(self) -> str:
        """Each device's layers, e.g. ``stage 0: 0-2 | stage 1: 3-5``."""
        ids = self.layer_ids()
        def span(row):
            row = row[row >= 0]
            return f"{row[0]}-{row[-1]}" if len(row) > 1 else f"{row[0]}"
        return " | ".join(f"stage {p}: " + ", ".join(span(ids[p, v]) for v in range(self.virtual))
                          for p in range(self.stages))


@dataclass(frozen=True)
class Schedule:
    """Which microbatch (and chunk, and stash slot) each stage runs forward and backward at
    each tick; -1 marks an idle slot."""

    kind: str
    stages: int
    microbatches: int
    virtual: int
    fwd: np.ndarray  # [ticks, stages]: microbatch
    bwd: np.ndarray
    fwd_chunk: np.ndarray  # [ticks, stages]: which of the stage's V chunks
    bwd_chunk: np.ndarray
    fwd_slot: np.ndarray  # [ticks, stages]: where the chunk's residuals are kept until its backward
    bwd_slot: np.ndarray
    slots: int  # microbatches' residuals a stage keeps at most
    layout: StageLayout | None = None
    # Zero-bubble schedules: the backward slot computes the input's gradient (B) alone and
    # the weights' (W) run in their own slot, reading the forward's residuals (kept from the
    # forward to W) and what B handed on: kept from B to W over the microbatch's B-only
    # residuals, in its residuals' slot, where :class:`Handover` shares them (or, leaf by
    # leaf, the leaves it places); else in one of ``w_slots``.
    wgt: np.ndarray | None = None  # [ticks, stages]: microbatch
    wgt_chunk: np.ndarray | None = None
    wgt_slot: np.ndarray | None = None  # the residuals' slot
    bwd_wslot: np.ndarray | None = None  # where B keeps what W reads (hand-over apart)
    wgt_wslot: np.ndarray | None = None
    # A W may also run in the forward slot of a tick that has no F for the stage.
    fwgt: np.ndarray | None = None
    fwgt_slot: np.ndarray | None = None
    fwgt_wslot: np.ndarray | None = None
    w_slots: int = 0
    # Zero-bubble: whether B's hand-over surely keeps slots of its own rather than the B-only
    # residuals' place (:func:`handover_apart`; the tables then have residual_cap's narrow cap).
    handover_apart: bool = False
    # Zero-bubble: a stage's F (B) may come ticks after the previous (next) stage sent its
    # input (gradient); such an arrival waits in a slot of an inbox: where it lands, where the
    # F (B) reads it (-1 in both: the F or B takes it in the tick it lands, from no slot).
    # Residuals only B reads are kept from F to B, in slots of their own (hand-over apart;
    # shared, and a leaf a hand-over leaf is placed over, in the residuals' slot).
    fwd_bslot: np.ndarray | None = None
    bwd_bslot: np.ndarray | None = None
    b_slots: int = 0
    fwd_in: np.ndarray | None = None
    fwd_from: np.ndarray | None = None
    bwd_in: np.ndarray | None = None
    bwd_from: np.ndarray | None = None
    in_slots: int = 0  # the forward inbox's
    bwd_in_slots: int = 0  # the backward inbox's

    @property
    def ticks(self) -> int:
        return self.fwd.shape[0]

    @property
    def split(self) -> bool:
        """Whether the backward pass runs as B and W in separate slots."""
        return self.wgt is not None

    def bubble(self) -> float:
        """The theoretical idle fraction: (P - 1) / (V M + P - 1) with the backward pass
        twice the forward; ZB-H1's (P - 1) / (3 M + P - 1), B and W each as long as F."""
        if self.split:
            return (self.stages - 1) / (3 * self.microbatches + self.stages - 1)
        return (self.stages - 1) / (self.virtual * self.microbatches + self.stages - 1)

    @property
    def bubble_formula(self) -> str:
        """:meth:`bubble`'s formula, as the logs print it."""
        return f"(P-1)/({'3M' if self.split else 'VM' if self.virtual > 1 else 'M'}+P-1)"

    def idle_note(self) -> str | None:
        """For zero-bubble tables that idle more than 1F1B's would at the same P and M (the
        cap P - s, where B's hand-over needs a slot of its own: from M = P + 2), the line that
        says so; else None."""
        if not self.split:
            return None
        tables, one = self.idle(), make_schedule("1f1b", self.stages, self.microbatches).idle()
        if tables <= one + 1e-9:
            return None
        return (f"{self.kind}'s tables idle {tables:.0%} here (F, B and W one unit each), 1f1b's would {one:.0%}: "
                f"B's hand-over to W needs a slot of its own with this mesh, model and --remat (docs/pipelines.md, "
                f"'Which cap'), so a stage holds at most {self.slots} microbatches; "
                f"--pipeline-schedule 1f1b may be faster")

    def memory_note(self, remat: Any = None) -> str | None:
        """For zero-bubble tables whose hand-over from B to W keeps a slot of its own (all of it
        or the leaves placed over no B-only residual), the line
        that says where they keep more than 1F1B would at the same P and M: more microbatches'
        values a stage (residuals plus hand-overs; 2 stages at M = P: 3 against 2), or, under
        ``--remat full``, a hand-over several activations a layer where 1F1B keeps one (1.22-1.61x
        1F1B's temp on 2 and 4 stages; docs/pipelines.md), or under ``names``, whose hand-over
        holds the matmul inputs the names leave out (1.04-1.14x at M = 2P with
        ``names:qkv,attn_proj`` and ``names:mlp_hidden,attn_proj`` on a flat mesh); else None.
        (Under ``dots_no_batch`` where a stage keeps no more microbatches than 1F1B, its
        hand-over takes 0.76-0.97x 1F1B's temp on every mesh measured: nothing said.) Every
        stage's buffers are as large as the fullest stage's (one program)."""
        if not self.split or not self.handover_apart:
            return None
        one = make_schedule("1f1b", self.stages, self.microbatches).slots
        held = f"keeps up to {self.slots} microbatches' residuals and {self.w_slots} B-to-W hand-over" + \
            ("s" if self.w_slots > 1 else "") + " a stage"
        kind = Remat.parse(remat).kind
        if self.slots + self.w_slots > one:
            why = f"1f1b would keep {one} microbatches' residuals"
        elif kind == "full":
            why = ("under --remat full a hand-over holds every weight matmul's output gradient, several activations "
                   "a layer, where 1f1b keeps each layer's input")
        elif kind == "names":
            why = ("under --remat names a hand-over holds the matmul inputs that the names leave out, made again by B, "
                   "beside their output gradients")
        else:
            return None
        return (f"{self.kind} {held}: {why}, so it can take more memory than 1f1b here "
                f"(docs/pipelines.md, 'Zero bubble'); --pipeline-schedule 1f1b may keep less")

    def op_runs(self, stage: int) -> dict[str, int]:
        """How often ``stage`` runs each op of a tick (the executor's scopes, ``TICK_SCOPE``) in a
        step: ``F`` a chunk's forward (but, 1F1B-like, the last chunk's, which ``last`` runs
        with the head, the loss and the backward pass), ``embed`` the first chunk's input,
        ``B`` a chunk's backward (zero-bubble: the input's gradient alone, with ``head`` before
        it on the last chunk), ``embed_grad`` the embedding's gradient, ``W`` and ``W_first``
        the weights' gradients in the weight slot and in the forward slot."""
        def at(name: str) -> np.ndarray:
            return getattr(self, name)[:, stage]

        def ends(chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return (stage == 0) & (chunks == 0), (stage == self.stages - 1) & (chunks == self.virtual - 1)

        fwd, bwd = at("fwd") >= 0, at("bwd") >= 0
        (f_first, f_last), (b_first, b_last) = ends(at("fwd_chunk")), ends(at("bwd_chunk"))
        runs = {"embed": fwd & f_first, "embed_grad": bwd & b_first}
        if self.split:
            runs |= {"F": fwd, "head": bwd & b_last, "B": bwd, "W": at("wgt") >= 0, "W_first": at("fwgt") >= 0}
        else:
            runs |= {"F": fwd & ~f_last, "last": bwd & b_last, "B": bwd & ~b_last}
        return {name: int(ran.sum()) for name, ran in runs.items()}

    @property
    def keeps_inputs(self) -> bool:
        """Whether a stage keeps chunk inputs (or, zero-bubble, the last chunk's outputs) from
        one tick to a later one: only where the last chunk's backward slot runs in a later
        tick than its forward (GPipe, naive). Elsewhere (1F1B, interleaved, ZB-H1) it runs in
        the same tick and takes what its forward had; every other chunk's backward reads its
        residuals, which hold the chunk's input where its backward needs it."""
        last = (np.arange(self.stages)[None, :] == self.stages - 1) & (self.bwd >= 0) \
            & (self.bwd_chunk == self.virtual - 1)
        return bool((last & ((self.fwd != self.bwd) | (self.fwd_chunk != self.bwd_chunk))).any())

    def idle(self) -> float:
        """The tables' idle fraction with F, B and W one unit of time each (a backward slot
        that runs both B and W two; the last chunk's, which runs its forward too, three): the
        stages wait for each other at every tick, so a tick lasts as long as its longest
        stage's work."""
        P, V = self.stages, self.virtual
        on_last = np.arange(P)[None, :] == P - 1
        fused = (on_last & (self.fwd_chunk == V - 1)) if not self.split else np.zeros(self.fwd.shape, bool)
        work = ((self.fwd >= 0) & ~fused).astype(int)
        if self.split:
            work += (self.bwd >= 0).astype(int) + (self.wgt >= 0) + (self.fwgt >= 0)
        else:
            work += (self.bwd >= 0) * (2 + (on_last & (self.bwd_chunk == V - 1)))
        return 1 - 3 * self.microbatches * V * P / (P * work.max(axis=1).sum())


# The remat policies under which what B hands W is no more than the residuals B alone reads,
# which it overwrites (Handover), but for the weight gradients B makes whole (norms, biases):
# what W reads of the forward pass is kept or cheap to make again, and B hands it the
# matmuls' output gradients. Under ``selective`` B recomputes the attention core, whose
# output W reads, and frees the L x L probabilities it read alone. Under the others B hands
# W matmul inputs it recomputed (``full``, ``names``; the attention's output under
# ``dots_no_batch``): many times the B-only residuals (tests/test_split_backward.py). The
# rule goes by the policy because the tables are made before the batch's shape is known
# (docs/pipelines.md, "Zero bubble"); on a partitioned mesh, :data:`WIDE_CAP`.
HANDOVER_FITS = ("none", "dots", "selective")


def flat_slots(sizes: dict[str, int], replicas: tuple[str, ...]) -> bool:
    """Whether a stage's values may be laid out flat in a shared slot (:class:`Handover`):
    only where every mesh axis but ``stage`` and the executor's ``replicas`` is 1. A tensor,
    fsdp, sequence or expert axis splits the values, which flattening would gather."""
    return all(n == 1 for axis, n in sizes.items() if axis != STAGE and axis not in replicas)


def orders_by_data() -> bool:
    """Whether the backend's runtime runs a computation's independent ops in whatever order
    they become ready (XLA:CPU), so that collectives must be ordered by data to be taken in
    the same order on every device (``StagedModel``'s ``gathered_first``); elsewhere the
    runtime keeps the program's order."""
    return jax.default_backend() == "cpu"


def zero_from(x: jax.Array, spec: P | None = None) -> jax.Array:
    """0 (int32), made from ``x``'s first element by a test XLA cannot fold: what is computed
    from it comes after ``x`` (XLA:CPU's runtime orders ops by data alone). ``spec``: where
    ``x`` is split, its layout; each device then reads its own shard's first element, so
    that none is fetched from another."""
    first = lambda v: jnp.minimum(0, jnp.isnan(v.reshape(-1)[0]).astype(jnp.int32))  # noqa: E731
    axes = frozenset(a for e in spec or () if e for a in ((e,) if isinstance(e, str) else e))
    if not axes:  # (whole on every device)
        return first(x)
    return jax.shard_map(first, in_specs=spec, out_specs=P(), axis_names=axes, check_vma=False)(x)


def slot_layout(sizes: dict[str, int], replicas: tuple[str, ...]) -> str:
    """How :class:`Handover` can lay a stage's values out on this mesh: ``flat`` in a shared
    slot (:func:`flat_slots`); ``rows`` leaf by leaf, packing what finds no B-only leaf of its
    layout into a B-only leaf's rows, where only batch axes split the values (FSDP, ZeRO-2/3:
    each value split on a microbatch's rows alone); else ``split``, leaf by leaf."""
    if flat_slots(sizes, replicas):
        return "flat"
    return "rows" if all(n == 1 for a, n in sizes.items() if a not in (STAGE, *replicas, *_BATCH)) else "split"


# The policies whose hand-over holds matmul inputs B made again besides their output
# gradients: several times the B-only residuals (3-11x on the test stacks; all of it under
# ``full``, where B reads no residual alone), so :class:`Handover` keeps it apart.
HANDOVER_LARGE = ("full", "dots_no_batch", "names")

# Where ZB-H1 takes 1F1B's cap of 2P - 1: per slot layout (:func:`slot_layout`) and model (a
# dense one, one with MoE layers), the policies whose hand-over, placed as that layout lets
# it, kept no more compiled temp than 1F1B's at M = P and 2P in every case measured
# (docs/pipelines.md, "Which cap"): in a flat slot, :data:`HANDOVER_FITS`; leaf by leaf
# without remat and under ``selective`` for a dense model, whose B-only residuals hold every
# activation B reads or the attention's probabilities (0.93-0.99x on tensor axes with and
# without SP, fsdp and ZeRO-2/3, 2 and 4 stages; a dense model on an expert axis was not
# measured, and a stage axis does not go with a sequence one). Under ``dots`` a tensor axis
# leaves the gradients of model width, whole on every device, with no B-only leaf of their
# layout (1.09-1.20x on 2 stages, to 1.30x on 4), and on rows GPT-2's tiny went 1.014-1.018x on 4.
# MoE layers' expert buffers are packed into rows where only batch axes split the values,
# which fit at 64 tokens (moe-tiny on fsdp=4 without remat and under ``selective``: 0.92-0.98x)
# but not at 128 (1.02-1.10x), and on tensor and expert axes find no place (1.05-1.08x at 2P): an
# MoE model keeps P - s wherever the values are split.
WIDE_CAP = {("flat", False): HANDOVER_FITS, ("flat", True): HANDOVER_FITS,
            ("rows", False): ("none", "selective"), ("rows", True): (),
            ("split", False): ("none", "selective"), ("split", True): ()}


def widens(remat: Any, layout: str, experts: bool = False) -> bool:
    """Whether ZB-H1's tables take 1F1B's cap of 2P - 1 microbatches for ``remat`` on a mesh
    whose values :class:`Handover` lays out as ``layout`` (:func:`slot_layout`), for a model
    with MoE layers or not (``experts``): :data:`WIDE_CAP`; else P - s (:func:`residual_cap`).
    The rule goes by the policy, the mesh and the model because the tables are made before
    the batch's shape is known."""
    return str(remat) in WIDE_CAP[layout, experts]


def handover_apart(remat: Any, layout: str, experts: bool = False) -> bool:
    """Whether :class:`Handover` surely keeps B's hand-over to W in slots of its own (all of
    it, or the leaves laid out like no B-only residual) beside tables with the narrow cap:
    under the policies of :data:`HANDOVER_LARGE`, and on a mesh whose values are not laid
    out flat (:func:`slot_layout`) where the cap does not widen (:func:`widens`). Elsewhere
    it takes the B-only residuals' place, or (``offload``, whose tables have the narrow cap)
    decides by sizes the tables do not know; counted as placed."""
    return Remat.parse(remat).kind in HANDOVER_LARGE or not (layout == "flat" or widens(remat, layout, experts))


def residual_cap(stages: int, remat: Any, layout: str = "flat", microbatches: int | None = None,
                 experts: bool = False) -> int | tuple[int, ...]:
    """ZB-H1's cap for ``remat``: 1F1B's 2P - 1 microbatches where B's hand-over to W takes
    the place of the residuals it overwrites on a mesh whose values are laid out as
    ``layout`` (:func:`widens`; ``experts``: a model with MoE layers); else P - s on stage s,
    which holds one hand-over beside the residuals (docs/pipelines.md), lowered to the fewest
    microbatches whose tables for ``microbatches`` idle no more, keep no more hand-overs and no
    more arrivals waiting, and take at most one tick more (each tick sends an activation and a
    gradient): P - 1 on stages 0 and 1 at M = P from 3 stages."""
    if widens(remat, layout, experts):
        return 2 * stages - 1
    narrow = tuple(stages - s for s in range(stages))
    if microbatches is None or microbatches < stages:  # (make_schedule says what is wrong)
        return narrow
    base, best = _zero_bubble(stages, microbatches, None, narrow), narrow
    for most in range(stages - 1, 0, -1):
        cap = tuple(min(c, most) for c in narrow)
        tables = _zero_bubble(stages, microbatches, None, cap)
        if (tables.idle() > base.idle() + 1e-9 or tables.w_slots > base.w_slots or tables.ticks > base.ticks + 1
                or tables.in_slots + tables.bwd_in_slots > base.in_slots + base.bwd_in_slots):
            break
        best = cap
    return best


def make_schedule(kind: str, stages: int, microbatches: int, virtual: int = 1,
                  layout: StageLayout | None = None, residual_cap: int | tuple[int, ...] | None = None
                  ) -> Schedule:
    """``naive``: one microbatch through the stages in turn (vertical model parallelism);
    ``gpipe``: every forward, then every backward; ``1f1b``: microbatch i runs forward on stage s
    at tick i + s and backward at tick i + 2P - 2 - s, so a stage holds at most 2P - 1 inputs;
    ``interleaved``: 1F1B over V chunks per stage, microbatches taken P at a time through each
    chunk in turn (Megatron's order), with one forward and one backward slot per tick;
    ``zb-h1``: :func:`_zero_bubble`, ``residual_cap`` its cap (one for every stage, or one per
    stage; default 2P - 1)."""
    Pn, M, V = stages, microbatches, virtual
    if kind not in SCHEDULES:
        raise ConfigError(f"--pipeline-schedule must be one of {', '.join(SCHEDULES)}, got {kind!r}")
    if residual_cap is not None:
        caps = (residual_cap,) if isinstance(residual_cap, int) else tuple(residual_cap)
        if kind != "zb-h1" or min(caps, default=0) < 1 or len(caps) not in (1, Pn):
            raise ConfigError(f"a residual cap is ZB-H1's and must be >= 1, one or one per stage; "
                              f"got {residual_cap} for {kind} on {Pn} stages")
    if Pn < 2:
        raise ConfigError(f"--pipeline-schedule {kind} needs a stage axis of size > 1 in --mesh")
    if kind == "naive" and M != 1:
        raise ConfigError(f"--pipeline-schedule naive runs the whole batch as one microbatch; "
                          f"got --microbatches {M}")
    if M < 1:
        raise ConfigError(f"--microbatches must be >= 1, got {M}")
    if kind in ("1f1b", "interleaved", "zb-h1") and M < Pn:
        raise ConfigError(f"--pipeline-schedule {kind} needs --microbatches >= the stages ({Pn}), got {M}")
    if kind == "interleaved":
        if V < 2:
            raise ConfigError(f"--pipeline-schedule interleaved needs --virtual-stages >= 2, got {V}")
        if M % Pn:
            raise ConfigError(f"--pipeline-schedule interleaved takes microbatches {Pn} at a time: "
                              f"--microbatches {M} is not a multiple of the stages ({Pn})")
    elif V != 1:
        raise ConfigError(f"--virtual-stages needs --pipeline-schedule interleaved, got {kind}")
    if kind == "zb-h1":
        return _zero_bubble(Pn, M, layout, cap=residual_cap)
    # (microbatch, virtual stage u) -> its forward and backward tick; u runs on stage u % P.
    fwd_at, bwd_at = {}, {}
    for i in range(M):
        for u in range(Pn * V):
            s, v = u % Pn, u // Pn
            if kind in ("1f1b", "interleaved"):
                # Each stage's forwards in Megatron's order n: groups of P microbatches, chunk by
                # chunk; backwards in the same order over the chunks reversed. The last virtual
                # stage runs forward and backward in the same tick, so ticks are VM + VP + P - 2.
                g, r = divmod(i, Pn)
                fwd_at[i, u] = g * V * Pn + v * Pn + r + s
                bwd_at[i, u] = V * Pn - 1 + g * V * Pn + (V - 1 - v) * Pn + r + (Pn - 1 - s)
            else:
                # The last stage's backward of microbatch M-1 starts as soon as its forward is done.
                fwd_at[i, u] = i + s
                bwd_at[i, u] = (M + Pn - 2) + (M - 1 - i) + (Pn - 1 - s)
    ticks = max(bwd_at.values()) + 1
    tables = {name: np.full((ticks, Pn), -1, np.int32)
              for name in ("fwd", "bwd", "fwd_chunk", "bwd_chunk", "fwd_slot", "bwd_slot")}
    slots = 0
    for s in range(Pn):
        # A microbatch's residuals are kept from its forward tick to its backward tick,
        # inclusive (the forward slot writes before the backward slot reads).
        ops = sorted((fwd_at[i, u], bwd_at[i, u], i, u // Pn) for (i, u) in fwd_at if u % Pn == s)
        for (f, b, i, v), slot in zip(ops, _slots([(f, b) for f, b, _, _ in ops])):
            slots = max(slots, slot + 1)
            for phase, t in (("fwd", f), ("bwd", b)):
                tables[phase][t, s], tables[f"{phase}_chunk"][t, s], tables[f"{phase}_slot"][t, s] = i, v, slot
    return Schedule(kind, Pn, M, V, slots=slots, layout=layout, **tables)


def _slots(spans: list[tuple[int, int]]) -> list[int]:
    """For spans (first tick, last tick) in order of their first: the lowest slot free over
    each (a slot whose span ended before this one starts is free)."""
    out, busy = [], []  # busy: (last tick, slot)
    for start, end in spans:
        busy = [(e, slot) for e, slot in busy if e >= start]
        slot = min(set(range(len(busy) + 1)) - {slot for _, slot in busy})
        busy.append((end, slot))
        out.append(slot)
    return out


def _zero_bubble(Pn: int, M: int, layout: StageLayout | None, cap: int | tuple[int, ...] | None = None
                 ) -> Schedule:
    """ZB-H1 (Qi et al. 2023, Zero Bubble Pipeline Parallelism) on lock-step ticks: a tick
    lasts as long as its busiest stage's work, so each tick is filled to that length.

    A tick has three slots a stage runs in turn: the forward slot (an F, or a W where the stage
    has no F to run), the backward slot (a B) and the weight slot (a W). List-scheduled tick by
    tick: a stage runs its next F if the previous stage's ran in an earlier tick and it holds
    fewer than ``cap`` microbatches' residuals (F done, W not yet: default 2P - 1, as many as
    1F1B holds; or one per stage), else its oldest waiting W if the cap stopped the F; its next
    B if the next stage's B of that microbatch ran in an earlier tick (on the last stage: its
    own F, in this tick or before). Under a cap of 2P - 1 or more, a stage whose next F the cap
    would stop in the next tick runs its oldest waiting W in this tick's weight slot: in the
    steady state each stage runs an F, a B and a W a tick (ZB-H1's 1F-1B-1W), where a W left for
    the next tick's forward slot would take the place of that F and stall every later stage's.
    The tick's length is the most of these any stage runs (at least one); then every stage fills
    its free slots up to that length with waiting Ws. Ws hold nothing up, so they go where a
    stage would idle: into the ticks the next stage spends on F and B, and into the end. The cap
    at 2P - 1 meets the theory's 3M + P - 1 units of F, B and W at every M from 2P; P - s on
    stage s holds at most P microbatches (:func:`residual_cap` lowers it where that costs
    nothing) and idles a quarter of the units on 2 stages (docs/pipelines.md)."""
    caps = [2 * Pn - 1] * Pn if cap is None else [cap] * Pn if isinstance(cap, int) else list(cap)
    f_at, b_at, w_at, w_first = {}, {}, {}, set()  # w_first: the Ws run in the forward slot
    next_f, next_b, done_w = [0] * Pn, [0] * Pn, [0] * Pn
    waiting: list[list[int]] = [[] for _ in range(Pn)]
    t = 0

    def run_w(s: int, forward_slot: bool) -> None:
        i = waiting[s].pop(0)
        w_at[i, s] = t
        done_w[s] += 1
        if forward_slot:
            w_first.add((i, s))

    while len(w_at) < Pn * M:
        if t > 3 * (M + Pn) * Pn:  # every tick runs some op of the 3MP, or waits for a neighbour's
            raise AssertionError(f"ZB-H1's tables for {Pn} stages, {M} microbatches, cap {cap} make no progress")
        ran, forward_used, weight_used = [0] * Pn, [False] * Pn, [False] * Pn
        for s in range(Pn):
            i = next_f[s]
            if i < M and (s == 0 or f_at.get((i, s - 1), t) < t):
                if i - done_w[s] < caps[s]:
                    f_at[i, s] = t
                    next_f[s] += 1
                    ran[s], forward_used[s] = ran[s] + 1, True
                elif waiting[s]:  # at the cap: a W frees a microbatch's residuals
                    run_w(s, forward_slot=True)
                    ran[s], forward_used[s] = ran[s] + 1, True
            j = next_b[s]
            if j < next_f[s] and f_at[j, s] <= t and (s == Pn - 1 or b_at.get((j, s + 1), t) < t):
                b_at[j, s] = t
                next_b[s] += 1
                waiting[s].append(j)
                ran[s] += 1
            if caps[s] >= 2 * Pn - 1 and waiting[s] and next_f[s] < M and next_f[s] - done_w[s] >= caps[s]:
                run_w(s, forward_slot=False)  # (its B ran before this tick's weight slot)
                ran[s], weight_used[s] = ran[s] + 1, True
        length = max(1, *ran)
        for s in range(Pn):
            if ran[s] < length and not forward_used[s] and waiting[s] and b_at[waiting[s][0], s] < t:
                run_w(s, forward_slot=True)
                ran[s] += 1
            if ran[s] < length and waiting[s] and not weight_used[s]:  # (its B may have run in this tick)
                run_w(s, forward_slot=False)
        t += 1
    names = ("fwd", "bwd", "wgt", "fwgt", "fwd_chunk", "bwd_chunk", "wgt_chunk", "fwd_slot", "bwd_slot",
             "wgt_slot", "fwgt_slot", "bwd_wslot", "wgt_wslot", "fwgt_wslot", "fwd_in", "fwd_from", "bwd_in",
             "bwd_from", "fwd_bslot", "bwd_bslot")
    tables = {name: np.full((t, Pn), -1, np.int32) for name in names}
    slots = w_slots = b_slots = 0
    inbox = {"fwd": 0, "bwd": 0}
    for s in range(Pn):
        for i, slot in enumerate(_slots([(f_at[i, s], b_at[i, s]) for i in range(M)])):
            tables["fwd_bslot"][f_at[i, s], s] = tables["bwd_bslot"][b_at[i, s], s] = slot
            b_slots = max(b_slots, slot + 1)
        for phase, at, sender in (("fwd", f_at, s - 1), ("bwd", b_at, s + 1)):
            if not 0 <= sender < Pn:
                continue
            # Only an arrival taken ticks after it lands needs a slot.
            order = sorted((i for i in range(M) if at[i, s] > at[i, sender] + 1), key=lambda i: at[i, sender])
            for i, slot in zip(order, _slots([(at[i, sender] + 1, at[i, s]) for i in order])):
                tables[f"{phase}_in"][at[i, sender] + 1, s], tables[f"{phase}_from"][at[i, s], s] = slot, slot
                inbox[phase] = max(inbox[phase], slot + 1)
        res = _slots([(f_at[i, s], w_at[i, s]) for i in range(M)])  # F runs in microbatch order
        order = sorted(range(M), key=lambda i: b_at[i, s])
        kept = dict(zip(order, _slots([(b_at[i, s], w_at[i, s]) for i in order])))
        for i in range(M):
            w = "fwgt" if (i, s) in w_first else "wgt"
            for phase, at in (("fwd", f_at), ("bwd", b_at), (w, w_at)):
                tables[phase][at[i, s], s] = i
                tables[f"{phase}_slot"][at[i, s], s] = res[i]
                if phase != "fwgt":
                    tables[f"{phase}_chunk"][at[i, s], s] = 0
            tables["bwd_wslot"][b_at[i, s], s] = tables[f"{w}_wslot"][w_at[i, s], s] = kept[i]
        slots, w_slots = max(slots, max(res) + 1), max(w_slots, max(kept.values()) + 1)
    return Schedule("zb-h1", Pn, M, 1, slots=slots, layout=layout, w_slots=w_slots, in_slots=inbox["fwd"],
                    bwd_in_slots=inbox["bwd"], b_slots=b_slots, **tables)


def same_layout(a: tuple[int, ...], b: tuple[int, ...], exact: bool = True) -> bool:
    """Whether a value of shape ``a`` may take the place of one of shape ``b``, as far as
    shapes tell how they are laid out over the devices: the same shape, or (not ``exact``) the
    same but for one dim other than the last split in two adjacent ones or a dim of 1 (tokens
    into rows of a sequence, heads into groups of a shared key). Such a reshape keeps each
    element on the device that holds it where both are split alike and a split dim is divided
    over devices by its outer factor. Shapes cannot tell that: a placement that moves values
    shows as collectives in the compiled step (the verifier test checks one under
    ``tensor=2``). The last dim is a value's features, which a model's projections split
    otherwise on either side (a whole model-width gradient in a head-split query's place was
    gathered back there)."""
    a, b = tuple(a), tuple(b)
    if exact or abs(len(a) - len(b)) != 1:
        return a == b
    short, long = (a, b) if len(a) < len(b) else (b, a)
    # dims k and k + 1 of the longer one made one, k + 1 not its last
    return any(short == long[:k] + (long[k] * long[k + 1],) + long[k + 2:] for k in range(len(long) - 2))


def _by_rows(shape: tuple[int, ...], rows: int, per_row: int) -> bool:
    """Whether a stacked value of ``shape`` is laid out by a microbatch's ``rows`` first:
    ``[layers, rows * per_row, ...]`` (its tokens), or ``[layers, rows, ...]`` with a dim of
    ``per_row`` among the rest (``[layers, rows, per_row, ...]``; an MoE layer's
    ``[layers, rows, experts, per_row, capacity]``)."""
    return len(shape) >= 3 and (shape[1] == rows * per_row or shape[1] == rows and per_row in shape[2:])


def _set(buf: jax.Array, x: jax.Array, slot: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(buf, x, slot, 0)


def _get(buf: jax.Array, slot: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(buf, slot, 0, keepdims=False)


class Handover:
    """Where a zero-bubble stage keeps the residuals only B reads (from F to B) and what B
    hands W (from B to W). Apart, they take ``b_slots`` and ``w_slots`` slots of their own
    shapes. Shared, a microbatch's hand-over overwrites its B-only residuals in one slot per
    microbatch from F to W -- the slot of the residuals W reads -- holding one buffer per
    dtype as wide as the larger of the two; shared when that takes fewer bytes (the hand-over
    is mostly smaller than what B alone reads: without remat and under ``dots``) and ``flat``
    (:func:`flat_slots`). Apart, leaf by leaf (``leafwise``): a hand-over leaf of a B-only
    leaf's shape (:func:`same_layout`) overwrites it, in that leaf's slot per microbatch from F
    to W (``into``: the leaves so placed), where the pair's ``slots`` rows are no more than
    their ``b_slots + w_slots`` apart. :func:`run` asks for it on every mesh; a write over a
    leaf W may still read is ordered after W by an element of a gradient (where the gradients
    are split, FSDP or ZeRO-2 and 3, each device's own shard's, so that none is fetched every
    tick). Where only batch axes split the values (``rows``: a
    microbatch's rows and tokens per row, as FSDP and ZeRO split them), hand-over leaves laid
    out by rows that no B-only leaf is shaped as are packed into the rows of one
    (``packed``): each row's share of the leaf at an offset in that row. (On a flat mesh,
    where the policy's hand-over does not fit the shared slot, leaf by leaf against all of it
    in a slot of its own, ZB-H1's temp over 1F1B's: under ``dots_no_batch`` 1.037-1.058x →
    0.964-0.997x at M = P on 2 stages, 0.991-1.022x → 0.903-0.907x on 4 of two layers; under
    ``names`` 0.83-1.25x → 0.76-1.14x, the same or less in every case measured.)"""

    def __init__(self, b_only: list, handed: list, schedule: Schedule, flat: bool = True,
                 leafwise: bool = False, rows: tuple[int, int] | None = None) -> None:
        self.b_only, self.handed = b_only, handed
        dtypes = sorted({jnp.dtype(x.dtype) for x in b_only + handed}, key=str)
        size = lambda xs, d: sum(x.size for x in xs if jnp.dtype(x.dtype) == d)  # noqa: E731
        self.width = {d: max(size(b_only, d), size(handed, d)) for d in dtypes}
        apart = sum(schedule.b_slots * size(b_only, d) * d.itemsize + schedule.w_slots * size(handed, d) * d.itemsize
                    for d in dtypes)
        self.slots = schedule.slots
        self.shared = flat and self.slots * sum(w * d.itemsize for d, w in self.width.items()) <= apart
        self.b_slots, self.w_slots = schedule.b_slots, schedule.w_slots
        self.into: dict[int, int] = {}  # hand-over leaf -> the B-only leaf whose place it takes
        if leafwise and not self.shared and self.w_slots >= self.slots - self.b_slots:
            for exact in (True, False):  # the same shape first, then one dim split in two
                for i, x in enumerate(handed):
                    free = (j for j, b in enumerate(b_only) if j not in self.into.values()
                            and b.dtype == x.dtype and same_layout(x.shape, b.shape, exact))
                    if i not in self.into and (j := next(free, None)) is not None:
                        self.into[i] = j
        # hand-over leaf -> (the B-only leaf it is packed into, its offset in each of its rows)
        self.packed: dict[int, tuple[int, int]] = {}
        if rows and leafwise and not self.shared and self.w_slots >= self.slots - self.b_slots:
            n_rows, per_row = rows
            room = {j: math.prod(b.shape[2:]) for j, b in enumerate(b_only)
                    if j not in self.into.values() and len(b.shape) >= 3 and b.shape[1] == n_rows}
            for i, x in enumerate(handed):
                if i in self.into or not _by_rows(x.shape, n_rows, per_row):
                    continue
                need = math.prod(x.shape[1:]) // n_rows
                j = next((j for j, r in room.items() if b_only[j].dtype == x.dtype
                          and b_only[j].shape[0] == x.shape[0] and need <= r), None)
                if j is not None:
                    self.packed[i] = (j, math.prod(b_only[j].shape[2:]) - room[j])
                    room[j] -= need
            # A host holds its slot from F to W (``slots`` rows, not ``b_slots``): worth it only
            # where what is packed into it frees at least that much of the hand-over's slots.
            for j in {j for j, _ in self.packed.values()}:
                packed = [i for i, (h, _) in self.packed.items() if h == j]
                if self.w_slots * sum(handed[i].size for i in packed) < (self.slots - self.b_slots) * b_only[j].size:
                    for i in packed:
                        del self.packed[i]
        self.packs = {j for j, _ in self.packed.values()}  # kept by rows: [layers, rows, the rest]
        self.hosts = set(self.into.values()) | self.packs

    def _kept_shape(self, j: int) -> tuple[int, ...]:
        """How B-only leaf ``j`` is kept: by rows where hand-over leaves are packed into it (so
        the store is not reshaped to write them, which XLA copied), else as it is."""
        shape = tuple(self.b_only[j].shape)
        return (*shape[:2], math.prod(shape[2:])) if j in self.packs else shape

    def zeros(self) -> Any:
        if self.shared:
            return {str(d): jnp.zeros((self.slots, w), d) for d, w in self.width.items()}
        return ([jnp.zeros((self.slots if j in self.hosts else self.b_slots, *self._kept_shape(j)), x.dtype)
                 for j, x in enumerate(self.b_only)],
                [jnp.zeros((0,) if i in self.into or i in self.packed else (self.w_slots, *x.shape), x.dtype)
                 for i, x in enumerate(self.handed)])

    @staticmethod
    def _put(store: dict, leaves: list, slot: jax.Array) -> dict:
        """Each leaf in place into row ``slot`` at its offset among its dtype's (no row is
        assembled first: that would be a temp as large as the row)."""
        out, offset = dict(store), dict.fromkeys(store, 0)
        for x in leaves:
            name = str(jnp.dtype(x.dtype))
            out[name] = jax.lax.dynamic_update_slice(out[name], x.reshape(1, -1), (slot, offset[name]))
            offset[name] += x.size
        return out

    @staticmethod
    def _get(store: dict, shapes: list, slot: jax.Array) -> list:
        offset, out = dict.fromkeys(store, 0), []
        for x in shapes:
            name = str(jnp.dtype(x.dtype))
            out.append(jax.lax.dynamic_slice(store[name], (slot, offset[name]), (1, x.size)).reshape(x.shape))
            offset[name] += x.size
        return out

    def keep_res(self, store: Any, leaves: list, slot: jax.Array, b_slot: jax.Array) -> Any:
        """At F: the B-only residuals into the microbatch's slot (``slot``: its residuals'; apart:
        ``b_slot``, but for the leaves a hand-over leaf is placed over)."""
        if self.shared:
            return self._put(store, leaves, slot)
        return [_set(buf, x.reshape(self._kept_shape(j)), slot if j in self.hosts else b_slot)
                for j, (buf, x) in enumerate(zip(store[0], leaves))], store[1]

    def res(self, store: Any, slot: jax.Array, b_slot: jax.Array) -> list:
        if self.shared:
            return self._get(store, self.b_only, slot)
        return [_get(buf, slot if j in self.hosts else b_slot).reshape(x.shape)
                for j, (buf, x) in enumerate(zip(store[0], self.b_only))]

    def keep_handed(self, store: Any, leaves: list, slot: jax.Array, w_slot: jax.Array) -> Any:
        """After B: what it hands W into ``slot`` (over the microbatch's B-only residuals)
        where shared or placed leaf by leaf, else into ``w_slot``. A tick without B writes
        nothing or what the slot holds (:meth:`handed_to_w`)."""
        if self.shared:
            return self._put(store, leaves, slot)
        b_only, handed = list(store[0]), list(store[1])
        for i, x in enumerate(leaves):
            if i in self.into:
                j = self.into[i]
                b_only[j] = _set(b_only[j], x.reshape(self.b_only[j].shape), slot)
            elif i in self.packed:
                j, at = self.packed[i]
                put = x.reshape(1, *b_only[j].shape[1:3], -1)
                b_only[j] = jax.lax.dynamic_update_slice(b_only[j], put, (slot, 0, 0, at))
            else:
                handed[i] = _set(handed[i], x, w_slot)
        return b_only, handed

    def handed_to_w(self, store: Any, slot: jax.Array, w_slot: jax.Array) -> list:
        if self.shared:
            return self._get(store, self.handed, slot)
        out = []
        for i, (buf, x) in enumerate(zip(store[1], self.handed)):
            if i in self.into:
                out.append(_get(store[0][self.into[i]], slot).reshape(x.shape))
            elif i in self.packed:
                j, at = self.packed[i]
                host = store[0][j]
                size = (1, *host.shape[1:3], math.prod(x.shape[1:]) // host.shape[2])
                out.append(jax.lax.dynamic_slice(host, (slot, 0, 0, at), size).reshape(x.shape))
            else:
                out.append(_get(buf, w_slot))
        return out


class _Residuals:
    """A chunk's ``jax.vjp`` pullback as arrays that can be kept in the stash between a
    microbatch's forward and backward slots: its residuals, less the chunk's own params (the
    backward slot has them), with the static rest -- the pullback's structure and where the
    params go -- recorded when the forward is first traced. (The pullback is a pytree whose
    leaves are its residuals.)"""

    def __init__(self) -> None:
        self.treedef = None
        self.params_at: tuple[int, ...] = ()  # per leaf: the params leaf it is, or -1
        self.key_impls: tuple = ()  # per kept leaf: its PRNG impl if it is a key, else None

    def split(self, pullback: Any, params: Any) -> list[jax.Array]:
        leaves, treedef = jax.tree.flatten(pullback)
        p_leaves = jax.tree.leaves(params)
        at = tuple(next((n for n, p in enumerate(p_leaves) if leaf is p), -1) for leaf in leaves)
        kept = [leaf for leaf, a in zip(leaves, at) if a < 0]
        impls = tuple(jax.random.key_impl(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else None
                      for x in kept)
        if self.treedef is None:
            self.treedef, self.params_at, self.key_impls = treedef, at, impls
        elif (at, impls) != (self.params_at, self.key_impls):
            raise AssertionError("a stage's forward traced to different residuals")
        return [x if impl is None else jax.random.key_data(x) for x, impl in zip(kept, impls)]

    def join(self, kept: list[jax.Array], params: Any) -> Callable:
        p_leaves, rest = jax.tree.leaves(params), iter(zip(kept, self.key_impls))
        leaves = []
        for a in self.params_at:
            if a >= 0:
                leaves.append(p_leaves[a])
            else:
                x, impl = next(rest)
                leaves.append(x if impl is None else jax.random.wrap_key_data(x, impl=impl))
        return jax.tree.unflatten(self.treedef, leaves)


def replica_axes(rules: Any) -> tuple[str, ...]:
    """The batch axes a pipeline's executor is manual over besides ``stage``: ``data`` where it
    holds replicas of the params and gradients (DDP, ZeRO-1) and is the outermost batch axis
    (so its shards are blocks of the microbatch's rows). Each device then accumulates its own
    rows' gradients over the step's microbatches and they are reduced once, as DDP reduces
    once per accumulated step; left to the partitioner they were reduced in every backward
    slot, M times a step."""
    data = str(MeshAxis.DATA)
    if rules is None or rules.sizes.get(data, 1) == 1 or rules.batch_axes[:1] != (data,):
        return ()
    if data in rules.state_axes(StateKind.GRADS):  # ZeRO-2/3: gradients reduce-scattered where made
        return ()
    return (data,)


def run(schedule: Schedule, mesh: jax.sharding.Mesh, *,
        embed: Callable[..., jax.Array], body: Callable[..., jax.Array], last: Callable[..., jax.Array],
        blocks: Any, outer: Any, inputs_MBL: jax.Array, targets_MBL: jax.Array,
        seed: jax.Array | float = 1.0, aux: Any = None, replicas: tuple[str, ...] = (),
        grad_specs: Any = None,
        train: bool = True, side: Any = None, head: Callable[..., jax.Array] | None = None
        ) -> tuple[Any, Any, Any] | jax.Array:
    """Loss sum and gradients of one step under ``schedule`` (and its ``layout``).

    ``embed(outer, tokens, i, aux) -> x``; ``body(chunk, x, tokens, i, layers, aux) -> y`` runs
    one chunk of a stage's layers (``chunk``: its ``depth`` slots of the stored stack;
    ``layers``: the model layer in each slot, -1 for an empty one); ``last(chunk, outer, x,
    tokens, targets, i, layers, aux) -> loss sum`` runs the last chunk's layers, the head and the
    loss; ``i`` is the microbatch and ``tokens`` its input tokens (what packed documents' ids
    come from), ``aux`` is passed through (e.g. a dropout key), replicated.
    ``inputs_MBL``/``targets_MBL``: the step's microbatches. ``seed``: the cotangent of the loss
    sum (a loss scale). ``replicas``: batch axes (:func:`replica_axes`) the executor is manual
    over too, each device running its own rows (``inputs_MBL``'s dim 1 is split over them)
    and the gradients summed over them once at the end. ``grad_specs``: where an axis splits
    the gradients beyond the model-parallel ones (FSDP, ZeRO-2 and 3:
    ``ShardingRules.state_axes``), the partition specs of ``blocks``' gradients (as W makes
    them: reduce-scattered where made).
    Returns the loss sum over all microbatches, the stack's gradients (laid out as ``blocks``)
    and the outer params'.
    ``train=False``: the loss sum alone, from the forward slots (evaluation: the stages run
    their own layers, nothing is kept for a backward pass and no stage gathers another's).

    ``side``: zeros shaped like a chunk's side output (an MoE chunk's routing statistics). Then
    ``body`` returns ``(y, (extra_loss, side))`` and ``last`` ``(loss, (extra_loss, side))``:
    ``extra_loss`` (the auxiliary losses) is part of the differentiated loss sum, ``side`` is
    summed as it is; training returns ``((loss, extra_loss, side), d_blocks, d_outer)``, each
    summed over microbatches, stages and replicas (evaluation: the loss alone).

    A zero-bubble schedule (``schedule.split``) runs the last chunk's forward in its forward
    slot like any other, keeping its output; its backward slot runs ``head(outer, y, tokens,
    targets, i, aux) -> loss sum`` (the head and the loss) and the chunk's B; every chunk's backward
    slot computes its input's gradient alone (``split_backward``) and its W slot the weights'.
    """
    Pn, V, K = schedule.stages, schedule.virtual, schedule.slots
    layout = schedule.layout
    if layout is None or (layout.stages, layout.virtual) != (Pn, V):
        raise ConfigError(f"the pipeline's schedule needs a layout of {Pn} stages x {V} chunks")
    S = layout.depth
    zb = schedule.split
    slots_as = slot_layout(dict(mesh.shape), replicas)
    flat = slots_as == "flat"
    if zb and head is None:
        raise ConfigError(f"--pipeline-schedule {schedule.kind} needs the model's head apart from its last chunk")
    tables = {name: jnp.asarray(getattr(schedule, name)) for name in
              ("fwd", "bwd", "fwd_chunk", "bwd_chunk", "fwd_slot", "bwd_slot")
              + (("wgt", "wgt_chunk", "wgt_slot", "bwd_wslot", "wgt_wslot", "fwgt", "fwgt_slot", "fwgt_wslot",
                  "fwd_in", "fwd_from", "bwd_in", "bwd_from", "fwd_bslot", "bwd_bslot") if zb else ())}
    layer_ids = jnp.asarray(layout.layer_ids())
    seed = jnp.asarray(seed, jnp.float32)
    # With chunks, the last stage's output goes on to stage 0's next chunk: a ring.
    to_next = [(s, (s + 1) % Pn) for s in range(Pn if V > 1 else Pn - 1)]
    to_prev = [(b, a) for a, b in to_next]

    def local(blocks, outer, inputs, targets, seed, aux):
        s = jax.lax.axis_index(STAGE)
        x_shape = jax.eval_shape(embed, outer, inputs[0], 0, aux)
        zeros_x = jnp.zeros(x_shape.shape, x_shape.dtype)
        zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)  # noqa: E731
        no_side = (jnp.zeros((), jnp.float32), zeros(side))

        def run_body(*args):  # (y, (extra loss, side)) whether or not the body has a side output
            out = body(*args)
            return out if side is not None else (out, no_side)

        def run_last(*args):
            out = last(*args)
            return out if side is not None else (out, no_side)

        def chunk(v):
            if V == 1:
                return blocks
            return jax.tree.map(lambda b: jax.lax.dynamic_slice_in_dim(b, v * S, S), blocks)

        def add_chunk(acc, d, v):
            if V == 1:
                return jax.tree.map(jnp.add, acc, d)
            return jax.tree.map(lambda a, g: jax.lax.dynamic_update_slice_in_dim(
                a, jax.lax.dynamic_slice_in_dim(a, v * S, S) + g, v * S, 0), acc, d)

        def is_first(v):
            return (s == 0) & (v == 0)

        def is_last(v):
            return (s == Pn - 1) & (v == V - 1)

        def keep(stash, value, slot):
            return jax.tree.map(lambda buf, x: buf.at[slot].set(x), stash, value)

        def keep_if(stash, value, slot):
            """``value`` into ``slot`` where ``slot`` >= 0; else nothing (no spare slot)."""
            at = jnp.maximum(slot, 0)
            return jax.tree.map(lambda buf, x: buf.at[at].set(jnp.where(slot >= 0, x, buf[at])), stash, value)

        def kept(stash, slot):
            return jax.tree.map(lambda buf: buf[slot], stash)

        def arrive(inbox, received, land, take):
            """A zero-bubble stage's inbox: what ``received`` holds this tick into slot ``land``
            (-1: none); the F or B of this tick gets slot ``take``'s, or (-1) ``received``
            itself, taken in the tick it lands. An empty inbox: every arrival is taken so."""
            if inbox.shape[0] == 0:
                return inbox, received
            inbox = keep_if(inbox, received, land)
            return inbox, jnp.where(take >= 0, kept(inbox, jnp.maximum(take, 0)), received)

        # Kept from a chunk's forward slot to its backward slot: only where the last chunk's
        # backward runs ticks after its forward (Schedule.keeps_inputs); else none.
        held_slots = K + 1 if schedule.keeps_inputs else 0

        def hold(stash_x, x, i, slot, back):
            """``x`` (this tick's forward's, for the last chunk's backward slot) into the
            stash, and what the backward slot of this tick reads: the kept one, or ``x``."""
            if not held_slots:
                return stash_x, x
            stash_x = keep(stash_x, x, jnp.where(i >= 0, slot, K))
            return stash_x, stash_x[jnp.maximum(back, 0)]

        def take_input(t, received_x):
            """The forward slot's microbatch (-1: idle), the same clipped to a valid index, its
            chunk, the stash slot and the chunk's input (embedded on the first chunk)."""
            i, v = tables["fwd"][t, s], tables["fwd_chunk"][t, s]
            i_, v_ = jnp.maximum(i, 0), jnp.maximum(v, 0)
            def embedded():
                with _op("embed"):
                    return embed(outer, inputs[i_], i_, aux)

            x_in = jax.lax.cond(i >= 0, lambda: jax.lax.cond(is_first(v_), embedded, lambda: received_x),
                                lambda: zeros_x)
            return i, i_, v_, tables["fwd_slot"][t, s], x_in

        def eval_tick(carry, t):
            received_x, stash_x, loss_acc, inbox_x = carry
            if zb:  # what arrived waits in the inbox until its forward takes it, as in training
                inbox_x, received_x = arrive(inbox_x, received_x, tables["fwd_in"][t, s], tables["fwd_from"][t, s])
            i, i_, v_, slot, x_in = take_input(t, received_x)
            y = jax.lax.cond((i >= 0) & ~is_last(v_),
                             lambda: run_body(chunk(v_), x_in, inputs[i_], i_, layer_ids[s, v_], aux)[0],
                             lambda: zeros_x)
            stash_x, x_last = hold(stash_x, x_in, i, slot, tables["bwd_slot"][t, s])
            # The last chunk's loss, at its backward slot (where training runs it).
            j, w = tables["bwd"][t, s], jnp.maximum(tables["bwd_chunk"][t, s], 0)
            j_ = jnp.maximum(j, 0)
            loss = jax.lax.cond((j >= 0) & is_last(w), lambda: run_last(
                chunk(w), outer, x_last, inputs[j_], targets[j_], j_, layer_ids[s, w], aux
            )[0].astype(jnp.float32), lambda: jnp.zeros((), jnp.float32))
            return (jax.lax.ppermute(y, STAGE, to_next), stash_x, loss_acc + loss, inbox_x), None

        if not train:
            inbox = jnp.zeros((schedule.in_slots if zb else 0, *zeros_x.shape), zeros_x.dtype)
            init = (zeros_x, jnp.zeros((held_slots, *zeros_x.shape), zeros_x.dtype), jnp.zeros((), jnp.float32),
                    inbox)
            (_, _, loss, _), _ = jax.lax.scan(eval_tick, init, jnp.arange(schedule.ticks))
            return jax.lax.psum(loss, (STAGE, *replicas))

        residuals = _Residuals()

        def forward(c, x, j, ids):
            """The chunk's output, what its backward pass needs -- the residuals of its
            ``jax.vjp``, less the chunk's own params (read again in the backward slot) -- and
            its side output."""
            (y, (extra, side_out)), vjp = jax.vjp(lambda b, x: run_body(b, x, inputs[j], j, ids, aux), c, x)
            return y, residuals.split(vjp, c), (extra.astype(jnp.float32), side_out)

        # The residuals' structure, from one trace.
        _, res_shapes, _ = jax.eval_shape(forward, chunk(0), zeros_x, 0, layer_ids[s, 0])

        def backward(j, v, x_in, stash_res, slot, received_g):
            """(loss, (extra loss, side), the gradients of the chunk, the outer params, its input)."""
            c, ids = chunk(v), layer_ids[s, v]

            def middle():
                # The extra loss is part of the loss sum: its cotangent is the seed.
                with _op("B"):
                    d_chunk, d_x = residuals.join(kept(stash_res, slot), c)(
                        (received_g, (seed, zeros(side))))
                return jnp.zeros((), jnp.float32), no_side, d_chunk, zeros(outer), d_x

            def end():
                def total(b, o, x):
                    loss, (extra, side_out) = run_last(b, o, x, inputs[j], targets[j], j, ids, aux)
                    return loss + extra, (loss.astype(jnp.float32), (extra.astype(jnp.float32), side_out))

                with _op("last"):
                    total_loss, vjp, (loss, extras) = jax.vjp(total, c, outer, x_in, has_aux=True)
                    d_chunk, d_outer, d_x = vjp(seed.astype(total_loss.dtype))
                return loss, extras, d_chunk, d_outer, d_x

            loss, extras, d_chunk, d_outer, d_x = jax.lax.cond(is_last(v), end, middle)
            return loss, extras, d_chunk, embed_grad(d_outer, d_x, j, v), d_x

        def embed_grad(d_outer, d_x, j, v):
            """The first chunk's: its input's gradient goes into the embedding."""
            def add():
                with _op("embed_grad"):
                    d_embed = jax.vjp(lambda o: embed(o, inputs[j], j, aux), outer)[1](d_x)[0]
                return jax.tree.map(jnp.add, d_outer, d_embed)

            return jax.lax.cond(is_first(v), add, lambda: d_outer)

        def idle_backward(j, v, x_in, stash_res, slot, received_g):
            return jnp.zeros((), jnp.float32), no_side, zeros(chunk(0)), zeros(outer), zeros_x

        if zb:
            # B and W of a chunk's pullback, as functions of (its kept residuals, its params).
            n_weights = len(jax.tree.leaves(chunk(0)))
            chunk_tree = jax.tree.structure(chunk(0))
            cot_shape = (zeros_x, (jnp.zeros((), jnp.float32), zeros(side)))
            halves = split_backward.split(lambda rc, cot: residuals.join(rc[0], rc[1])(cot),
                                          (res_shapes, chunk(0)), cot_shape, n_weights)
            _, w_shapes = jax.eval_shape(halves.b, (res_shapes, chunk(0)), cot_shape)
        # Per residual leaf: kept until W (zero-bubble, W reads it), else until B. Zero-bubble
        # residuals are (the ones W reads, per leaf; the B-only ones with B's hand-over to W).
        # (``w_reads`` goes on over the chunk's params, which follow its residuals.)
        until_w = list(halves.w_reads)[:len(res_shapes)] if zb else [True] * len(res_shapes)
        if zb:
            # Where only batch axes split the values (FSDP, ZeRO), each is split on its rows
            # alone, and a hand-over leaf may be packed into a B-only leaf's rows.
            handover = Handover([r for r, w in zip(res_shapes, until_w) if not w], jax.tree.leaves(w_shapes),
                                 schedule, flat, leafwise=True,
                                 rows=x_shape.shape[:2] if slots_as == "rows" else None)

        def keep_res(stash_res, res, slot, b_slot):
            if not zb:
                return keep(stash_res, res, slot)
            ws, store = stash_res
            return (keep(ws, [x for x, w in zip(res, until_w) if w], slot),
                    handover.keep_res(store, [x for x, w in zip(res, until_w) if not w], slot, b_slot))

        def kept_res(stash_res, slot, b_slot=None):
            """The residuals of ``slot`` (zero-bubble: B-only ones of ``b_slot``; None: W's
            read, the B-only ones zeros that W does not read)."""
            if not zb:
                return kept(stash_res, slot)
            ws, store = stash_res
            for_w = iter(kept(ws, slot))
            if b_slot is None:
                b_only = iter(jnp.zeros(x.shape, x.dtype) for x in handover.b_only)
            else:
                b_only = iter(handover.res(store, slot, b_slot))
            return [next(for_w) if w else next(b_only) for w in until_w]

        # Where B's hand-over is written: in B's branch of the tick's conditional, so that a
        # tick without B passes the store on untouched, where a chunk holds two layer slots or
        # more; written after the conditional, the hand-over was a value of its own beside the
        # store and a tick without B read the slot out to write it back (0.95-1.15x 1F1B's temp
        # in the cases of docs/pipelines.md's "Where B writes its hand-over", 0.87-1.05x in
        # B's branch). A chunk of one layer, whose layer scan XLA inlines, had the store copied
        # into the conditional and out (1.18-1.44x on ``stage=4,data=2``): there B hands the
        # hand-over out and it is written after.
        b_writes = S > 1

        def backward_b(j, v, y_kept, stash_res, slot, received_g, b_slot, w_slot, at):
            """B: (loss, (extra loss, side), the outer params' gradients, the input's
            gradient, and what W reads: written into the hand-over store at ``at`` and
            ``w_slot`` where ``b_writes``, else its leaves); the last chunk's runs the head
            and the loss first."""
            c = chunk(v)

            def head_grads():
                with _op("head"):
                    loss, vjp = jax.vjp(lambda o, y: head(o, y, inputs[j], targets[j], j, aux), outer, y_kept)
                    d_outer, d_y = vjp(seed.astype(loss.dtype))
                return loss.astype(jnp.float32), d_outer, d_y

            loss, d_outer, d_y = jax.lax.cond(
                is_last(v), head_grads, lambda: (jnp.zeros((), jnp.float32), zeros(outer), received_g))
            with _op("B"):
                d_in, kept_w = halves.b((kept_res(stash_res, slot, b_slot), c), (d_y, (seed, zeros(side))))
            d_x = jax.tree.unflatten(jax.tree.structure(zeros_x), d_in)
            kept_w = jax.tree.leaves(kept_w)
            handed = handover.keep_handed(stash_res[1], kept_w, at, w_slot) if b_writes else kept_w
            return loss, no_side, embed_grad(d_outer, d_x, j, v), d_x, handed

        def idle_b(j, v, y_kept, stash_res, slot, received_g, b_slot, w_slot, at):
            """No B: the store as it is, or (B not writing) the slot's own content to write back."""
            handed = stash_res[1] if b_writes else handover.handed_to_w(stash_res[1], slot, w_slot)
            return jnp.zeros((), jnp.float32), no_side, zeros(outer), zeros_x, handed

        def zero_after(tree, spec=None):
            """0, made from ``tree``'s first element by a test XLA cannot fold (as attention's
            block masks are): what is computed from it comes after ``tree``. Where the stage's
            values are split (not ``flat``), ``tree`` is the smallest gradient, a norm's scale
            in these models, which each device holds whole where the matmuls are split; where
            the params are split beyond those (``spec``: its layout), each device takes its own
            shard's first element, so that none is fetched from another (all are 0)."""
            return zero_from(jax.tree.leaves(tree)[0], spec)

        def add_weights(acc, stash, k, u, res_slot, w_slot, op="W"):
            """W of microbatch ``k`` (-1: none) on chunk ``u``, from its residuals and what its
            B kept, added into the weights' gradients (an idle slot adds nothing)."""
            def weights(acc):
                res_at = jnp.maximum(res_slot, 0)
                handed = handover.handed_to_w(stash[1][1], res_at, jnp.maximum(w_slot, 0))
                with _op(op):
                    grads = halves.w((kept_res(stash[1], res_at), chunk(u)),
                                     jax.tree.unflatten(jax.tree.structure(w_shapes), handed))
                return add_chunk(acc, jax.tree.unflatten(chunk_tree, grads), u)

            return jax.lax.cond(k >= 0, weights, lambda acc: acc, acc)

        # The gradient a hand-over's write is ordered after where the values are split, and
        # where the gradients are split, its layout (the stage axis dropped: the executor's own).
        smallest = int(np.argmin([x.size for x in jax.tree.leaves(blocks)]))
        smallest_spec = None
        if grad_specs is not None:
            if jax.tree.structure(grad_specs, is_leaf=lambda x: isinstance(x, P)) != jax.tree.structure(blocks):
                raise AssertionError("the gradients' specs are not shaped as the stack's params")
            entry = lambda e: tuple(a for a in ((e,) if isinstance(e, str) else e) if a != STAGE) or None  # noqa: E731
            smallest_spec = P(*(entry(e) if e else None
                                for e in jax.tree.leaves(grad_specs, is_leaf=lambda x: isinstance(x, P))[smallest]))

        def tick(carry, t):
            received_x, received_g, stash, loss_acc, extras_acc, d_blocks_acc, d_outer_acc = carry
            # Forward slot: take the microbatch's input, run the chunk and keep its residuals
            # (the last chunk keeps its input: its forward runs in its backward slot, with the
            # head), pass the chunk's output on.
            if zb:  # what arrived waits in the inbox until its F or B takes it
                inbox_x, received_x = arrive(stash[2], received_x, tables["fwd_in"][t, s], tables["fwd_from"][t, s])
                inbox_g, received_g = arrive(stash[3], received_g, tables["bwd_in"][t, s], tables["bwd_from"][t, s])
                stash = stash[:2] + (inbox_x, inbox_g)
            i, i_, v_, slot, x_in = take_input(t, received_x)
            stash_x, stash_res = stash[:2]

            def run_forward(stash_res):
                with _op("F"):
                    y, res, extras = forward(chunk(v_), x_in, i_, layer_ids[s, v_])
                b_slot = jnp.maximum(tables["fwd_bslot"][t, s], 0) if zb else slot
                return y, keep_res(stash_res, res, slot, b_slot), extras

            # Residuals are written (in place) only where the chunk runs: the last chunk, whose
            # forward runs in its backward slot, and idle slots move none.
            runs = (i >= 0) if zb else (i >= 0) & ~is_last(v_)
            y, stash_res, fwd_extras = jax.lax.cond(runs, run_forward,
                                                    lambda stash_res: (zeros_x, stash_res, no_side), stash_res)
            # Kept for the backward slot: the last chunk's input (its forward runs there), or
            # under a zero-bubble schedule its output (the head's input). Idle: spare slot K.
            held = jnp.where(is_last(v_), y, x_in) if zb else x_in
            stash_x, x_last = hold(stash_x, held, i, slot, tables["bwd_slot"][t, s])
            stash = (stash_x, stash_res) + tuple(stash[2:])
            if zb:  # a W in the forward slot (the stage runs no F this tick)
                d_blocks_acc = add_weights(d_blocks_acc, stash, tables["fwgt"][t, s], 0,
                                           tables["fwgt_slot"][t, s], tables["fwgt_wslot"][t, s], op="W_first")
            # Backward slot.
            j, w = tables["bwd"][t, s], jnp.maximum(tables["bwd_chunk"][t, s], 0)
            back = jnp.maximum(tables["bwd_slot"][t, s], 0)
            if not zb:
                loss, bwd_extras, d_chunk, d_outer, d_x = jax.lax.cond(
                    j >= 0, backward, idle_backward, jnp.maximum(j, 0), w, x_last, stash[1], back,
                    received_g)
                d_blocks_acc = add_chunk(d_blocks_acc, d_chunk, w)
            else:
                w_slot = jnp.maximum(tables["bwd_wslot"][t, s], 0)
                # B writes its hand-over after the forward slot's W has read the store, which
                # XLA cannot see from the slot alone (nothing orders the two): the slot is made
                # to depend on that W's result, so that XLA writes the store in place instead of
                # copying it. (An optimization barrier over the slot and that result does not
                # keep the copy away.) Where the values are split, on the smallest gradient (a
                # norm's scale in these models, whole on each device where its layer's matmuls
                # are split; where the params are split, each device's own shard of it). ``at``
                # is an operand of B's conditional, so B as a whole comes after that W, as the
                # tables order them.
                at = back
                if handover.shared or handover.hosts:
                    after = [jax.tree.leaves(d_blocks_acc)[smallest]]
                    at = back + (zero_after(d_blocks_acc) if flat else zero_after(after, smallest_spec))
                loss, bwd_extras, d_outer, d_x, handed = jax.lax.cond(
                    j >= 0, backward_b, idle_b, jnp.maximum(j, 0), w, x_last, stash[1], back,
                    received_g, jnp.maximum(tables["bwd_bslot"][t, s], 0), w_slot, at)
                store = handed if b_writes else handover.keep_handed(stash[1][1], handed, at, w_slot)
                stash = (stash[0], (stash[1][0], store)) + tuple(stash[2:])
                # W slot: the weights' gradients from the residuals and what B kept.
                d_blocks_acc = add_weights(d_blocks_acc, stash, tables["wgt"][t, s],
                                           jnp.maximum(tables["wgt_chunk"][t, s], 0), tables["wgt_slot"][t, s],
                                           tables["wgt_wslot"][t, s])
            # The sends wait for the tick's last op. A send is a rendezvous of the stages, and
            # XLA would issue each as soon as its value is made (after the F, after the B), so
            # that a tick lasted as long as the slower stage's ops before it plus the slower
            # stage's after it, where the tables count the slower stage's whole tick (ZB-H1's
            # Ws, after both sends, then ran while the other stage waited). On fake CPU devices
            # a send left beside the backward slot's branch, which holds collectives where an
            # axis splits the stage's values, could also be taken before it on one device and
            # after it on another (``StagedModel``'s ``gathered_first`` says why): the smallest
            # gradient orders the sends there, each device reading its own shard of it.
            zero = zero_after(d_blocks_acc) if flat else zero_after([jax.tree.leaves(d_blocks_acc)[smallest]],
                                                                       smallest_spec)
            y, d_x = y + zero.astype(y.dtype), d_x + zero.astype(d_x.dtype)
            received_x = jax.lax.ppermute(y, STAGE, to_next)
            received_g = jax.lax.ppermute(d_x, STAGE, to_prev)
            extras_acc = jax.tree.map(lambda a, f, b: a + f + b, extras_acc, fwd_extras, bwd_extras)
            return (received_x, received_g, stash, loss_acc + loss, extras_acc, d_blocks_acc,
                    jax.tree.map(jnp.add, d_outer_acc, d_outer)), None

        slots = lambda tree, n: jax.tree.map(lambda x: jnp.zeros((n, *x.shape), x.dtype), tree)  # noqa: E731
        if not zb:
            stashes = (slots(zeros_x, held_slots), [slots(r, K) for r in res_shapes])
        else:  # the residuals W reads, the B-only ones with what B hands W; the inboxes
            stashes = (slots(zeros_x, held_slots),
                       ([slots(r, K) for r, w in zip(res_shapes, until_w) if w], handover.zeros()),
                       slots(zeros_x, schedule.in_slots), slots(zeros_x, schedule.bwd_in_slots))
        init = (zeros_x, zeros_x, stashes, jnp.zeros((), jnp.float32), no_side, zeros(blocks), zeros(outer))
        (_, _, _, loss, extras, d_blocks, d_outer), _ = jax.lax.scan(tick, init, jnp.arange(schedule.ticks))
        # The loss lives on the last stage, the outer params' gradients on the two ends; each
        # replica holds its rows' share of both and of the stack's gradients.
        if replicas:
            d_blocks = jax.lax.psum(d_blocks, replicas)
        loss = jax.lax.psum(loss, (STAGE, *replicas))
        if side is not None:
            loss = (loss, *jax.lax.psum(extras, (STAGE, *replicas)))
        return loss, d_blocks, jax.lax.psum(d_outer, (STAGE, *replicas))

    stacked = jax.tree.map(lambda _: P(STAGE), blocks)
    replicated = jax.tree.map(lambda _: P(), outer)
    rows = P(None, replicas or None)
    losses = P() if side is None else (P(), P(), jax.tree.map(lambda _: P(), side))
    return jax.shard_map(local, mesh=mesh, axis_names=frozenset({STAGE, *replicas}), check_vma=False,
                         in_specs=(stacked, replicated, rows, rows, P(), jax.tree.map(lambda _: P(), aux)),
                         out_specs=(losses, stacked, replicated) if train else P()
                         )(blocks, outer, inputs_MBL, targets_MBL, seed, aux)
