"""Causal attention, dense or as a ring over the ``sequence`` axis (context parallelism).

With the sequence sharded over ``sequence`` (size S), each device holds one chunk of C = L/S
queries, keys and values. The ring runs S steps: each device attends its queries to the kv
chunk it holds, folds the result into a running (max, sum, output) -- the online softmax of
flash attention -- and passes the kv chunk to its neighbour with ``ppermute``, so transfers
can overlap the next step's compute.

Balanced (the model's tokens in :func:`balanced_order`, torchtitan's head-tail and MaxText's
load-balanced layout): the sequence is cut into 2S halves of C/2 and device d holds halves d
and 2S - 1 - d. Of the four half-pairs a step could compute, a query half never needs a later
key half, so each step computes two (the own step three, two of them causal diagonals, each
halved twice more to skip its masked corner) and skips the rest: (2S + 0.25) / 4S of the full
square per device, the same on every device, against the contiguous layout's full square with
the future masked. Otherwise (a sequence that does not split into 2S halves, or dropout, whose
masks follow the sequence's order) the contiguous layout, whose future chunks are masked, not
skipped.

Packed documents (``segments``, ``[B, L]`` ids of each token's document): a query attends only
to keys of its own document, on every path -- the dense and blockwise kernels mask by segment as
well as position, a ring passes each kv chunk's segment ids along with it, Ulysses gathers them
whole. A query always sees itself, so every row's running max is finite by the end; rows whose
earlier blocks were all masked add ``exp(0)`` junk that the first finite score scales by
``exp(_NEG - m) = 0``.

Memory per device: the forward holds one query chunk, two kv chunks (the one in use and the
one arriving) and the running statistics, O(C) instead of O(L) for gathered keys/values; the
backward pass (:func:`_ring_attention`, Ring Attention's rather than autodiff's, which would
keep every step's kv chunk, running output and probabilities) reads the device's own chunks,
the output and each row's log-sum-exp, O(C) too, and passes the kv chunks round again with
their gradients. Each pair is folded (and differentiated) :data:`RING_BLOCK` queries and keys
at a time, so a step's scores in flight are ``[B, K, G, RING_BLOCK, RING_BLOCK]``, not the
pair's ``[..., Q, M]``.
The partitioner alone would all-gather keys and values.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxshard.axes import Dim
from jaxshard.errors import ConfigError
from jaxshard.rules import active, entry_axes, spec_axes

_NEG = float(jnp.finfo(jnp.float32).min)
RING = "ring_attention"  # a ring's output and rows' log-sum-exp, which its backward pass reads

# The dense path's kernel: "auto" (on GPUs cuDNN's flash kernel where it takes the inputs, the
# blockwise kernel where it does not; the materialised softmax elsewhere) or "blockwise" (flash attention's algorithm in plain JAX, any backend). Set by
# :func:`kernel` around tracing.
_KERNEL = ["auto"]
KERNELS = ("auto", "blockwise")
BLOCK = 512  # keys per block of the blockwise kernel


# The order of the tokens being traced when it is :func:`balanced_order` (None: the sequence's
# own), set by the model around its forward pass with :func:`balanced`.
_ORDER: list[np.ndarray | None] = [None]

# The packed documents of the tokens being traced: (segment ids, positions in the document),
# each [B, L] in the traced order, set by the model around its forward pass with documents().
_DOCUMENTS: list[tuple[jax.Array, jax.Array] | None] = [None]


def ring_size(rules=None) -> int:
    """S, the devices a ring of ``rules`` (default: the active ones) passes key/value chunks
    around: 1 without context parallelism, or under Ulysses."""
    rules = active() if rules is None else rules
    if rules is None or rules.strategy.context_parallel != "ring":
        return 1
    return rules.size(rules.activation_mesh_axes(Dim.LENGTH))


def kv_copies(kv_heads: int, groups: int, S: int) -> int:
    """How many times Ulysses repeats each kv head so that S devices split them: r = S /
    gcd(kv_heads, S), the query heads regrouped into kv_heads x r groups of groups / r (1 when S
    divides the kv heads). Query heads divisible by S guarantee that r divides groups."""
    r = S // math.gcd(kv_heads, S)
    if groups % r:
        raise ValueError(f"{kv_heads * groups} query heads are not divisible by {S}")
    return r


def check_ulysses(cfg, rules) -> None:
    """Ulysses splits each device's query heads over the sequence axis: they must divide."""
    axes = rules.activation_mesh_axes(Dim.LENGTH)
    if rules.strategy.context_parallel != "ulysses" or not axes:
        return
    S = rules.size(axes)
    tensor = rules.activation_mesh_axes(Dim.ACT_HEADS)
    T = rules.size(tensor) if cfg.n_heads % rules.size(tensor) == 0 else 1
    if (cfg.n_heads // T) % S:
        on = f" per tensor shard ({cfg.n_heads} over tensor={T})" if T > 1 else ""
        raise ConfigError(f"--context-parallel ulysses splits the query heads over sequence={S}: "
                          f"{cfg.n_heads // T} heads{on} are not divisible by {S} (use ring)")


def balances(cfg, S: int, L: int) -> bool:
    """Whether a ring of S devices runs model ``cfg``'s sequence of ``L`` in the balanced
    layout: it splits into 2S halves, and no dropout mask follows the sequence's order. (MoE
    models, whose capacity drops would, are refused under a ring: ``training.step``.)"""
    return S > 1 and L % (2 * S) == 0 and not cfg.dropout


def imbalance_note(cfg, L: int, rules=None) -> str | None:
    """Where a ring (of ``rules``, default the active ones) cannot run model ``cfg``'s
    sequence of ``L`` balanced (:func:`balances`): the log's line saying why and what it
    costs; else None."""
    S = ring_size(rules)
    if S < 2 or balances(cfg, S, L):
        return None
    why = (f"dropout {cfg.dropout:g}, whose masks follow the sequence's order" if cfg.dropout
           else f"--seq-len {L} does not split into 2 x sequence={S} halves")
    return (f"ring attention keeps contiguous chunks ({why}): each device computes every chunk pair "
            f"with the future masked, about twice the balanced ring's attention")


DIAGONAL_DEPTH = 2  # times a causal diagonal block is halved to skip its masked corner


def diagonal_depth(n: int) -> int:
    """How often a causal diagonal block of ``n`` queries is halved (at most
    :data:`DIAGONAL_DEPTH`, while its halves are whole)."""
    depth = 0
    while depth < DIAGONAL_DEPTH and n % 2 ** (depth + 1) == 0:
        depth += 1
    return depth


def balanced_work(S: int, L: int) -> float:
    """The fraction of the full square of scores a device of a balanced ring computes: of the
    4S half-pairs its chunk has, 2S - 1 whole ones and two causal diagonals, each of which
    computes 1/2 + 2^-(r+1) of its block (halved r times, :func:`diagonal_depth`)."""
    diagonal = 0.5 + 2.0 ** -(diagonal_depth(L // (2 * S)) + 1)
    return (2 * S - 1 + 2 * diagonal) / (4 * S)


def blocked_share(S: int, L: int, balanced: bool) -> float:
    """The share of the attention a device of a ring of S computes (balanced layout or not)
    that is folded in blocks (:func:`_key_block`): each pair of blocks runs in a loop of its
    own, forward and backward, so a policy that recomputes the forward pass cannot lend those
    scores to the backward pass's, as XLA does for a pair computed whole."""
    C = L // S
    if not balanced:
        return float(_key_block(C) < C)
    h = C // 2

    def diagonal(n, depth):  # (area, keys) of the pairs _fold cuts a causal diagonal into
        return [(n * n, n)] if not depth else diagonal(n // 2, depth - 1) * 2 + [(n * n // 4, n // 2)]

    pairs = diagonal(h, diagonal_depth(h)) * 2 + [(h * h, h)] * (2 * S - 1)
    return sum(a for a, m in pairs if _key_block(m) < m) / sum(a for a, _ in pairs)


def balanced_order(L: int, S: int) -> np.ndarray:
    """The token order in which a contiguous split over S devices gives device d the halves d
    and 2S - 1 - d of the sequence (L / 2S tokens each)."""
    h = L // (2 * S)
    return np.concatenate([np.r_[d * h:(d + 1) * h, (2 * S - 1 - d) * h:(2 * S - d) * h] for d in range(S)])


@contextlib.contextmanager
def balanced(order: np.ndarray | None) -> Iterator[None]:
    """Trace the model with its tokens in ``order`` (:func:`balanced_order`; None: their own):
    the ring skips the half-pairs the causal mask removes, and :func:`positions` gives each
    token its place in the sequence."""
    with _pushed(_ORDER, order):
        yield


@contextlib.contextmanager
def _pushed(stack: list, value) -> Iterator[None]:
    """``value`` on top of a context ``stack`` while the block runs."""
    stack.append(value)
    try:
        yield
    finally:
        stack.pop()


def current_order(L: int) -> np.ndarray | None:
    """The order of the ``L`` tokens being traced, if it is not the sequence's own."""
    order = _ORDER[-1]
    return None if order is None or len(order) != L else order


def positions(L: int) -> jax.Array:
    """Where each of the ``L`` tokens being traced stands: in the sequence (``[L]``), or in its
    document when documents are packed (``[B, L]``, :func:`documents`)."""
    docs = _DOCUMENTS[-1]
    if docs is not None and docs[1].shape[1] == L:
        return docs[1]
    order = current_order(L)
    return jnp.arange(L) if order is None else jnp.asarray(order)


@contextlib.contextmanager
def documents(segments_BL: jax.Array | None, positions_BL: jax.Array | None = None) -> Iterator[None]:
    """Trace the model with packed documents: ``segments_BL`` (each token's document id) keeps
    attention within documents, ``positions_BL`` (each token's place in its document) is what
    :func:`positions` gives. None: one sequence, as without the context."""
    with _pushed(_DOCUMENTS, None if segments_BL is None else (segments_BL, positions_BL)):
        yield


def current_segments(L: int) -> jax.Array | None:
    """The segment ids ``[B, L]`` of the ``L`` tokens being traced, if documents are packed."""
    docs = _DOCUMENTS[-1]
    return None if docs is None or docs[0].shape[1] != L else docs[0]


def document_layout(inputs_BL: jax.Array, eot: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(segment ids, positions in the document, the tokens whose target counts) of packed
    inputs, documents ended by ``eot``: an end-of-text token belongs to the document it ends,
    the next token starts a new one at position 0, and the target after an end-of-text (the
    next document's first token, which nothing before it predicts) does not count."""
    ends_BL = inputs_BL == eot
    L = inputs_BL.shape[1]
    segments_BL = jnp.cumsum(ends_BL, axis=1, dtype=jnp.int32) - ends_BL.astype(jnp.int32)
    index = jnp.arange(L, dtype=jnp.int32)
    starts_BL = jnp.where(jnp.pad(ends_BL[:, :-1], ((0, 0), (1, 0))), index, 0)
    positions_BL = index - jax.lax.cummax(starts_BL, axis=1)
    return segments_BL, positions_BL, ~ends_BL


@contextlib.contextmanager
def kernel(name: str) -> Iterator[None]:
    """Trace the dense path's attention with kernel ``name`` (see :data:`KERNELS`). The plan's
    confirmation compiles with "blockwise" on CPU so that the program keeps what a GPU's flash
    kernel keeps (no ``L x L`` probabilities) instead of the materialised softmax's."""
    if name not in KERNELS:
        raise ValueError(f"attention kernel {name!r}: one of {', '.join(KERNELS)}")
    with _pushed(_KERNEL, name):
        yield


def traced_choices() -> dict[str, object]:
    """The choices :func:`causal_attention` reads from the context it is traced in (the
    kernel, whether the tokens are in the balanced order), as arguments to bind it with: a
    recompute traced later, in a backward pass outside that context (``--remat selective``'s
    custom VJP), must make the same ones."""
    return {"kernel": _KERNEL[-1], "balanced": _ORDER[-1] is not None}


def causal_attention(q_BLKGH: jax.Array, k_BLKH: jax.Array, v_BLKH: jax.Array, segments_BL: jax.Array | None = None,
                     *, kernel: str | None = None, balanced: bool | None = None) -> jax.Array:
    """Softmax(q k^T / sqrt(H), causal) v for grouped queries; returns ``[B, L, K, G, H]``.
    ``segments_BL``: packed documents' ids, which a query's keys must share (None: one
    sequence). ``kernel`` and ``balanced``: as :func:`traced_choices` (default: the context's)."""
    kernel = _KERNEL[-1] if kernel is None else kernel
    balanced = _ORDER[-1] is not None if balanced is None else balanced
    rules = active()
    axes = rules.activation_mesh_axes(Dim.LENGTH) if rules is not None else ()
    if not axes:
        return _dense(q_BLKGH, k_BLKH, v_BLKH, kernel, segments_BL)
    # Manual over the batch axes as well as the sequence's; heads stay with the partitioner.
    spec = rules.activation_spec((Dim.BATCH, Dim.LENGTH), q_BLKGH.shape[:2])
    manual = spec_axes(spec)
    if rules.strategy.context_parallel == "ulysses":
        return _ulysses_region(rules, q_BLKGH, k_BLKH, v_BLKH, axes, kernel, segments_BL)
    ring = functools.partial(_ring_attention, axes=tuple(axes), manual=tuple(manual), balanced=balanced)
    if segments_BL is None:
        return jax.shard_map(lambda q, k, v: ring(q, k, v, None), mesh=rules.context_mesh,
                             in_specs=(spec, spec, spec), out_specs=spec,
                             axis_names=manual)(q_BLKGH, k_BLKH, v_BLKH)
    # (packed documents' ids whole on every device of the ring: each slices the chunk it holds)
    return jax.shard_map(ring, mesh=rules.context_mesh, in_specs=(spec, spec, spec, _whole_rows(spec)),
                         out_specs=spec, axis_names=manual)(q_BLKGH, k_BLKH, v_BLKH, segments_BL)


def _whole_rows(spec: jax.sharding.PartitionSpec) -> jax.sharding.PartitionSpec:
    """``[B, L]`` ids laid out as ``spec``'s rows, the sequence whole."""
    return jax.sharding.PartitionSpec(spec[0] if len(spec) else None, None)


def _held_ids(seg_BL, axes, i: int):
    """Packed documents' segment ids ``[B, C]`` of the chunk a device holds at ring step
    ``i`` (0: its own), sliced from the row's whole ids ``[B, L]`` that every device of the
    ring has (None without documents): the ids travel with no chunk."""
    if seg_BL is None:
        return None
    S = math.prod(jax.lax.axis_size(a) for a in axes)
    C = seg_BL.shape[1] // S
    return jax.lax.dynamic_slice_in_dim(seg_BL, (jax.lax.axis_index(axes) - i) % S * C, C, axis=1)


def _allowed(q_pos, k_pos, q_seg=None, k_seg=None):
    """Which keys each query sees, broadcastable to ``[B, K, G, Q, M]``: the causal mask, and
    with segment ids (``[B, Q]``, ``[B, M]``) only those of the query's own document."""
    causal_QM = q_pos[:, None] >= k_pos[None, :]
    if q_seg is None:
        return causal_QM
    return (causal_QM & (q_seg[:, :, None] == k_seg[:, None, :]))[:, None, None]


def _scores(q_BLKGH, k_BMKH, q_pos, k_pos, q_seg=None, k_seg=None):
    return jnp.where(_allowed(q_pos, k_pos, q_seg, k_seg), _unmasked(q_BLKGH, k_BMKH), _NEG)


def _unmasked(q_BLKGH, k_BMKH):
    """The scaled float32 scores ``[B, K, G, L, M]``."""
    return jnp.einsum("blkgh,bmkh->bkglm", q_BLKGH, k_BMKH,
                      preferred_element_type=jnp.float32) / math.sqrt(q_BLKGH.shape[-1])


def _dense(q_BLKGH, k_BLKH, v_BLKH, kernel: str = "auto", segments_BL=None):
    if kernel == "blockwise":
        return blockwise(q_BLKGH, k_BLKH, v_BLKH, segments_BL=segments_BL)
    L = q_BLKGH.shape[1]
    if jax.default_backend() == "gpu":
        chosen = gpu_kernel(q_BLKGH.dtype, q_BLKGH.shape[-1], L, gpu_capability(), segments_BL is not None)
        if chosen == "blockwise":
            return blockwise(q_BLKGH, k_BLKH, v_BLKH, segments_BL=segments_BL)
        if segments_BL is None:
            return fused(q_BLKGH, k_BLKH, v_BLKH, chosen)
    s_BKGLM = jnp.einsum("blkgh,bmkh->bkglm", q_BLKGH, k_BLKH,
                         preferred_element_type=jnp.float32) / math.sqrt(q_BLKGH.shape[-1])
    if segments_BL is None:
        p_BKGLM = _causal_probabilities(s_BKGLM, v_BLKH.dtype)
    else:
        p_BKGLM = _document_probabilities(s_BKGLM, segments_BL, v_BLKH.dtype)
    return jnp.einsum("bkglm,bmkh->blkgh", p_BKGLM, v_BLKH)


def dense_probabilities(q_BLKGH: jax.Array, k_BLKH: jax.Array, segments_BL: jax.Array | None = None) -> jax.Array:
    """The attention probabilities ``[B, K, G, L, L]`` of the dense path (for tests and
    inspection: which keys each query weighs)."""
    L = q_BLKGH.shape[1]
    index = jnp.arange(L)
    s = _scores(q_BLKGH, k_BLKH, index, index, segments_BL, segments_BL)
    return jax.nn.softmax(s, axis=-1)


def _causal_softmax(s_BKGLM: jax.Array) -> jax.Array:
    L = s_BKGLM.shape[-1]
    return jax.nn.softmax(jnp.where(jnp.arange(L)[:, None] >= jnp.arange(L), s_BKGLM, _NEG), axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _causal_probabilities(s_BKGLM: jax.Array, dtype) -> jax.Array:
    """The causal softmax of the scores, in ``dtype``. Its backward pass needs only these
    probabilities (masked ones are 0, so is their gradient): autodiff keeps them alone, in the
    compute dtype, as Megatron's fused scale-mask-softmax does (Korthikanti et al. 2022's
    2as^2b) -- not also the float32 masked scores and probabilities."""
    return _causal_softmax(s_BKGLM).astype(dtype)


def _probabilities_fwd(s_BKGLM, dtype):
    p = _causal_softmax(s_BKGLM).astype(dtype)
    return p, p


def _probabilities_bwd(dtype, p, dp):
    p, dp = p.astype(jnp.float32), dp.astype(jnp.float32)
    return (p * (dp - (p * dp).sum(-1, keepdims=True)),)


_causal_probabilities.defvjp(_probabilities_fwd, _probabilities_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _document_probabilities(s_BKGLM: jax.Array, segments_BL: jax.Array, dtype) -> jax.Array:
    """:func:`_causal_probabilities` of packed documents (segment ids ``[B, L]``): its backward
    pass keeps the probabilities and the ids, not a ``[B, L, L]`` mask."""
    index = jnp.arange(s_BKGLM.shape[-1])
    allowed = _allowed(index, index, segments_BL, segments_BL)
    return jax.nn.softmax(jnp.where(allowed, s_BKGLM, _NEG), axis=-1).astype(dtype)


def _document_fwd(s_BKGLM, segments_BL, dtype):
    p = _document_probabilities(s_BKGLM, segments_BL, dtype)
    return p, (p, segments_BL)


def _document_bwd(dtype, res, dp):
    p, segments_BL = res
    return _probabilities_bwd(dtype, p, dp)[0], np.zeros(segments_BL.shape, jax.dtypes.float0)


_document_probabilities.defvjp(_document_fwd, _document_bwd)


def blockwise(q_BLKGH: jax.Array, k_BLKH: jax.Array, v_BLKH: jax.Array, block: int | None = None,
              segments_BL: jax.Array | None = None) -> jax.Array:
    """Causal attention by flash attention's algorithm (Dao et al. 2022; FlashAttention-2's
    backward pass) in plain JAX: a scan over blocks of ``block`` keys (None: :data:`BLOCK`, as
    :func:`computed_share` counts it) with the online softmax.
    Autodiff keeps q, k, v, the output and each row's float32 log-sum-exp; the backward pass
    recomputes each block's probabilities from them. So it holds what a GPU's flash kernel
    holds (no ``L x L`` scores), plus one block's ``[B, heads, block, block]`` scores in
    flight: the queries too are taken ``block`` at a time. As a GPU's causal kernel, it skips
    the block pairs wholly in the future (:func:`causal_block_pairs`)."""
    L = k_BLKH.shape[1]
    T = min(BLOCK if block is None else block, L)
    if L % T:
        raise ValueError(f"sequence {L} is not a multiple of the attention block {T}")
    if segments_BL is None:
        return _flash(q_BLKGH, k_BLKH, v_BLKH, T)
    return _flash_documents(q_BLKGH, k_BLKH, v_BLKH, segments_BL, T)


def _blocks(x_BLKH, T):
    B, L, K, H = x_BLKH.shape
    if L % T:
        raise ValueError(f"sequence {L} is not a multiple of the attention block {T}")
    return x_BLKH.reshape(B, L // T, T, K, H).swapaxes(0, 1)  # [L/T, B, T, K, H]


def _block_scores(q_BQKGH, k_BTKH, j, T, q_seg=None, k_seg=None, i=0):
    """Scaled, causally masked float32 scores of query block ``i`` (``Q`` queries from
    ``i * Q``: all of them where ``i`` is 0 and ``Q`` is the sequence) against key block ``j``.

    The block's mask depends on nothing but ``i`` and ``j``, so under remat JAX's partial
    evaluation would compute every block's mask ahead of the loop and stack them,
    ``[L/T, B, K, G, Q, T]`` booleans kept for the backward pass (1 GB per layer for Llama 3
    70B's 8192 tokens): the L x L mask this kernel exists to avoid. Adding a zero read from the
    keys (always 0; XLA folds it away) makes the mask depend on the data, so it is made inside
    the loop."""
    Q = q_BQKGH.shape[1]
    j = j + _zero_read(k_BTKH)
    return _scores(q_BQKGH, k_BTKH, i * Q + jnp.arange(Q), j * T + jnp.arange(T), q_seg, k_seg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash(q_BLKGH, k_BLKH, v_BLKH, T):
    return _flash_fwd(q_BLKGH, k_BLKH, v_BLKH, T)[0]


def causal_block_pairs(n: int) -> np.ndarray:
    """The (query block, key block) pairs of ``n`` blocks a causal kernel computes, ``[P, 2]``:
    every key block up to the query block's own, row by row, ``n (n + 1) / 2`` of the ``n^2``.
    A pair after the diagonal is wholly in the future: skipped, not computed and masked."""
    return np.stack(np.tril_indices(n), axis=1).astype(np.int32)


def _taker(i, j):
    """Read query block ``i`` / key block ``j`` of a ``[n, ...]`` array (None stays None)."""
    def take(x, at):
        return None if x is None else jax.lax.dynamic_index_in_dim(x, at, keepdims=False)
    return functools.partial(take, at=i), functools.partial(take, at=j)


def _add_at(buffer, x, at):
    """``buffer[at] += x`` for a loop's ``[n, ...]`` accumulator."""
    return jax.lax.dynamic_update_index_in_dim(
        buffer, jax.lax.dynamic_index_in_dim(buffer, at, keepdims=False) + x, at, 0)


def _flash_fwd(q_BLKGH, k_BLKH, v_BLKH, T, segments_BL=None):
    """The output and what the backward pass reads: one scan over the causal block pairs
    (:func:`causal_block_pairs`), each query block's online-softmax state folded from its first
    key block to its own and written to the output rows as it goes."""
    L = q_BLKGH.shape[1]
    q_blocks, _, segs = _query_blocks(q_BLKGH, None, segments_BL, T)  # [n, B, T, K, G, H], [n, B, T]
    k_blocks, v_blocks = _blocks(k_BLKH, T), _blocks(v_BLKH, T)
    # (zeros like the queries: inside a shard_map they vary over its axes as the queries do,
    # as the scan's carry out does -- Ulysses' region)
    o_nBKGTH = jnp.zeros_like(q_blocks, jnp.float32).transpose(0, 1, 3, 4, 2, 5)
    fresh = (o_nBKGTH[0, ..., 0] + _NEG, o_nBKGTH[0, ..., 0], o_nBKGTH[0])

    def step(carry, pair):
        state, o_buf, lse_buf = carry
        row, col = _taker(pair[0], pair[1])
        state = tuple(jnp.where(pair[1] == 0, f, x) for f, x in zip(fresh, state))  # a new row
        s_BKGQT = _block_scores(row(q_blocks), col(k_blocks), pair[1], T, row(segs), col(segs), pair[0])
        m, l, o = state = _online_softmax(state, s_BKGQT, col(v_blocks))
        o_buf = jax.lax.dynamic_update_index_in_dim(o_buf, o / l[..., None], pair[0], 0)
        lse_buf = jax.lax.dynamic_update_index_in_dim(lse_buf, m + jnp.log(l), pair[0], 0)
        return (state, o_buf, lse_buf), None

    # Each query sees itself (its own block, the row's last): its row's max is finite from
    # then on, so the junk exp(0) that wholly masked blocks before it added (packed documents:
    # earlier documents' blocks) is scaled by 0 there.
    (_, o, lse), _ = jax.lax.scan(step, (fresh, o_nBKGTH, o_nBKGTH[..., 0]),
                                  jnp.asarray(causal_block_pairs(L // T)))
    o_BLKGH = _row_unblock(o).transpose(0, 3, 1, 2, 4).astype(q_BLKGH.dtype)
    return o_BLKGH, (q_BLKGH, k_BLKH, v_BLKH, o_BLKGH, _row_unblock(lse))


def _online_softmax(state, s_BKGLT, v_BTKH):
    """One block of scores ``s`` (values ``v``) folded into the running float32 (max, sum,
    output) of flash attention's online softmax; returns the new three."""
    m_BKGL, l_BKGL, o_BKGLH = state
    m_new = jnp.maximum(m_BKGL, s_BKGLT.max(-1))
    p = jnp.exp(s_BKGLT - m_new[..., None])
    scale = jnp.exp(m_BKGL - m_new)
    pv = jnp.einsum("bkglt,btkh->bkglh", p.astype(v_BTKH.dtype), v_BTKH, preferred_element_type=jnp.float32)
    return m_new, l_BKGL * scale + p.sum(-1), o_BKGLH * scale[..., None] + pv


def _segment_blocks(segments_BL, T, L):
    """Segment ids as the scan's key blocks, ``[L/T, B, T]`` (None without)."""
    if segments_BL is None:
        return None
    return segments_BL.reshape(segments_BL.shape[0], L // T, T).swapaxes(0, 1)


def _flash_bwd(T, res, do_BLKGH, segments_BL=None):
    """FlashAttention-2's backward pass over the same causal block pairs as the forward pass:
    each pair's probabilities made again from the rows' log-sum-exp, its dq added to its query
    block's and its dk, dv to its key block's (float32 accumulators)."""
    q_BLKGH, k_BLKH, v_BLKH, o_BLKGH, lse_BKGL = res
    L = q_BLKGH.shape[1]
    scale = 1.0 / math.sqrt(q_BLKGH.shape[-1])
    do_BLKGH = do_BLKGH.astype(jnp.float32)
    d_BKGL = jnp.einsum("blkgh,blkgh->bkgl", do_BLKGH, o_BLKGH.astype(jnp.float32))
    q_blocks, _, segs = _query_blocks(q_BLKGH, None, segments_BL, T)
    do_blocks = _query_blocks(do_BLKGH, None, None, T)[0]
    lse_blocks, d_blocks = _row_blocks(lse_BKGL, T), _row_blocks(d_BKGL, T)
    k_blocks, v_blocks = _blocks(k_BLKH, T), _blocks(v_BLKH, T)

    def step(grads, pair):
        dq_buf, dk_buf, dv_buf = grads
        row, col = _taker(pair[0], pair[1])
        q_BQKGH, do_BQKGH, k_BTKH, v_BTKH = row(q_blocks), row(do_blocks), col(k_blocks), col(v_blocks)
        s_BKGQT = _block_scores(q_BQKGH, k_BTKH, pair[1], T, row(segs), col(segs), pair[0])
        p = jnp.exp(s_BKGQT - row(lse_blocks)[..., None])  # [B, K, G, Q, T]
        dv = jnp.einsum("bkglt,blkgh->btkh", p, do_BQKGH)
        dp = jnp.einsum("blkgh,btkh->bkglt", do_BQKGH, v_BTKH.astype(jnp.float32))
        ds = p * (dp - row(d_blocks)[..., None]) * scale
        dq = jnp.einsum("bkglt,btkh->blkgh", ds, k_BTKH.astype(jnp.float32))
        dk = jnp.einsum("bkglt,blkgh->btkh", ds, q_BQKGH.astype(jnp.float32))
        return (_add_at(dq_buf, dq, pair[0]), _add_at(dk_buf, dk, pair[1]), _add_at(dv_buf, dv, pair[1])), None

    zeros = tuple(jnp.zeros_like(x, jnp.float32) for x in (q_blocks, k_blocks, v_blocks))
    (dq, dk, dv), _ = jax.lax.scan(step, zeros, jnp.asarray(causal_block_pairs(L // T)))
    return (_unblock(dq, q_BLKGH.shape).astype(q_BLKGH.dtype), _unblock(dk, k_BLKH.shape).astype(k_BLKH.dtype),
            _unblock(dv, v_BLKH.shape).astype(v_BLKH.dtype))


def _unblock(x, shape):
    """:func:`_blocks` (or a query block's ``[L/T, B, T, K, G, H]``) undone: ``[B, L, ...]``."""
    return x.swapaxes(0, 1).reshape(shape)


def _zero_read(x):
    """0, read from ``x``'s first element (XLA folds it away): a value it is added to depends
    on ``x`` for JAX's partial evaluation, which would otherwise make a block's mask, that
    depends only on positions, ahead of the loop (:func:`_block_scores`)."""
    return jnp.where(jnp.isfinite(x.reshape(-1)[0]), 0, 0)


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash_documents(q_BLKGH, k_BLKH, v_BLKH, segments_BL, T):
    """:func:`_flash` with packed documents' segment ids ``[B, L]``."""
    return _flash_fwd(q_BLKGH, k_BLKH, v_BLKH, T, segments_BL)[0]


def _flash_documents_fwd(q_BLKGH, k_BLKH, v_BLKH, segments_BL, T):
    o, res = _flash_fwd(q_BLKGH, k_BLKH, v_BLKH, T, segments_BL)
    return o, (res, segments_BL)


def _flash_documents_bwd(T, res, do_BLKGH):
    res, segments_BL = res
    return (*_flash_bwd(T, res, do_BLKGH, segments_BL), np.zeros(segments_BL.shape, jax.dtypes.float0))


_flash_documents.defvjp(_flash_documents_fwd, _flash_documents_bwd)


def gpu_capability() -> float | None:
    """The first device's CUDA compute capability (9.0 for an H100), if it reports one."""
    cap = getattr(jax.devices()[0], "compute_capability", None)
    try:
        return float(cap)
    except (TypeError, ValueError):
        return None


def gpu_kernel(dtype, head_dim: int, seq_len: int, capability: float | None = None, documents: bool = False) -> str:
    """The dense path's kernel on GPUs: "cudnn" (its flash attention) for 2-byte floats with a
    head width cuDNN takes (a multiple of 8, at most 128) on Ampere or later (capability 8.0;
    None: unknown, taken as new enough); else "blockwise" where the sequence splits into its
    blocks; else "xla", the materialised softmax. That last is what
    ``jax.nn.dot_product_attention`` picks when not told otherwise, and its ``L x L``
    probabilities, kept per layer, ran a 1B Llama at sequence 8192 out of an 80 GB H100.
    ``documents``: packed documents' ids are given, which cuDNN's kernel is not here, so the
    blockwise kernel (or the materialised softmax) runs in its place."""
    two_bytes = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if two_bytes and head_dim % 8 == 0 and head_dim <= 128 and (capability is None or capability >= 8.0) \
            and not documents:
        return "cudnn"
    return "blockwise" if seq_len % min(BLOCK, seq_len) == 0 else "xla"


def computed_share(kernel: str, seq_len: int) -> float:
    """The share of causal attention's full square of scores that the dense path's ``kernel``
    computes: "xla" (the materialised softmax) all of it; "blockwise" the causal block pairs,
    (n + 1) / (2n) of its n blocks (:func:`causal_block_pairs`); "cudnn" the causal half (its
    tiles are cuDNN's own, so their diagonal's extra is not counted)."""
    if kernel == "xla":
        return 1.0
    if kernel == "cudnn":
        return 0.5
    if kernel == "blockwise":
        n = seq_len // min(BLOCK, seq_len)
        return (n + 1) / (2 * n)
    raise ValueError(f"attention kernel {kernel!r}: one of xla, blockwise, cudnn")


def fused(q_BLKGH: jax.Array, k_BLKH: jax.Array, v_BLKH: jax.Array,
          implementation: str | None = None) -> jax.Array:
    """Causal attention by ``jax.nn.dot_product_attention`` with ``implementation`` "cudnn"
    (flash attention, GPUs only) or "xla" (the materialised softmax; None is JAX's default,
    which is XLA's). Query head ``k * G + g`` attends with kv head ``k``, as in the dense
    path."""
    B, L, K, G, H = q_BLKGH.shape
    o_BLNH = jax.nn.dot_product_attention(q_BLKGH.reshape(B, L, K * G, H), k_BLKH, v_BLKH,
                                          is_causal=True, implementation=implementation)
    return o_BLNH.reshape(B, L, K, G, H)


def _ring(q_BCKGH, k_BCKH, v_BCKH, axes, manual, seg_BL=None):
    """The contiguous ring's forward pass: the device's float32 output ``[B, K, G, C, H]``
    and each row's log-sum-exp ``[B, K, G, C]``, every chunk pair computed, the future masked.
    ``seg_BL``: the row's whole segment ids (:func:`_held_ids`)."""
    S = math.prod(jax.lax.axis_size(a) for a in axes)
    C = q_BCKGH.shape[1]
    me = jax.lax.axis_index(axes)
    q_pos = me * C + jnp.arange(C)
    B, _, K, G, H = q_BCKGH.shape
    to_next = [(i, (i + 1) % S) for i in range(S)]

    # Step 0 is the device's own chunk, whose diagonal gives every query row a finite max,
    # so later fully-masked chunks add exp(_NEG - m) = 0.
    state = jax.tree.map(
        lambda x: jax.lax.pcast(x, manual, to="varying"),
        (jnp.full((B, K, G, C), _NEG, jnp.float32), jnp.zeros((B, K, G, C), jnp.float32),
         jnp.zeros((B, K, G, C, H), jnp.float32)))
    k, v = k_BCKH, v_BCKH
    # Unrolled in Python (S is small): XLA can overlap each transfer with the next step's math,
    # and there are S - 1 transfers by construction -- no dead last one for DCE to find, which
    # it could not under a remat policy (FSDP's reshard-after-forward).
    for i in range(S):
        if i:
            k, v = jax.lax.ppermute((k, v), axes, to_next)
        src = (me - i) % S  # the chunk this device holds at step i
        state = _fold_blocks(state, _after(q_BCKGH, state) if i else q_BCKGH, k, v, q_pos, src * C + jnp.arange(C),
                             _held_ids(seg_BL, axes, 0), _held_ids(seg_BL, axes, i))
    m_BKGC, l_BKGC, o_BKGCH = state
    return o_BKGCH / l_BKGC[..., None], m_BKGC + jnp.log(l_BKGC)


RING_BLOCK = BLOCK  # queries and keys per block of a ring's pair: one block's scores in flight at a time


def _key_block(m: int) -> int:
    """Keys (and queries) per block of a ring's pair of ``m`` keys (queries): ``m`` itself (one
    block) where that is no more than :data:`RING_BLOCK`, else the largest divisor of ``m`` that
    is; ``m`` again where that divisor is under a quarter of the block (a pair of, say, a prime
    number of keys is not cut into many small matmuls: its scores are made whole)."""
    if m <= RING_BLOCK:
        return m
    T = max(d for d in range(1, RING_BLOCK + 1) if m % d == 0)
    return T if 4 * T >= RING_BLOCK else m


def _key_blocks(k_BMKH, v_BMKH, k_pos, k_seg, T):
    """A pair's keys, values, key positions and segment ids as the scan's ``M / T`` blocks of
    ``T`` keys. The positions are made to depend on the keys (a zero read from them, which XLA
    folds away): under remat JAX's partial evaluation would otherwise make every block's mask
    ahead of the loop and keep them all, the ``[Q, M]`` mask the blocks exist to avoid
    (:func:`_block_scores`)."""
    if k_pos is not None:
        k_pos = (k_pos + _zero_read(k_BMKH)).reshape(-1, T)
    return _blocks(k_BMKH, T), _blocks(v_BMKH, T), k_pos, _segment_blocks(k_seg, T, k_BMKH.shape[1])


def _pair_scores(q_BQKGH, k_BMKH, q_pos=None, k_pos=None, q_seg=None, k_seg=None):
    """The scaled float32 scores ``[B, K, G, Q, M]`` of a ring's pair (:func:`_fold_keys`,
    :func:`_grads_keys`), masked causally where positions are given (None: every key is before
    every query) and by document where segment ids are."""
    if q_pos is None and q_seg is None:
        return _unmasked(q_BQKGH, k_BMKH)
    if q_pos is None:
        q_pos, k_pos = jnp.zeros(q_BQKGH.shape[1], jnp.int32), jnp.zeros(k_BMKH.shape[1], jnp.int32)
    return _scores(q_BQKGH, k_BMKH, q_pos, k_pos, q_seg, k_seg)


def _fold_blocks(state, q_BQKGH, k_BMKH, v_BMKH, q_pos=None, k_pos=None, q_seg=None, k_seg=None):
    """Fold the attention of queries ``q`` to keys ``k`` (values ``v``) into the running
    (max, sum, output) of the online softmax a block of queries at a time (:func:`_key_block`
    of them, each block's rows of the state its own), each block's keys a block at a time
    (:func:`_fold_keys`): one ``[B, K, G, T, T]`` block of scores in flight rather than the
    pair's ``[..., Q, M]``. ``q_pos``, ``k_pos``: the positions to mask causally (None: no
    causal mask); ``q_seg``, ``k_seg``: packed documents' segment ids ``[B, Q]`` and ``[B, M]``."""
    T = _key_block(q_BQKGH.shape[1])
    if T == q_BQKGH.shape[1]:
        return _fold_keys(state, q_BQKGH, k_BMKH, v_BMKH, q_pos, k_pos, q_seg, k_seg)

    def rows(block):
        state_T, q_BTKGH, q_pos_T, q_seg_BT = block
        return _fold_keys(state_T, q_BTKGH, k_BMKH, v_BMKH, q_pos_T, k_pos, q_seg_BT, k_seg)

    blocks = jax.lax.map(rows, (tuple(_row_blocks(x, T) for x in state), *_query_blocks(q_BQKGH, q_pos, q_seg, T)))
    return tuple(_row_unblock(x) for x in blocks)


def _query_blocks(q_BQKGH, q_pos, q_seg, T):
    """A pair's queries, query positions and segment ids as ``Q / T`` blocks of ``T`` queries,
    the positions made to depend on the queries (:func:`_key_blocks`)."""
    B, Q = q_BQKGH.shape[:2]
    if q_pos is not None:
        q_pos = (q_pos + _zero_read(q_BQKGH)).reshape(-1, T)
    return q_BQKGH.reshape(B, Q // T, T, *q_BQKGH.shape[2:]).swapaxes(0, 1), q_pos, _segment_blocks(q_seg, T, Q)


def _row_blocks(x_BKGQ, T):
    """Per-row values ``[B, K, G, Q, ...]`` as ``[Q / T, B, K, G, T, ...]``."""
    B, K, G, Q = x_BKGQ.shape[:4]
    return jnp.moveaxis(x_BKGQ.reshape(B, K, G, Q // T, T, *x_BKGQ.shape[4:]), 3, 0)


def _row_unblock(x):
    """:func:`_row_blocks` undone."""
    x = jnp.moveaxis(x, 0, 3)
    return x.reshape(*x.shape[:3], -1, *x.shape[5:])


def _fold_keys(state, q_BQKGH, k_BMKH, v_BMKH, q_pos=None, k_pos=None, q_seg=None, k_seg=None):
    """:func:`_fold_blocks` for one block of queries: its keys :func:`_key_block` at a time, so
    that one block's ``[B, K, G, Q, T]`` scores are in flight rather than ``[..., Q, M]``."""
    def step(state, block):
        k_BTKH, v_BTKH, k_pos_T, k_seg_BT = block
        return _online_softmax(state, _pair_scores(q_BQKGH, k_BTKH, q_pos, k_pos_T, q_seg, k_seg_BT), v_BTKH), None

    T = _key_block(k_BMKH.shape[1])
    if T == k_BMKH.shape[1]:
        return step(state, (k_BMKH, v_BMKH, k_pos, k_seg))[0]
    return jax.lax.scan(step, state, _key_blocks(k_BMKH, v_BMKH, k_pos, k_seg, T))[0]


def _after(q_BQKGH, before):
    """``q`` (or a tuple of arrays: a pair's queries and their output's cotangents) made to
    depend on all of ``before``, plus a zero made from the sum of its values by a test XLA
    cannot fold: a pair computed from the result is scheduled after the pair that made
    ``before``. Pairs are otherwise free to run in any order -- scores need only queries and
    keys, and the backward pass's ``do v^T`` no query at all -- and XLA:CPU made a balanced
    step's pieces' at once and held them together (2,048 tokens a device: 16 MB against the
    contiguous ring's 5; 8.7 MB ordered by the queries alone). One element would not do: XLA
    computes a slice of a matmul or a reduction by slicing its inputs, which orders only that
    row's work."""
    from jaxshard.parallel.pipeline import zero_from  # (pipeline imports remat, which imports this module)

    zero = zero_from(sum(x.sum(dtype=jnp.float32) for x in jax.tree.leaves(before)))
    return jax.tree.map(lambda x: x + zero.astype(x.dtype), q_BQKGH)


def _fold(state, q_BQKGH, k_BMKH, v_BMKH, causal: bool, depth: int = 0, q_seg=None, k_seg=None):
    """Fold the attention of queries ``q`` to keys ``k`` (values ``v``) into the running
    (max, sum, output) of the online softmax; ``causal``: q and k are the same positions, and
    the block is halved ``depth`` times so that the corner the mask removes is skipped (the
    earlier query half never meets the later key half). ``q_seg``, ``k_seg``: packed documents'
    segment ids ``[B, Q]`` and ``[B, M]`` (None: one sequence)."""
    if causal and depth:
        n = q_BQKGH.shape[1] // 2
        first, second = (jax.tree.map(lambda x: x[..., :n] if x.ndim == 4 else x[..., :n, :], state),
                         jax.tree.map(lambda x: x[..., n:] if x.ndim == 4 else x[..., n:, :], state))
        qs, ks = (None, None) if q_seg is None else ((q_seg[:, :n], q_seg[:, n:]), (k_seg[:, :n], k_seg[:, n:]))
        first = _fold(first, q_BQKGH[:, :n], k_BMKH[:, :n], v_BMKH[:, :n], True, depth - 1,
                      *(() if qs is None else (qs[0], ks[0])))
        second = _fold(second, _after(q_BQKGH[:, n:], first), k_BMKH[:, :n], v_BMKH[:, :n], False, 0,
                       *(() if qs is None else (qs[1], ks[0])))
        second = _fold(second, _after(q_BQKGH[:, n:], second), k_BMKH[:, n:], v_BMKH[:, n:], True, depth - 1,
                       *(() if qs is None else (qs[1], ks[1])))
        return tuple(jnp.concatenate([a, b], axis=3) for a, b in zip(first, second))
    return _fold_blocks(state, q_BQKGH, k_BMKH, v_BMKH, *_pair_positions(q_BQKGH, k_BMKH, causal), q_seg, k_seg)


def _pair_positions(q_BQKGH, k_BMKH, causal: bool):
    """A pair's query and key positions for the causal mask: the same positions where
    ``causal`` (a diagonal), else None (every key before every query)."""
    return (jnp.arange(q_BQKGH.shape[1]), jnp.arange(k_BMKH.shape[1])) if causal else (None, None)


def _balanced_ring(q_BCKGH, k_BCKH, v_BCKH, axes, manual, seg_BL=None):
    """The ring over chunks that each hold the halves d and 2S - 1 - d (module docstring):
    the own step computes its two causal diagonals and the later half against the earlier;
    step i computes the later query half against the arriving earlier key half, and either the
    earlier query half against it (the sender is earlier, src < d) or the later query half
    against the sender's later key half (src > d). Which one is chosen by value (``where``),
    so every device runs the same program, two half-pairs a step. Returns the device's float32
    output ``[B, K, G, C, H]`` and each row's log-sum-exp ``[B, K, G, C]``, its halves in the
    chunk's order. ``seg_BL``: the row's whole segment ids (:func:`_held_ids`)."""
    S = math.prod(jax.lax.axis_size(a) for a in axes)
    B, C, K, G, H = q_BCKGH.shape
    h = C // 2
    me = jax.lax.axis_index(axes)
    to_next = [(i, (i + 1) % S) for i in range(S)]
    q_lo, q_hi = q_BCKGH[:, :h], q_BCKGH[:, h:]

    def fresh():
        return jax.tree.map(lambda x: jax.lax.pcast(x, manual, to="varying"),
                            (jnp.full((B, K, G, h), _NEG, jnp.float32), jnp.zeros((B, K, G, h), jnp.float32),
                             jnp.zeros((B, K, G, h, H), jnp.float32)))

    lo, hi = fresh(), fresh()
    k, v = k_BCKH, v_BCKH

    def halves(x):
        return (None, None) if x is None else (x[:, :h], x[:, h:])

    # (segment ids of the query and key halves: none without packed documents)
    k_seg = _held_ids(seg_BL, axes, 0)
    q_lo_seg, q_hi_seg = halves(k_seg)

    depth = diagonal_depth(h)
    # (each piece after the one before it: _after)
    lo = _fold(lo, q_lo, k[:, :h], v[:, :h], True, depth, q_lo_seg, halves(k_seg)[0])
    hi = _fold(hi, _after(q_hi, lo), k[:, :h], v[:, :h], False, 0, q_hi_seg, halves(k_seg)[0])
    hi = _fold(hi, _after(q_hi, hi), k[:, h:], v[:, h:], True, depth, q_hi_seg, halves(k_seg)[1])
    for i in range(1, S):
        k, v = jax.lax.ppermute((k, v), axes, to_next)
        earlier = (me - i) % S < me  # the sender's halves: src and 2S - 1 - src
        k_lo_seg, k_hi_seg = halves(_held_ids(seg_BL, axes, i))
        hi = _fold(hi, _after(q_hi, (lo, hi)), k[:, :h], v[:, :h], False, 0, q_hi_seg, k_lo_seg)
        pick = functools.partial(jnp.where, earlier)
        state = jax.tree.map(pick, lo, hi)
        segs = () if seg_BL is None else (pick(q_lo_seg, q_hi_seg), pick(k_lo_seg, k_hi_seg))
        state = _fold(state, _after(pick(q_lo, q_hi), hi), pick(k[:, :h], k[:, h:]), pick(v[:, :h], v[:, h:]),
                      False, 0, *segs)
        lo = jax.tree.map(pick, state, lo)
        hi = jax.tree.map(pick, hi, state)
    out = [o / l[..., None] for _, l, o in (lo, hi)]
    return jnp.concatenate(out, axis=3), jnp.concatenate([m + jnp.log(l) for m, l, _ in (lo, hi)], axis=3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ring_attention(q_BCKGH, k_BCKH, v_BCKH, seg_BL, axes, manual, balanced):
    """A device's ``[B, C, K, G, H]`` output of the ring (:func:`_balanced_ring` or
    :func:`_ring`), differentiated as Ring Attention's backward pass (Liu et al. 2023) rather
    than by autodiff: it keeps the device's own query, key and value chunks, the output and
    each row's log-sum-exp -- O(C) -- where autodiff kept every step's kv chunk, running output
    and probabilities (the whole sequence's keys and values on every device)."""
    return _ring_attention_fwd(q_BCKGH, k_BCKH, v_BCKH, seg_BL, axes, manual, balanced)[0]


def _ring_attention_fwd(q_BCKGH, k_BCKH, v_BCKH, seg_BL, axes, manual, balanced):
    # The output and statistic carry the name :data:`RING`, which ``--remat dots`` keeps: with
    # them kept, nothing the backward pass reads needs the steps' matmuls, so the policy keeps
    # none of those (it would otherwise keep every step's scores and p v).
    ring = _balanced_ring if balanced else _ring
    o_BKGCH, lse_BKGC = ring(q_BCKGH, k_BCKH, v_BCKH, axes, manual, seg_BL)
    out_BCKGH = checkpoint_name(o_BKGCH.transpose(0, 3, 1, 2, 4).astype(q_BCKGH.dtype), RING)
    lse_BKGC = checkpoint_name(lse_BKGC, RING)
    return out_BCKGH, (q_BCKGH, k_BCKH, v_BCKH, seg_BL, out_BCKGH, lse_BKGC)


def _ring_attention_bwd(axes, manual, balanced, res, d_BCKGH):
    """The ring again: each device's key and value chunks travel with their gradients' float32
    running sums, and at each step the device's queries' share of the attention to the chunk
    it holds is differentiated (:func:`_ring_step_grads`, the forward's pairs and masks, the
    probabilities made again from the saved log-sum-exp); the last hop brings each chunk's
    gradients home."""
    q_BCKGH, k_BCKH, v_BCKH, seg_BL, out_BCKGH, lse_BKGC = res
    S = math.prod(jax.lax.axis_size(a) for a in axes)
    to_next = [(i, (i + 1) % S) for i in range(S)]
    d_BKGCH = d_BCKGH.transpose(0, 2, 3, 1, 4).astype(jnp.float32)
    # (FlashAttention-2's D: each row's sum of the output times its cotangent)
    delta_BKGC = (d_BKGCH * out_BCKGH.transpose(0, 2, 3, 1, 4).astype(jnp.float32)).sum(-1)
    dq_BCKGH = jnp.zeros(q_BCKGH.shape, jnp.float32)
    dk_BCKH, dv_BCKH = (jax.lax.pcast(jnp.zeros(x.shape, jnp.float32), manual, to="varying") for x in (k_BCKH, v_BCKH))
    held = (k_BCKH, v_BCKH)
    for i in range(S):
        if i:
            *held, dk_BCKH, dv_BCKH = jax.lax.ppermute((*held, dk_BCKH, dv_BCKH), axes, to_next)
        # (the step's queries and cotangents after the step before: _after)
        q_i, d_i = _after((q_BCKGH, d_BKGCH), grads) if i else (q_BCKGH, d_BKGCH)
        grads = _ring_step_grads(q_i, *held, lse_BKGC, d_i, delta_BKGC, i, axes, balanced,
                                 _held_ids(seg_BL, axes, 0), _held_ids(seg_BL, axes, i))
        dq_BCKGH, dk_BCKH, dv_BCKH = (a + b for a, b in zip((dq_BCKGH, dk_BCKH, dv_BCKH), grads))
    dk_BCKH, dv_BCKH = jax.lax.ppermute((dk_BCKH, dv_BCKH), axes, to_next)  # home
    return dq_BCKGH.astype(q_BCKGH.dtype), dk_BCKH.astype(k_BCKH.dtype), dv_BCKH.astype(v_BCKH.dtype), None


_ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)


def _ring_step_grads(q_BCKGH, k_BCKH, v_BCKH, lse_BKGC, d_BKGCH, delta_BKGC, i, axes, balanced, q_seg=None,
                     k_seg=None):
    """The float32 gradients ``(dq, dk, dv)`` of step ``i`` of a ring's forward pass (the
    device's queries against the kv chunk held at that step): the same pairs and masks as
    the forward's, nothing where a pair is skipped."""
    S = math.prod(jax.lax.axis_size(a) for a in axes)
    me = jax.lax.axis_index(axes)
    C = q_BCKGH.shape[1]
    if not balanced:
        src = (me - i) % S
        return _grads_blocks(q_BCKGH, k_BCKH, v_BCKH, lse_BKGC, d_BKGCH, delta_BKGC, me * C + jnp.arange(C),
                           src * C + jnp.arange(C), q_seg, k_seg)
    h = C // 2

    def halves(x):  # (sliced as the forward slices them)
        return (None, None) if x is None else (x[:, :h], x[:, h:])

    def rows(x):  # [B, K, G, C, ...]: the query halves
        return (x[:, :, :, :h], x[:, :, :, h:])

    (q_lo, q_hi), (k_lo, k_hi), (v_lo, v_hi) = halves(q_BCKGH), halves(k_BCKH), halves(v_BCKH)
    (q_lo_seg, q_hi_seg), (k_lo_seg, k_hi_seg) = halves(q_seg), halves(k_seg)
    (lse_lo, lse_hi), (d_lo, d_hi), (delta_lo, delta_hi) = rows(lse_BKGC), rows(d_BKGCH), rows(delta_BKGC)
    if i == 0:
        depth = diagonal_depth(h)
        dq_lo, dk_lo, dv_lo = _pair_grads(q_lo, k_lo, v_lo, lse_lo, d_lo, delta_lo, True, depth, q_lo_seg, k_lo_seg)
        q_, d_ = _after((q_hi, d_hi), (dq_lo, dk_lo, dv_lo))
        dq_hi, dk_lo2, dv_lo2 = _pair_grads(q_, k_lo, v_lo, lse_hi, d_, delta_hi, False, 0, q_hi_seg, k_lo_seg)
        q_, d_ = _after((q_hi, d_hi), (dq_hi, dk_lo2, dv_lo2))
        dq_hi2, dk_hi, dv_hi = _pair_grads(q_, k_hi, v_hi, lse_hi, d_, delta_hi, True, depth, q_hi_seg, k_hi_seg)
        dq_hi, dk_lo, dv_lo = dq_hi + dq_hi2, dk_lo + dk_lo2, dv_lo + dv_lo2
    else:
        earlier = (me - i) % S < me
        pick = functools.partial(jnp.where, earlier)
        segs = () if q_seg is None else (pick(q_lo_seg, q_hi_seg), pick(k_lo_seg, k_hi_seg))
        picked = _pair_grads(pick(q_lo, q_hi), pick(k_lo, k_hi), pick(v_lo, v_hi), pick(lse_lo, lse_hi),
                             pick(d_lo, d_hi), pick(delta_lo, delta_hi), False, 0, *segs)
        q_, d_ = _after((q_hi, d_hi), picked)
        dq_hi, dk_lo, dv_lo = _pair_grads(q_, k_lo, v_lo, lse_hi, d_, delta_hi, False, 0, q_hi_seg, k_lo_seg)
        (dq_lo, dk_lo2, dv_lo2), (dq_hi2, dk_hi, dv_hi) = ([jnp.where(earlier, x, 0) for x in picked],
                                                           [jnp.where(earlier, 0, x) for x in picked])
        dq_hi, dk_lo, dv_lo = dq_hi + dq_hi2, dk_lo + dk_lo2, dv_lo + dv_lo2
    return tuple(jnp.concatenate(pair, axis=1) for pair in ((dq_lo, dq_hi), (dk_lo, dk_hi), (dv_lo, dv_hi)))


def _pair_grads(q_BQKGH, k_BMKH, v_BMKH, lse_BKGQ, d_BKGQH, delta_BKGQ, causal: bool, depth: int = 0,
                q_seg=None, k_seg=None):
    """:func:`_fold`'s pair, differentiated: float32 ``(dq, dk, dv)``; the diagonal halved
    ``depth`` times, its masked corner skipped, as the forward skipped it."""
    if causal and depth:
        n = q_BQKGH.shape[1] // 2
        qs, ks = ((None, None), (None, None)) if q_seg is None else (
            (q_seg[:, :n], q_seg[:, n:]), (k_seg[:, :n], k_seg[:, n:]))
        first = _pair_grads(q_BQKGH[:, :n], k_BMKH[:, :n], v_BMKH[:, :n], lse_BKGQ[..., :n], d_BKGQH[..., :n, :],
                            delta_BKGQ[..., :n], True, depth - 1, qs[0], ks[0])
        # (each piece's queries and cotangents after the piece before: _after)
        q_, d_ = _after((q_BQKGH[:, n:], d_BKGQH[..., n:, :]), first)
        across = _pair_grads(q_, k_BMKH[:, :n], v_BMKH[:, :n], lse_BKGQ[..., n:], d_, delta_BKGQ[..., n:], False, 0,
                             qs[1], ks[0])
        q_, d_ = _after((q_BQKGH[:, n:], d_BKGQH[..., n:, :]), across)
        second = _pair_grads(q_, k_BMKH[:, n:], v_BMKH[:, n:], lse_BKGQ[..., n:], d_, delta_BKGQ[..., n:], True,
                             depth - 1, qs[1], ks[1])
        return (jnp.concatenate([first[0], across[0] + second[0]], axis=1),
                *(jnp.concatenate([first[j] + across[j], second[j]], axis=1) for j in (1, 2)))
    positions = _pair_positions(q_BQKGH, k_BMKH, causal)
    return _grads_blocks(q_BQKGH, k_BMKH, v_BMKH, lse_BKGQ, d_BKGQH, delta_BKGQ, *positions, q_seg, k_seg)


def _grads_blocks(q_BQKGH, k_BMKH, v_BMKH, lse_BKGQ, d_BKGQH, delta_BKGQ, q_pos=None, k_pos=None, q_seg=None,
                  k_seg=None):
    """:func:`_fold_blocks`'s pair, differentiated in the blocks it was folded in: float32
    ``(dq, dk, dv)``, each query block's ``dq`` its own, ``dk`` and ``dv`` summed over them."""
    T = _key_block(q_BQKGH.shape[1])
    if T == q_BQKGH.shape[1]:
        return _grads_keys(q_BQKGH, k_BMKH, v_BMKH, lse_BKGQ, d_BKGQH, delta_BKGQ, q_pos, k_pos, q_seg, k_seg)

    def step(acc, block):
        q_BTKGH, q_pos_T, q_seg_BT, lse_BKGT, d_BKGTH, delta_BKGT = block
        dq, dk, dv = _grads_keys(q_BTKGH, k_BMKH, v_BMKH, lse_BKGT, d_BKGTH, delta_BKGT, q_pos_T, k_pos, q_seg_BT,
                                 k_seg)
        return (acc[0] + dk, acc[1] + dv), dq

    blocks = (*_query_blocks(q_BQKGH, q_pos, q_seg, T), *(_row_blocks(x, T) for x in (lse_BKGQ, d_BKGQH, delta_BKGQ)))
    zeros = tuple(jnp.zeros_like(x, jnp.float32) for x in (k_BMKH, v_BMKH))
    (dk_BMKH, dv_BMKH), dq = jax.lax.scan(step, zeros, blocks)
    return _unblock(dq, q_BQKGH.shape), dk_BMKH, dv_BMKH


def _grads_keys(q_BQKGH, k_BMKH, v_BMKH, lse_BKGQ, d_BKGQH, delta_BKGQ, q_pos=None, k_pos=None, q_seg=None,
                k_seg=None):
    """:func:`_fold_keys`'s pair, differentiated a block of keys at a time as it was folded:
    float32 ``(dq, dk, dv)``, the queries' gradient summed over the blocks."""
    def grads(k_BTKH, v_BTKH, k_pos_T, k_seg_BT):
        s_BKGQT = _pair_scores(q_BQKGH, k_BTKH, q_pos, k_pos_T, q_seg, k_seg_BT)
        return _pair_grads_of(s_BKGQT, q_BQKGH, k_BTKH, v_BTKH, lse_BKGQ, d_BKGQH, delta_BKGQ)

    T = _key_block(k_BMKH.shape[1])
    if T == k_BMKH.shape[1]:
        return grads(k_BMKH, v_BMKH, k_pos, k_seg)

    def step(dq_BQKGH, block):
        dq, dk, dv = grads(*block)
        return dq_BQKGH + dq, (dk, dv)

    dq_BQKGH, (dk, dv) = jax.lax.scan(step, jnp.zeros_like(q_BQKGH, jnp.float32),
                                      _key_blocks(k_BMKH, v_BMKH, k_pos, k_seg, T))
    return dq_BQKGH, _unblock(dk, k_BMKH.shape), _unblock(dv, v_BMKH.shape)


def _pair_grads_of(s_BKGQM, q_BQKGH, k_BMKH, v_BMKH, lse_BKGQ, d_BKGQH, delta_BKGQ):
    """FlashAttention-2's backward for one block of masked scores: p = exp(s - lse), dv = p^T
    do, dp = do v^T, ds = p (dp - D); the matmuls take the inputs' dtype and sum in float32."""
    p_BKGQM = jnp.exp(s_BKGQM - lse_BKGQ[..., None])
    d_in = d_BKGQH.astype(v_BMKH.dtype)
    dv_BMKH = jnp.einsum("bkglm,bkglh->bmkh", p_BKGQM.astype(v_BMKH.dtype), d_in, preferred_element_type=jnp.float32)
    dp_BKGQM = jnp.einsum("bkglh,bmkh->bkglm", d_in, v_BMKH, preferred_element_type=jnp.float32)
    ds_BKGQM = (p_BKGQM * (dp_BKGQM - delta_BKGQ[..., None]) / math.sqrt(q_BQKGH.shape[-1])).astype(q_BQKGH.dtype)
    dq_BQKGH = jnp.einsum("bkglm,bmkh->blkgh", ds_BKGQM, k_BMKH, preferred_element_type=jnp.float32)
    dk_BMKH = jnp.einsum("bkglm,blkgh->bmkh", ds_BKGQM, q_BQKGH, preferred_element_type=jnp.float32)
    return dq_BQKGH, dk_BMKH, dv_BMKH


def _ulysses_region(rules, q_BLKGH, k_BLKH, v_BLKH, axes, kernel, segments_BL=None):
    """Ulysses in a region manual over the batch, sequence and head-splitting (``tensor``)
    axes, so that each device's all-to-alls move only its own heads: the query heads as
    ``[B, L, N, H]`` split over tensor, the kv heads too. Where tensor does not divide the kv
    heads (grouped-query attention with fewer kv heads than tensor, which then divides each kv
    head's query heads: ``check_model``) they are repeated to one a device first, as the
    partitioner replicates them elsewhere: each device holds the kv head of its query heads."""
    B, L, K, G, H = q_BLKGH.shape
    q_spec = rules.activation_spec((Dim.BATCH, Dim.LENGTH, Dim.ACT_HEADS, None), (B, L, K * G, H))
    T = rules.size(entry_axes(q_spec[2]))
    if K % T:
        k_BLKH, v_BLKH = (jnp.repeat(x, T // K, axis=2) for x in (k_BLKH, v_BLKH))
    kv_spec = rules.activation_spec((Dim.BATCH, Dim.LENGTH, Dim.ACT_KV_HEADS, None), k_BLKH.shape)

    def local(q_BCNH, k_BCKH, v_BCKH, *seg):
        k_local, n = k_BCKH.shape[2], q_BCNH.shape[2]
        q_BCKGH = q_BCNH.reshape(*q_BCNH.shape[:2], k_local, n // k_local, H)
        return _ulysses(q_BCKGH, k_BCKH, v_BCKH, axes, kernel, *seg).reshape(q_BCNH.shape)

    manual = spec_axes(q_spec) | spec_axes(kv_spec)
    segs = () if segments_BL is None else (segments_BL,)
    o_BLNH = jax.shard_map(local, mesh=rules.context_mesh,
                           in_specs=(q_spec, kv_spec, kv_spec, *(_whole_rows(q_spec),) * len(segs)),
                           out_specs=q_spec, axis_names=manual)(q_BLKGH.reshape(B, L, K * G, H), k_BLKH, v_BLKH, *segs)
    return o_BLNH.reshape(B, L, K, G, H)


def _ulysses(q_BCKGH, k_BCKH, v_BCKH, axes, kernel, seg_BL=None):
    """DeepSpeed-Ulysses (Jacobs et al. 2023): an all-to-all over the sequence axes turns each
    device's chunk of C = L/S tokens of every head into all L tokens of 1/S of the heads; the
    dense path's attention (on GPUs cuDNN's flash kernel) runs on the whole sequence, and a
    second all-to-all brings the output back to the sequence split. Kv heads fewer than S (or
    not divisible by it) are repeated :func:`kv_copies` times first, as DeepSpeed does, so
    that each device holds the kv heads its query heads use. The backward pass is the same
    all-to-alls transposed."""
    S = math.prod(jax.lax.axis_size(a) for a in axes)
    B, C, K, G, H = q_BCKGH.shape
    r = kv_copies(K, G, S)
    if r > 1:  # query head k*G + j*G/r + g attends with copy j of kv head k: new kv head k*r + j
        q_BCKGH = q_BCKGH.reshape(B, C, K * r, G // r, H)
        k_BCKH, v_BCKH = (jnp.repeat(x, r, axis=2) for x in (k_BCKH, v_BCKH))

    def to_heads(x):  # [B, C, K', ...] -> [B, L, K'/S, ...]
        return jax.lax.all_to_all(x, axes, split_axis=2, concat_axis=1, tiled=True)

    # (packed documents: every device attends over the whole sequence with the row's whole ids)
    o_BLKGH = _dense(to_heads(q_BCKGH), to_heads(k_BCKH), to_heads(v_BCKH), kernel, seg_BL)
    o_BCKGH = jax.lax.all_to_all(o_BLKGH, axes, split_axis=1, concat_axis=2, tiled=True)
    return o_BCKGH.reshape(B, C, K, G, H)
